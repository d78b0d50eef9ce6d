//! The webhook's TLS: the serving certificate, and the client certificate every caller
//! must present (only the kube-apiserver may make admission act: `/mutate` reserves
//! addresses). Both are read from files and re-read when the files change (a cert-manager
//! or script rotation needs no restart): checked at most once a second, on a handshake; a
//! broken new file is logged and the last good one stays in use.
//!
//! A client certificate is accepted when it chains to a CA of `--client-ca-file` (and is
//! valid now, and fit for client authentication when it says what it is for) and, if
//! `--allowed-client-names` is given, its subject common name or one of its DNS subject
//! alternative names is one of them. Anything else fails the handshake: no HTTP request is
//! read from that connection, so nothing is reserved.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::crypto::ring::default_provider;
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, OtherError, RootCertStore, ServerConfig, SignatureScheme};
use tracing::{info, warn};
use crate::sync::lock;

const CHECK_EVERY: Duration = Duration::from_secs(1);

/// A value read from files, read again when one of their modification times changes.
#[derive(Debug)]
struct Followed<T> {
    files: Vec<PathBuf>,
    /// What the files hold, for log lines ("serving certificate", "client CA").
    what: &'static str,
    load: fn(&[PathBuf]) -> Result<T, String>,
    state: Mutex<Loaded<T>>,
}

#[derive(Debug)]
struct Loaded<T> {
    value: T,
    stamp: Vec<Option<SystemTime>>,
    checked: Instant,
}

fn modified(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

impl<T: Clone> Followed<T> {
    fn new(files: Vec<PathBuf>, what: &'static str, load: fn(&[PathBuf]) -> Result<T, String>) -> Result<Self, String> {
        let value = load(&files)?;
        let stamp = files.iter().map(|f| modified(f)).collect();
        Ok(Self { files, what, load, state: Mutex::new(Loaded { value, stamp, checked: Instant::now() }) })
    }

    fn current(&self) -> T {
        let mut st = lock(&self.state);
        if st.checked.elapsed() >= CHECK_EVERY {
            st.checked = Instant::now();
            let stamp: Vec<_> = self.files.iter().map(|f| modified(f)).collect();
            if stamp != st.stamp {
                match (self.load)(&self.files) {
                    Ok(value) => {
                        info!(file = %self.files[0].display(), "{} reloaded", self.what);
                        st.value = value;
                        st.stamp = stamp;
                    }
                    // Mid-rotation (one file written, not the other) or broken: keep the old
                    // value and try again on a later handshake.
                    Err(e) => warn!(error = %e, "new {} not usable yet; keeping the previous one", self.what),
                }
            }
        }
        st.value.clone()
    }
}

fn read_certs(file: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(file)
        .map_err(|e| format!("reading certificate {}: {e}", file.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("parsing certificate {}: {e}", file.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate found in {}", file.display()));
    }
    Ok(certs)
}

/// Read a certificate chain and its private key (PEM).
pub fn load_pair(cert_file: &Path, key_file: &Path) -> Result<Arc<CertifiedKey>, String> {
    let certs = read_certs(cert_file)?;
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| format!("reading private key {}: {e}", key_file.display()))?;
    let ck = CertifiedKey::from_der(certs, key, &default_provider())
        .map_err(|e| format!("certificate {} and key {} do not form a usable pair: {e}", cert_file.display(), key_file.display()))?;
    Ok(Arc::new(ck))
}

/// A certificate resolver that follows the files.
#[derive(Debug)]
pub struct ReloadingCert(Followed<Arc<CertifiedKey>>);

impl ReloadingCert {
    pub fn new(cert_file: PathBuf, key_file: PathBuf) -> Result<Self, String> {
        Followed::new(vec![cert_file, key_file], "serving certificate", |f| load_pair(&f[0], &f[1])).map(Self)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current())
    }
}

/// The CAs of a PEM bundle as a client-certificate verifier (certificate required).
fn load_client_ca(files: &[PathBuf]) -> Result<Arc<dyn ClientCertVerifier>, String> {
    let file = &files[0];
    let mut roots = RootCertStore::empty();
    for cert in read_certs(file)? {
        roots.add(cert).map_err(|e| format!("client CA {}: a certificate is not usable as a trust anchor: {e}", file.display()))?;
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::new(default_provider()))
        .build()
        .map_err(|e| format!("client CA {}: {e}", file.display()))
}

/// The subject common names and DNS subject alternative names of a certificate.
pub fn certificate_names(der: &[u8]) -> Result<Vec<String>, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let mut names: Vec<String> = cert.subject().iter_common_name().filter_map(|cn| cn.as_str().ok().map(str::to_string)).collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
                names.push(dns.to_string());
            }
        }
    }
    Ok(names)
}

