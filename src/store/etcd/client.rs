//! Reaching etcd: the backend's flags and configuration, the connection, and the one
//! translator every request goes through ([`call`]: a timeout and an error read the same
//! everywhere, as an [`EtcdError`]).

use std::path::PathBuf;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions};

use crate::store::{Cause, StoreError};

/// How the etcd backend connects and batches. Flags: see [`EtcdArgs`].
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub dial_timeout: Duration,
    pub request_timeout: Duration,
    /// Most requests made durable in one transaction; 1 turns group commit off.
    pub max_batch: usize,
    /// Addresses per range this process records ahead of need and hands out from memory
    /// (the controller's `--etcd-address-pool`); 0 = none.
    pub pool_size: usize,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            prefix: DEFAULT_PREFIX.into(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            user: None,
            password: None,
            dial_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            max_batch: DEFAULT_MAX_BATCH,
            pool_size: 0,
        }
    }
}

pub const DEFAULT_PREFIX: &str = "/clusterip/ranges";
pub const DEFAULT_MAX_BATCH: usize = 1024;

/// Command-line flags of the etcd backend.
#[derive(Clone, Debug, clap::Args)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated (http:// or https://).
    #[arg(long = "etcd-endpoints", env = "CLUSTERIP_ETCD_ENDPOINTS", value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    pub endpoints: Vec<String>,
    /// Key prefix; each service CIDR is stored at <prefix>/<cidr>.
    #[arg(long = "etcd-prefix", default_value = DEFAULT_PREFIX)]
    pub prefix: String,
    /// CA bundle that signs the etcd server certificates (turns on TLS).
    #[arg(long = "etcd-cafile")]
    pub ca_file: Option<PathBuf>,
    /// Client certificate for etcd (with --etcd-keyfile).
    #[arg(long = "etcd-certfile", requires = "key_file")]
    pub cert_file: Option<PathBuf>,
    /// Client key for etcd (with --etcd-certfile).
    #[arg(long = "etcd-keyfile", requires = "cert_file")]
    pub key_file: Option<PathBuf>,
    /// etcd user name (with --etcd-password or CLUSTERIP_ETCD_PASSWORD).
    #[arg(long = "etcd-user")]
    pub user: Option<String>,
    /// etcd password.
    #[arg(long = "etcd-password", env = "CLUSTERIP_ETCD_PASSWORD", hide_env_values = true)]
    pub password: Option<String>,
    /// Time allowed to connect to etcd, e.g. 5s.
    #[arg(long = "etcd-dial-timeout", default_value = "5s", value_parser = clusterip_component_base::parse_duration)]
    pub dial_timeout: Duration,
    /// Time allowed for one etcd request, e.g. 5s.
    #[arg(long = "etcd-request-timeout", default_value = "5s", value_parser = clusterip_component_base::parse_duration)]
    pub request_timeout: Duration,
    /// Most allocations made durable in one etcd transaction (group commit); 1 = one
    /// compare-and-swap per allocation.
    #[arg(long = "etcd-max-batch", default_value_t = DEFAULT_MAX_BATCH, value_parser = parse_batch)]
    pub max_batch: usize,
}

impl From<EtcdArgs> for EtcdConfig {
    fn from(a: EtcdArgs) -> Self {
        Self {
            endpoints: a.endpoints,
            prefix: a.prefix,
            ca_file: a.ca_file,
            cert_file: a.cert_file,
            key_file: a.key_file,
            user: a.user,
            password: a.password,
            dial_timeout: a.dial_timeout,
            request_timeout: a.request_timeout,
            max_batch: a.max_batch,
            pool_size: 0,
        }
    }
}

fn parse_batch(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=65536).contains(&n) => Ok(n),
        _ => Err(format!("invalid batch size {s:?}: must be a whole number from 1 to 65536")),
    }
}


/// Connect to etcd with the configured TLS, auth and timeouts.
pub async fn connect(cfg: &EtcdConfig) -> Result<Client, StoreError> {
    let opts = connect_options(cfg)?;
    let endpoints = cfg.endpoints.join(",");
    let connecting = Client::connect(cfg.endpoints.clone(), Some(opts));
    let mut client = call(cfg.dial_timeout, connecting).await.map_err(|e| e.unavailable(format!("cannot connect to etcd at {endpoints}")))?;
    // The connection is lazy; prove etcd answers before reporting success.
    call(cfg.dial_timeout, client.status()).await.map_err(|e| e.unavailable(format!("etcd at {endpoints} does not answer")))?;
    Ok(client)
}

