//! The webhook's serving certificate, read from files and re-read when they change (a
//! cert-manager or script rotation needs no restart). Checked at most once a second, on a
//! handshake; a broken new pair is logged and the last good one stays in use.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::crypto::ring::default_provider;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::ServerConfig;
use tracing::{info, warn};

const CHECK_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    stamp: (Option<SystemTime>, Option<SystemTime>),
    checked: Instant,
}

/// A certificate resolver that follows the files.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    state: Mutex<Loaded>,
}

fn modified(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Read a certificate chain and its private key (PEM).
pub fn load_pair(cert_file: &Path, key_file: &Path) -> Result<Arc<CertifiedKey>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .map_err(|e| format!("reading certificate {}: {e}", cert_file.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("parsing certificate {}: {e}", cert_file.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate found in {}", cert_file.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| format!("reading private key {}: {e}", key_file.display()))?;
    let ck = CertifiedKey::from_der(certs, key, &default_provider())
        .map_err(|e| format!("certificate {} and key {} do not form a usable pair: {e}", cert_file.display(), key_file.display()))?;
    Ok(Arc::new(ck))
}

impl ReloadingCert {
    pub fn new(cert_file: PathBuf, key_file: PathBuf) -> Result<Self, String> {
        let key = load_pair(&cert_file, &key_file)?;
        let stamp = (modified(&cert_file), modified(&key_file));
        Ok(Self { cert_file, key_file, state: Mutex::new(Loaded { key, stamp, checked: Instant::now() }) })
    }

    fn current(&self) -> Arc<CertifiedKey> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.checked.elapsed() >= CHECK_EVERY {
            st.checked = Instant::now();
            let stamp = (modified(&self.cert_file), modified(&self.key_file));
            if stamp != st.stamp {
                match load_pair(&self.cert_file, &self.key_file) {
                    Ok(key) => {
                        info!(cert = %self.cert_file.display(), "serving certificate reloaded");
                        st.key = key;
                        st.stamp = stamp;
                    }
                    // Mid-rotation (one file written, not the other) or broken: keep the old
                    // pair and try again on a later handshake.
                    Err(e) => warn!(error = %e, "new serving certificate not usable yet; keeping the previous one"),
                }
            }
        }
        st.key.clone()
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A TLS server configuration (HTTP/2 and HTTP/1.1) serving the files' certificate.
pub fn server_config(cert_file: PathBuf, key_file: PathBuf) -> Result<Arc<ServerConfig>, String> {
    let resolver = Arc::new(ReloadingCert::new(cert_file, key_file)?);
    let mut cfg = ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}
