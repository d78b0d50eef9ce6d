//! The etcd backend: one key per service CIDR holding the allocation map's snapshot.
//!
//! - Key: `<prefix>/<cidr>` (default prefix `/clusterip/ranges`), value: the versioned
//!   snapshot of [`AllocationMap`] (see docs/allocator.md).
//! - Every change is one etcd transaction: `if mod_revision(key) == known then put else get`.
//!   On conflict the map is rebuilt from the value the `else` branch returned and the
//!   requests are decided again — a dynamic request may get a different address, a static
//!   one may now find its address taken.
//! - Group commit: one committer task per range takes every request waiting in its queue
//!   (up to `max_batch`) and makes them durable in one transaction. With `max_batch = 1`
//!   it is one compare-and-swap per allocation, Kubernetes' strategy.
//! - A watch on each key keeps the local copy current, so reads never go to etcd and a
//!   transaction rarely conflicts on a stale copy.
//! - An answer is sent only after etcd acknowledged the write. When etcd is unreachable the
//!   callers get `Unavailable`, the local copy is marked stale and re-read before the next
//!   transaction; an allocation whose acknowledgement was lost is a leak for repair to
//!   reclaim, never a second owner.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, Identity, TlsOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::{Family, ServiceCidr};

use super::{AllocationStore, ParentRef, RangeSet, RangeUsage, StoreError};

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
        }
    }
}

pub const DEFAULT_PREFIX: &str = "/clusterip/ranges";
pub const DEFAULT_MAX_BATCH: usize = 1024;
/// Conflicting transactions retried for one batch before its callers get an error.
const MAX_CONFLICT_RETRIES: usize = 1000;

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
    #[arg(long = "etcd-dial-timeout", default_value = "5s", value_parser = parse_duration)]
    pub dial_timeout: Duration,
    /// Time allowed for one etcd request, e.g. 5s.
    #[arg(long = "etcd-request-timeout", default_value = "5s", value_parser = parse_duration)]
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
        }
    }
}

fn parse_batch(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=65536).contains(&n) => Ok(n),
        _ => Err(format!("invalid batch size {s:?}: must be a whole number from 1 to 65536")),
    }
}

/// Parse `500ms`, `5s`, `3m`, `1h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected a number with a unit, e.g. 500ms, 5s, 3m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("invalid duration {s:?}: unit must be ms, s, m or h")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("invalid duration {s:?}: must be a non-negative time"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Connect to etcd with the configured TLS, auth and timeouts.
pub async fn connect(cfg: &EtcdConfig) -> Result<Client, StoreError> {
    let mut opts = ConnectOptions::new().with_connect_timeout(cfg.dial_timeout).with_timeout(cfg.request_timeout);
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
    let endpoints = cfg.endpoints.join(",");
    let connecting = Client::connect(cfg.endpoints.clone(), Some(opts));
    let mut client = match tokio::time::timeout(cfg.dial_timeout, connecting).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(StoreError::Unavailable(format!("cannot connect to etcd at {endpoints}: {e}"))),
        Err(_) => return Err(StoreError::Unavailable(format!("cannot connect to etcd at {endpoints}: no answer within {:?}", cfg.dial_timeout))),
    };
    // The connection is lazy; prove etcd answers before reporting success.
    match tokio::time::timeout(cfg.dial_timeout, client.status()).await {
        Ok(Ok(_)) => Ok(client),
        Ok(Err(e)) => Err(StoreError::Unavailable(format!("etcd at {endpoints} does not answer: {e}"))),
        Err(_) => Err(StoreError::Unavailable(format!("etcd at {endpoints} does not answer within {:?}", cfg.dial_timeout))),
    }
}

fn read_file(flag: &str, path: &PathBuf) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|e| StoreError::Backend(format!("{flag} {}: {e}", path.display())))
}

/// The key a range is stored under.
pub fn range_key(prefix: &str, cidr: &ServiceCidr) -> String {
    format!("{}/{}", prefix.trim_end_matches('/'), cidr)
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Allocate(IpAddr),
    AllocateNext,
    Release(IpAddr),
}

type Reply = Result<Option<IpAddr>, StoreError>;

struct Request {
    op: Op,
    reply: oneshot::Sender<Reply>,
}

/// The local copy of one range: the map as of `revision` (0 = the key does not exist).
struct View {
    map: AllocationMap,
    revision: i64,
}