/// The client's options. Every request carries etcd's require-leader metadata
/// (`hasleader: true`, clientv3's `WithRequireLeader`): a member cut off from the others'
/// quorum ends our watches (etcd cancels a require-leader watch once its member has had no
/// leader for a few election timeouts) and refuses our requests with "no leader", instead
/// of keeping a watch open that shows nothing more. The watch loop then reads the range
/// again and watches anew, through a member that has a leader.
fn connect_options(cfg: &EtcdConfig) -> Result<ConnectOptions, StoreError> {
    let mut opts = ConnectOptions::new().with_connect_timeout(cfg.dial_timeout).with_timeout(cfg.request_timeout).with_require_leader(true);
    if let (Some(user), Some(pw)) = (&cfg.user, &cfg.password) {
        opts = opts.with_user(user.clone(), pw.clone());
    }
    if cfg.ca_file.is_some() || cfg.cert_file.is_some() {
        let mut tls = TlsOptions::new();
        if let Some(ca) = &cfg.ca_file {
            let pem = read_file("--etcd-cafile", ca)?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        if let (Some(cert), Some(key)) = (&cfg.cert_file, &cfg.key_file) {
            tls = tls.identity(Identity::from_pem(read_file("--etcd-certfile", cert)?, read_file("--etcd-keyfile", key)?));
        }
        opts = opts.with_tls(tls);
    }
    Ok(opts)
}

/// Why one etcd request failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// etcd (or the connection to it) answered with an error.
    #[error(transparent)]
    Rpc(#[from] etcd_client::Error),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// A stream ended before its answer came.
    #[error("{0}")]
    Closed(&'static str),
}

impl EtcdError {
    /// etcd says a lease the request names does not exist (expired or revoked): gRPC
    /// NotFound, the only NotFound a transaction of ours can get.
    pub fn lease_not_found(&self) -> bool {
        matches!(self, EtcdError::Rpc(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::NotFound)
    }

    /// The store's error for a failed request: `Unavailable`, nothing was acknowledged.
    pub fn unavailable(self, context: impl Into<String>) -> StoreError {
        StoreError::Unavailable(Cause::with(context, self))
    }
}

/// One etcd request, given `timeout` to answer: every request of the backend goes
/// through here, so a timeout and an error read the same everywhere.
pub async fn call<T>(timeout: Duration, request: impl std::future::Future<Output = Result<T, etcd_client::Error>>) -> Result<T, EtcdError> {
    match tokio::time::timeout(timeout, request).await {
        Ok(r) => r.map_err(EtcdError::Rpc),
        Err(_) => Err(EtcdError::Timeout(timeout)),
    }
}

fn read_file(flag: &str, path: &PathBuf) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|e| StoreError::Backend(Cause::with(format!("{flag} {}", path.display()), e)))
}

/// One key's value and mod revision (None when absent), within `timeout`.
pub(super) async fn get(client: &mut Client, key: &str, timeout: Duration) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
    let resp = read(client, key, None, timeout).await?;
    Ok(resp.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())))
}

/// One read (of a key, or with `with_prefix` of everything under it), within `timeout`.
pub(super) async fn read(client: &mut Client, key: &str, options: Option<GetOptions>, timeout: Duration) -> Result<etcd_client::GetResponse, StoreError> {
    call(timeout, client.get(key, options)).await.map_err(|e| e.unavailable(format!("reading {key} from etcd")))
}


#[cfg(test)]
mod tests {
    use super::*;

    /// Every request, watches included, asks for a member with a leader. (etcd-client keeps
    /// the option private; its Debug output is the one place it can be read.)
    #[test]
    fn every_request_requires_a_leader() {
        let cfg = EtcdConfig::default();
        let opts = connect_options(&cfg).expect("options without TLS files");
        let shown = format!("{opts:?}");
        assert!(shown.contains("require_leader: true"), "the etcd client does not require a leader: {shown}");
    }
}