/// Requires a client certificate from `--client-ca-file`, for one of `--allowed-client-names`
/// when any are given (module docs).
#[derive(Debug)]
pub struct ClientAuth {
    ca: Followed<Arc<dyn ClientCertVerifier>>,
    allowed_names: Vec<String>,
}

impl ClientAuth {
    pub fn new(ca_file: PathBuf, allowed_names: Vec<String>) -> Result<Self, String> {
        if let Some(bad) = allowed_names.iter().find(|n| n.trim().is_empty()) {
            return Err(format!("--allowed-client-names: empty name in {allowed_names:?} ({bad:?})"));
        }
        let ca = Followed::new(vec![ca_file], "client CA", load_client_ca).map_err(|e| format!("--client-ca-file: {e}"))?;
        Ok(Self { ca, allowed_names })
    }

    fn name_allowed(&self, end_entity: &CertificateDer<'_>) -> Result<(), tokio_rustls::rustls::Error> {
        if self.allowed_names.is_empty() {
            return Ok(());
        }
        let names = certificate_names(end_entity).map_err(|_| tokio_rustls::rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        if names.iter().any(|n| self.allowed_names.contains(n)) {
            return Ok(());
        }
        let why = format!("client certificate for {names:?}: none of these names is in --allowed-client-names {:?}", self.allowed_names);
        Err(tokio_rustls::rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(NameNotAllowed(why))))))
    }
}

#[derive(Debug)]
struct NameNotAllowed(String);

impl std::fmt::Display for NameNotAllowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NameNotAllowed {}

impl ClientCertVerifier for ClientAuth {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    /// No hints: the CA file may change under us, and clients (Go's crypto/tls, curl) send
    /// their certificate when the server names no CA.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(&self, end_entity: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>], now: UnixTime) -> Result<ClientCertVerified, tokio_rustls::rustls::Error> {
        self.ca.current().verify_client_cert(end_entity, intermediates, now)?;
        self.name_allowed(end_entity)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.ca.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.ca.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.ca.current().supported_verify_schemes()
    }
}

/// A TLS server configuration (HTTP/2 and HTTP/1.1) serving the files' certificate to
/// clients that pass `client_auth`.
pub fn server_config(cert_file: PathBuf, key_file: PathBuf, client_auth: ClientAuth) -> Result<Arc<ServerConfig>, String> {
    let resolver = Arc::new(ReloadingCert::new(cert_file, key_file)?);
    let mut cfg = ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?
        .with_client_cert_verifier(Arc::new(client_auth))
        .with_cert_resolver(resolver);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_client_ca_file_is_named() {
        let e = ClientAuth::new("/nonexistent/client-ca.crt".into(), vec![]).expect_err("no such file");
        assert!(e.contains("/nonexistent/client-ca.crt"), "{e}");
    }

    #[test]
    fn a_client_ca_file_without_certificates_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("ca.crt");
        std::fs::write(&file, "not a certificate\n").expect("write");
        let e = ClientAuth::new(file.clone(), vec![]).expect_err("no certificate");
        assert_eq!(e, format!("--client-ca-file: no certificate found in {}", file.display()));
    }

    #[test]
    fn an_empty_allowed_client_name_is_refused() {
        let e = ClientAuth::new("/nonexistent".into(), vec!["kube-apiserver".into(), String::new()]).expect_err("empty name");
        assert!(e.starts_with("--allowed-client-names: empty name"), "{e}");
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        assert!(certificate_names(b"\x30\x03garbage").is_err());
    }
}