struct Range {
    key: String,
    view: Arc<Mutex<View>>,
    queue: mpsc::Sender<Request>,
}

/// Allocation records in etcd. Cheap to share (`Arc`); background tasks end when dropped.
pub struct EtcdStore {
    ranges: RangeSet,
    per_range: Vec<Range>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl EtcdStore {
    /// Connect, read every range's key (absent = empty) and start the committers and watches.
    pub async fn open(cfg: &EtcdConfig, cidrs: Vec<ServiceCidr>) -> Result<Self, StoreError> {
        if cidrs.is_empty() {
            return Err(StoreError::Backend("no service CIDR configured".into()));
        }
        let client = connect(cfg).await?;
        let mut per_range = Vec::new();
        let mut tasks = Vec::new();
        for cidr in &cidrs {
            let key = range_key(&cfg.prefix, cidr);
            let view = Arc::new(Mutex::new(View { map: AllocationMap::new(cidr.clone()), revision: 0 }));
            let mut c = client.clone();
            reload(&mut c, &key, cidr, &view, cfg.request_timeout).await?;
            let (tx, rx) = mpsc::channel(65536);
            let committer = Committer {
                client: client.clone(),
                key: key.clone(),
                cidr: cidr.clone(),
                view: view.clone(),
                timeout: cfg.request_timeout,
                max_batch: cfg.max_batch.max(1),
                stale: false,
            };
            tasks.push(tokio::spawn(committer.run(rx)));
            tasks.push(tokio::spawn(watch_range(client.clone(), key.clone(), cidr.clone(), view.clone(), cfg.request_timeout)));
            per_range.push(Range { key, view, queue: tx });
        }
        Ok(Self { ranges: RangeSet::new(cidrs), per_range, tasks })
    }

    /// The etcd key of each range.
    pub fn keys(&self) -> Vec<String> {
        self.per_range.iter().map(|r| r.key.clone()).collect()
    }

    async fn submit(&self, range: usize, op: Op) -> Reply {
        let (reply, answer) = oneshot::channel();
        self.per_range[range]
            .queue
            .send(Request { op, reply })
            .await
            .map_err(|_| StoreError::Unavailable("etcd committer stopped".into()))?;
        answer.await.map_err(|_| StoreError::Unavailable("etcd committer stopped".into()))?
    }

    /// The raw value of any etcd key (for importing the kube-apiserver's legacy bitmap), or
    /// None when the key does not exist.
    pub async fn read_key(cfg: &EtcdConfig, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut client = connect(cfg).await?;
        Ok(get(&mut client, key, cfg.request_timeout).await?.map(|(value, _)| value))
    }

    /// Merge every address of `legacy` into the stored map of the same CIDR (a union:
    /// nothing stored is dropped). Returns how many addresses were newly recorded.
    pub async fn import(&self, legacy: &AllocationMap) -> Result<usize, StoreError> {
        let cidr = legacy.cidr();
        let range = self
            .ranges
            .cidrs()
            .iter()
            .position(|c| c == cidr)
            .ok_or_else(|| StoreError::Backend(format!("cannot import {cidr}: it is not one of the configured ranges ({})", self.describe())))?;
        let mut added = 0;
        // One request per address through the committer keeps one code path for writes;
        // group commit turns them into a handful of transactions.
        let mut pending = futures::stream::FuturesUnordered::new();
        for ip in legacy.iter() {
            pending.push(self.submit(range, Op::Allocate(ip)));
            if pending.len() >= 4096 {
                added += drain_import(&mut pending).await?;
            }
        }
        added += drain_import(&mut pending).await?;
        Ok(added)
    }

    fn describe(&self) -> String {
        self.ranges.cidrs().iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
    }
}

async fn drain_import<F: std::future::Future<Output = Reply>>(
    pending: &mut futures::stream::FuturesUnordered<F>,
) -> Result<usize, StoreError> {
    let mut added = 0;
    while let Some(r) = pending.next().await {
        match r {
            Ok(_) => added += 1,
            Err(StoreError::Alloc(AllocError::Allocated)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(added)
}

#[async_trait]
impl AllocationStore for EtcdStore {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    fn ranges(&self) -> Vec<ServiceCidr> {
        self.ranges.cidrs().to_vec()
    }

    async fn allocate(&self, ip: IpAddr, _parent: Option<&ParentRef>) -> Result<(), StoreError> {
        let range = self.ranges.index_of(ip)?;
        self.submit(range, Op::Allocate(ip)).await.map(|_| ())
    }

    async fn allocate_next(&self, family: Family, _parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        let mut last = None;
        for range in self.ranges.of_family(family)? {
            match self.submit(range, Op::AllocateNext).await {
                Ok(Some(ip)) => return Ok(ip),
                Ok(None) => last = Some(StoreError::Alloc(AllocError::Full)),
                Err(StoreError::Alloc(AllocError::Full)) => last = Some(StoreError::Alloc(AllocError::Full)),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(StoreError::Alloc(AllocError::Full)))
    }

    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        match self.ranges.index_of(ip) {
            Ok(range) => self.submit(range, Op::Release(ip)).await.map(|_| ()),
            Err(_) => Ok(()),
        }
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        match self.ranges.index_of(ip) {
            Ok(range) => Ok(lock(&self.per_range[range].view).map.has(ip)),
            Err(_) => Ok(false),
        }
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        let mut all = Vec::new();
        for r in &self.per_range {
            all.extend(lock(&r.view).map.iter());
        }
        all.sort();
        Ok(all)
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        Ok(self
            .per_range
            .iter()
            .map(|r| {
                let v = lock(&r.view);
                RangeUsage { cidr: v.map.cidr().clone(), used: v.map.used(), free: v.map.free() }
            })
            .collect())
    }
}

fn lock(view: &Mutex<View>) -> std::sync::MutexGuard<'_, View> {
    // A poisoned lock only means another task panicked mid-update of a plain value; the
    // next transaction re-validates against etcd, so keep going with what is there.
    view.lock().unwrap_or_else(|p| p.into_inner())
}

/// Decode a stored value into a map for `cidr`.
fn decode(key: &str, cidr: &ServiceCidr, value: &[u8]) -> Result<AllocationMap, StoreError> {
    AllocationMap::restore(cidr, value)
        .map_err(|e| StoreError::Backend(format!("the allocation map stored at {key} is unreadable ({e}); it was left as it is")))
}

/// One key's value and mod revision (None when absent), within `timeout`.
async fn get(client: &mut Client, key: &str, timeout: Duration) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
    let resp = match tokio::time::timeout(timeout, client.get(key, None)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(StoreError::Unavailable(format!("reading {key} from etcd: {e}"))),
        Err(_) => return Err(StoreError::Unavailable(format!("reading {key} from etcd: no answer within {timeout:?}"))),
    };
    Ok(resp.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())))
}

