//! Calling the webhook as the kube-apiserver does (its client certificate, real TLS), for
//! tests that post AdmissionReviews directly.

use std::sync::Arc;

use clusterip_test_support::ControlPlane;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::apiserver_client_cert;

/// An AdmissionReview (CREATE) of the Service `default/<name>` with `spec`.
pub fn review(uid: &str, name: &str, spec: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Service"},
            "resource": {"group": "", "version": "v1", "resource": "services"},
            "name": name, "namespace": "default", "operation": "CREATE",
            "userInfo": {"username": "test"}, "dryRun": false,
            "object": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": spec}
        }
    })
}

/// A TLS client of the webhook presenting the kube-apiserver's client certificate, offering
/// only HTTP/1.1.
pub fn tls_client(cp: &ControlPlane) -> tokio_rustls::TlsConnector {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(cp.dir().join("pki/ca.crt")).expect("dev CA") {
        roots.add(c.expect("CA certificate")).expect("trust the dev CA");
    }
    let (crt, key) = apiserver_client_cert(cp);
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(crt).expect("client cert").collect::<Result<_, _>>().expect("client cert PEM");
    let key = PrivateKeyDer::from_pem_file(key).expect("client key");
    let mut cfg = ClientConfig::builder_with_provider(Arc::new(tokio_rustls::rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .expect("client certificate");
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
}

pub type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

pub async fn tls_connect(connector: &tokio_rustls::TlsConnector, port: u16) -> std::io::Result<Tls> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("server name");
    connector.connect(name, tcp).await
}

/// The head of an HTTP/1.1 POST to `path` with a body of `len` bytes.
pub fn post_head(path: &str, len: usize) -> String {
    format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
}

/// An HTTP/1.1 POST of `body` to `path` on a connection of its own: the whole answer.
pub async fn post_raw(connector: &tokio_rustls::TlsConnector, port: u16, path: &str, body: &[u8]) -> std::io::Result<String> {
    let mut s = tls_connect(connector, port).await?;
    s.write_all(post_head(path, body.len()).as_bytes()).await?;
    s.write_all(body).await?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// Whether a raw HTTP/1.1 answer is a 200 that allows the review.
pub fn allowed(answer: &str) -> bool {
    answer.starts_with("HTTP/1.1 200") && answer.contains("\"allowed\":true")
}