/// Replace the local copy with what etcd holds now.
async fn reload(client: &mut Client, key: &str, cidr: &ServiceCidr, view: &Mutex<View>, timeout: Duration) -> Result<(), StoreError> {
    let (map, revision) = match get(client, key, timeout).await? {
        Some((value, revision)) => (decode(key, cidr, &value)?, revision),
        None => (AllocationMap::new(cidr.clone()), 0),
    };
    let mut v = lock(view);
    v.map = map;
    v.revision = revision;
    Ok(())
}

struct Committer {
    client: Client,
    key: String,
    cidr: ServiceCidr,
    view: Arc<Mutex<View>>,
    timeout: Duration,
    max_batch: usize,
    /// The local copy may be behind etcd after an error: re-read before deciding.
    stale: bool,
}

impl Committer {
    async fn run(mut self, mut queue: mpsc::Receiver<Request>) {
        while let Some(first) = queue.recv().await {
            let mut batch = vec![first];
            while batch.len() < self.max_batch {
                match queue.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            let ops: Vec<Op> = batch.iter().map(|r| r.op).collect();
            match self.commit(&ops).await {
                Ok(results) => {
                    for (req, res) in batch.into_iter().zip(results) {
                        let _ = req.reply.send(res.map_err(StoreError::Alloc));
                    }
                }
                Err(e) => {
                    let text = e.to_string();
                    let transient = e.is_transient();
                    for req in batch {
                        let err = if transient { StoreError::Unavailable(text.clone()) } else { StoreError::Backend(text.clone()) };
                        let _ = req.reply.send(Err(err));
                    }
                }
            }
        }
    }

    /// Decide `ops` against the current map and make the result durable in one transaction.
    async fn commit(&mut self, ops: &[Op]) -> Result<Vec<Result<Option<IpAddr>, AllocError>>, StoreError> {
        for attempt in 0..MAX_CONFLICT_RETRIES {
            if self.stale {
                reload(&mut self.client, &self.key, &self.cidr, &self.view, self.timeout).await?;
                self.stale = false;
            }
            let (mut map, revision) = {
                let v = lock(&self.view);
                (v.map.clone(), v.revision)
            };
            let mut changed = false;
            let mut release_missed = false;
            let results: Vec<_> = ops
                .iter()
                .map(|op| match *op {
                    Op::Allocate(ip) => map.allocate(ip).map(|()| {
                        changed = true;
                        Some(ip)
                    }),
                    Op::AllocateNext => map.allocate_next().map(|ip| {
                        changed = true;
                        Some(ip)
                    }),
                    Op::Release(ip) => {
                        if map.has(ip) {
                            map.release(ip);
                            changed = true;
                        } else {
                            release_missed = true;
                        }
                        Ok(None)
                    }
                })
                .collect();
            if !changed {
                // A release of an address our copy does not know may be racing the watch
                // (another process allocated it a moment ago): read etcd once and decide again.
                if release_missed && attempt == 0 {
                    self.stale = true;
                    continue;
                }
                return Ok(results);
            }
            let value = map.snapshot();
            let guard = if revision == 0 {
                Compare::version(self.key.clone(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(self.key.clone(), CompareOp::Equal, revision)
            };
            let txn = Txn::new()
                .when([guard])
                .and_then([TxnOp::put(self.key.clone(), value, None)])
                .or_else([TxnOp::get(self.key.clone(), None)]);
            let resp = match tokio::time::timeout(self.timeout, self.client.txn(txn)).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    self.stale = true;
                    return Err(StoreError::Unavailable(format!("writing {} to etcd: {e}", self.key)));
                }
                Err(_) => {
                    self.stale = true;
                    return Err(StoreError::Unavailable(format!("writing {} to etcd: no answer within {:?}", self.key, self.timeout)));
                }
            };
            if resp.succeeded() {
                let new_revision = resp.header().map(|h| h.revision()).unwrap_or(revision + 1);
                let mut v = lock(&self.view);
                if v.revision < new_revision {
                    v.map = map;
                    v.revision = new_revision;
                }
                return Ok(results);
            }
            // Lost the race: adopt what etcd holds and decide again.
            debug!(key = %self.key, attempt, "allocation map changed concurrently; retrying on the new version");
            let current = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => Some(g.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision()))),
                _ => None,
            });
            let (map, revision) = match current.flatten() {
                Some((value, rev)) => (decode(&self.key, &self.cidr, &value)?, rev),
                None => (AllocationMap::new(self.cidr.clone()), 0),
            };
            let mut v = lock(&self.view);
            if v.revision <= revision {
                v.map = map;
                v.revision = revision;
            }
        }
        Err(StoreError::Unavailable(format!("{}: gave up after {MAX_CONFLICT_RETRIES} conflicting writes", self.key)))
    }
}

/// Keep the local copy of one range current from etcd's watch; re-read and re-watch after
/// any interruption (etcd restarted, compaction).
async fn watch_range(mut client: Client, key: String, cidr: ServiceCidr, view: Arc<Mutex<View>>, timeout: Duration) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let from = lock(&view).revision + 1;
        let started = client.watch(key.clone(), Some(WatchOptions::new().with_start_revision(from))).await;
        let (_watcher, mut stream) = match started {
            Ok(s) => s,
            Err(e) => {
                debug!(%key, error = %e, "watch failed to start; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        while let Some(msg) = stream.next().await {
            let resp = match msg {
                Ok(r) => r,
                Err(e) => {
                    debug!(%key, error = %e, "watch interrupted");
                    break;
                }
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                break;
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let mut v = lock(&view);
                if kv.mod_revision() <= v.revision {
                    continue;
                }
                match ev.event_type() {
                    EventType::Put => match AllocationMap::restore(&cidr, kv.value()) {
                        Ok(map) => {
                            v.map = map;
                            v.revision = kv.mod_revision();
                        }
                        Err(e) => warn!(%key, error = %e, "ignoring an unreadable allocation map from the watch"),
                    },
                    EventType::Delete => {
                        v.map = AllocationMap::new(cidr.clone());
                        v.revision = 0;
                    }
                }
            }
        }
        // Interrupted: the copy may have missed events; read the key again before watching.
        if let Err(e) = reload(&mut client, &key, &cidr, &view, timeout).await {
            debug!(%key, error = %e, "reload after watch interruption failed; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}
