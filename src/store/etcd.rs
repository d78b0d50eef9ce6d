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
//! - With an address pool (`pool_size > 0`, the controller), dynamic requests are answered
//!   from addresses this process recorded ahead of need; see [`super::etcd_pool`] for how
//!   pool keys, the lease and claims keep that race-free.
//! - Owners other than Services (a Gateway, anything `clusterip allocate --parent` names)
//!   are recorded under `<range key>/owner/<address>` (the parentRef as JSON), written in
//!   the same transaction as the allocation and deleted in the same transaction as the
//!   release. A release is conditional on the owner key: an unowned release (a Service's
//!   address, the repair pass) requires that no owner key exists, an owned one that the key
//!   names the releaser — each as a compare in the transaction, so a stale copy can only
//!   cause a retry, never a release of another owner's address. Service addresses carry
//!   no owner key: the kube-apiserver records them itself, as IPAddress objects.
//! - A value that cannot be decoded is never guessed at: an unreadable map stops every
//!   change to its range (and reads of what it holds) with [`StoreError::Corrupt`] and is
//!   never overwritten, until [`EtcdStore::rebuild_unreadable`] (`clusterip repair
//!   --rebuild`) replaces it; an unreadable owner key keeps its address held. Both are
//!   reported by [`AllocationStore::unreadable`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity, PutOptions, TlsOptions, Txn,
    TxnOp, TxnOpResponse, WatchOptions,
};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::{Family, ServiceCidr};

use super::etcd_pool::{
    claim_key, decode_pool, encode_pool, pool_prefix, pool_target, Claim, ClaimAnswer, LeaseState, OwnPool, CLAIM_LEASE_TTL_S, CLAIM_TIMEOUT, LEASE_MARGIN,
    LEASE_TTL,
};
use super::{AllocationStore, Cause, ParentRef, RangeSet, RangeUsage, StoreError, Unreadable};
use crate::sync::lock;

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
    Duration::try_from_secs_f64(secs).map_err(|_| format!("invalid duration {s:?}: too long"))
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
    let mut client = call(cfg.dial_timeout, connecting).await.map_err(|e| e.unavailable(format!("cannot connect to etcd at {endpoints}")))?;
    // The connection is lazy; prove etcd answers before reporting success.
    call(cfg.dial_timeout, client.status()).await.map_err(|e| e.unavailable(format!("etcd at {endpoints} does not answer")))?;
    Ok(client)
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

/// The key a range is stored under.
pub fn range_key(prefix: &str, cidr: &ServiceCidr) -> String {
    format!("{}/{}", prefix.trim_end_matches('/'), cidr)
}

#[derive(Clone, Debug)]
enum Op {
    /// Record the address; with an owner, also its owner key.
    Allocate(IpAddr, Option<ParentRef>),
    AllocateNext(Option<ParentRef>),
    /// Release the address: with no owner, only while no owner key exists; with one, only
    /// while the owner key names it (the key is deleted with it).
    Release(IpAddr, Option<ParentRef>),
    /// Record the owner of an address the map already holds for us (taken from a pool).
    Own(IpAddr, ParentRef),
    /// Record up to this many addresses into this replica's pool (see [`super::etcd_pool`]).
    Fill(usize),
    /// Rewrite this replica's pool key to what its pool holds now.
    SyncPool,
    /// Release these addresses (the pool, returned on shutdown) and delete the pool key.
    Return(Vec<IpAddr>),
}

/// Per op: the addresses it recorded (none for a release).
type Reply = Result<Vec<IpAddr>, StoreError>;

/// `<range key>/owner/` — the prefix of the owner keys of one range's addresses.
pub fn owner_prefix(range_key: &str) -> String {
    format!("{range_key}/owner/")
}

/// The owner key of an address.
pub fn owner_key(range_key: &str, ip: IpAddr) -> String {
    format!("{}{ip}", owner_prefix(range_key))
}

/// An owner key's value.
fn encode_owner(owner: &ParentRef) -> Vec<u8> {
    serde_json::to_vec(owner).unwrap_or_default()
}

/// The resource of the owner an unreadable owner key stands for.
pub const UNREADABLE_OWNER: &str = "unreadable-owner-record";

/// An owner key's value read back. An unreadable value still marks the address as owned
/// (by an owner that cannot be named), so no unowned release takes it: it fails closed.
fn decode_owner(value: &[u8]) -> ParentRef {
    parse_owner(value).unwrap_or_else(|_| ParentRef {
        group: String::new(),
        resource: UNREADABLE_OWNER.into(),
        namespace: None,
        name: String::from_utf8_lossy(value).chars().take(64).collect(),
    })
}

/// An owner key's value, strictly: a parentRef naming a resource and an object.
fn parse_owner(value: &[u8]) -> Result<ParentRef, String> {
    let p: ParentRef = serde_json::from_slice(value).map_err(|e| format!("not a parentRef: {e}"))?;
    if p.resource.is_empty() || p.name.is_empty() {
        return Err("a parentRef without a resource or a name".into());
    }
    Ok(p)
}

/// How long `/readyz` waits for etcd (the Deployment's probe gives up after 2 s).
const READY_TIMEOUT: Duration = Duration::from_millis(1500);

/// Why an allocation map may not be used, for the errors callers get.
const MAP_CONSEQUENCE: &str = "no address of this range is allocated or released until the map is rebuilt: `clusterip repair --rebuild`";
const OWNER_CONSEQUENCE: &str = "the address stays allocated; only an operator releases it (docs/operations.md, \"Corrupt records\")";

struct Request {
    op: Op,
    /// None for background work (pool fills and syncs) nobody waits for.
    reply: Option<oneshot::Sender<Reply>>,
}

/// The local copy of one range: the map as of `revision` (0 = the key does not exist), and
/// every replica's pool key and pending claim under the range key.
struct View {
    map: AllocationMap,
    revision: i64,
    /// Highest etcd revision read (by a get or the watch) under the range key's prefix.
    watched: i64,
    /// Pool member → the addresses its pool key lists.
    pools: BTreeMap<String, BTreeSet<IpAddr>>,
    /// Address → its owner key's owner (owners other than Services).
    owners: BTreeMap<IpAddr, ParentRef>,
    /// Records under the range key that cannot be read: key → (kind, reason). While the map
    /// itself is unreadable the range allocates and releases nothing (fails closed).
    unreadable: BTreeMap<String, (&'static str, String)>,
}

impl View {
    /// The member whose pool key lists `ip`.
    fn pool_owner(&self, ip: IpAddr) -> Option<&str> {
        self.pools.iter().find(|(_, s)| s.contains(&ip)).map(|(m, _)| m.as_str())
    }

    /// Held in a pool: ours as our memory says (our pool key may still list addresses we
    /// handed out a moment ago), another replica's as its pool key says.
    fn pooled(&self, ip: IpAddr, own: &OwnPool, own_member: Option<&str>, range: usize) -> bool {
        own.holds(range, ip) || self.pool_owner(ip).is_some_and(|m| Some(m) != own_member)
    }

    /// The error for any change to this range while its map is unreadable.
    fn map_unreadable(&self, key: &str) -> Option<StoreError> {
        let (_, reason) = self.unreadable.get(key)?;
        Some(StoreError::Corrupt { record: format!("the allocation map stored at {key}"), reason: reason.clone(), consequence: MAP_CONSEQUENCE })
    }

    /// Allocated in the map and not held in anyone's pool: a record of some object.
    fn records(&self, ip: IpAddr, own: &OwnPool, own_member: Option<&str>, range: usize) -> bool {
        self.map.has(ip) && !self.pooled(ip, own, own_member, range)
    }
}

struct Range {
    key: String,
    view: Arc<Mutex<View>>,
    queue: mpsc::Sender<Request>,
}

/// Claims this process is waiting on: address → where the owner's answer goes.
type Waiters = Arc<Mutex<HashMap<IpAddr, oneshot::Sender<ClaimAnswer>>>>;

/// Allocation records in etcd. Cheap to share (`Arc`); background tasks end when dropped.
pub struct EtcdStore {
    ranges: RangeSet,
    per_range: Vec<Range>,
    client: Client,
    timeout: Duration,
    pool: Arc<OwnPool>,
    /// Our name in claims we make.
    name: String,
    waiters: Waiters,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Everything the watch of one range needs to act on what it sees.
#[derive(Clone)]
struct RangeCtx {
    index: usize,
    key: String,
    cidr: ServiceCidr,
    view: Arc<Mutex<View>>,
    pool: Arc<OwnPool>,
    queue: mpsc::Sender<Request>,
    name: String,
    waiters: Waiters,
    client: Client,
    timeout: Duration,
}

/// Queue background work for a range's committer; dropped when the queue is full (a later
/// pop asks again).
fn enqueue(queue: &mpsc::Sender<Request>, op: Op) {
    let _ = queue.try_send(Request { op, reply: None });
}

fn unique_name() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
    format!("p{}-{nanos:x}", std::process::id())
}

impl EtcdStore {
    /// Connect, read every range's key (absent = empty) and start the committers and watches.
    /// With `cfg.pool_size > 0` this replica also keeps an address pool per range.
    pub async fn open(cfg: &EtcdConfig, cidrs: Vec<ServiceCidr>) -> Result<Self, StoreError> {
        if cidrs.is_empty() {
            return Err(StoreError::Config("no service CIDR configured".into()));
        }
        let client = connect(cfg).await?;
        let targets: Vec<usize> = cidrs.iter().map(|c| pool_target(cfg.pool_size, c)).collect();
        let pool = Arc::new(OwnPool::new(&targets));
        let name = unique_name();
        let waiters: Waiters = Arc::default();
        let mut per_range = Vec::new();
        let mut tasks = Vec::new();
        for (index, cidr) in cidrs.iter().enumerate() {
            let key = range_key(&cfg.prefix, cidr);
            let view = Arc::new(Mutex::new(View {
                map: AllocationMap::new(cidr.clone()),
                revision: 0,
                watched: 0,
                pools: BTreeMap::new(),
                owners: BTreeMap::new(),
                unreadable: BTreeMap::new(),
            }));
            let (tx, rx) = mpsc::channel(65536);
            let ctx = RangeCtx {
                index,
                key: key.clone(),
                cidr: cidr.clone(),
                view: view.clone(),
                pool: pool.clone(),
                queue: tx.clone(),
                name: name.clone(),
                waiters: waiters.clone(),
                client: client.clone(),
                timeout: cfg.request_timeout,
            };
            reload(&ctx).await?;
            let committer = Committer { ctx: ctx.clone(), max_batch: cfg.max_batch.max(1), stale: false };
            tasks.push(tokio::spawn(committer.run(rx)));
            tasks.push(tokio::spawn(watch_range(ctx)));
            per_range.push(Range { key, view, queue: tx });
        }
        let queues: Vec<_> = per_range.iter().map(|r| r.queue.clone()).collect();
        if pool.enabled() {
            tasks.push(tokio::spawn(keep_lease(client.clone(), pool.clone(), queues)));
        }
        Ok(Self { ranges: RangeSet::new(cidrs), per_range, client, timeout: cfg.request_timeout, pool, name, waiters, tasks })
    }

    /// The etcd key of each range.
    pub fn keys(&self) -> Vec<String> {
        self.per_range.iter().map(|r| r.key.clone()).collect()
    }

    /// Addresses this replica holds in its pool, per range (in configuration order).
    pub fn pooled(&self) -> Vec<usize> {
        (0..self.per_range.len()).map(|i| self.pool.len(i)).collect()
    }

    /// Whether this replica's pool can hand out addresses now (a pool is configured, its
    /// lease is alive and at least one address is pooled).
    pub fn pool_ready(&self) -> bool {
        self.pool.live_lease(Instant::now()).is_some() && self.pool.targets().iter().enumerate().all(|(i, t)| *t == 0 || self.pool.len(i) > 0)
    }

    async fn submit(&self, range: usize, op: Op) -> Reply {
        let (reply, answer) = oneshot::channel();
        self.per_range[range]
            .queue
            .send(Request { op, reply: Some(reply) })
            .await
            .map_err(|_| StoreError::Unavailable(Cause::new("etcd committer stopped")))?;
        answer.await.map_err(|_| StoreError::Unavailable(Cause::new("etcd committer stopped")))?
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
            .ok_or_else(|| StoreError::Config(format!("cannot import {cidr}: it is not one of the configured ranges ({})", self.describe())))?;
        let mut added = 0;
        // One request per address through the committer keeps one code path for writes;
        // group commit turns them into a handful of transactions.
        let mut pending = futures::stream::FuturesUnordered::new();
        for ip in legacy.iter() {
            pending.push(self.submit(range, Op::Allocate(ip, None)));
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

    /// Ask the replica `owner` for `ip`, which its pool key lists (see the module docs of
    /// [`super::etcd_pool`]).
    async fn claim(&self, range: usize, ip: IpAddr, owner: String) -> Result<(), StoreError> {
        match self.ask_owner(range, ip, &owner).await? {
            Some(ClaimAnswer::Granted) => {
                debug!(%ip, %owner, "took the address from another replica's pool");
                Ok(())
            }
            // Refused (handed out), or another request is claiming it right now.
            Some(ClaimAnswer::Refused) | None => Err(StoreError::Alloc(AllocError::Allocated)),
        }
    }

    /// Write a claim on `ip` and wait for `owner`'s answer. None: another request of any
    /// process claims the same address right now (and may get it).
    async fn ask_owner(&self, range: usize, ip: IpAddr, owner: &str) -> Result<Option<ClaimAnswer>, StoreError> {
        let owner = owner.to_string();
        let key = claim_key(&self.per_range[range].key, ip);
        let (tx, answer) = oneshot::channel();
        {
            let mut w = lock(&self.waiters);
            if w.contains_key(&ip) {
                // Another request of this process is claiming the same address.
                return Ok(None);
            }
            w.insert(ip, tx);
        }
        let claim = Claim { owner: owner.clone(), claimant: self.name.clone(), answer: None };
        let mut client = self.client.clone();
        let created = match self.write_claim(&mut client, &key, &claim).await {
            Ok(created) => created,
            Err(e) => {
                lock(&self.waiters).remove(&ip);
                return Err(StoreError::Unavailable(Cause::with(format!("claiming {ip} from the pool of {owner}"), e)));
            }
        };
        if !created {
            // Someone else claims it right now: one of us gets it, and it is not us.
            lock(&self.waiters).remove(&ip);
            return Ok(None);
        }
        let answer = tokio::time::timeout(CLAIM_TIMEOUT, answer).await;
        lock(&self.waiters).remove(&ip);
        if let Err(e) = call(self.timeout, client.delete(key.clone(), None)).await {
            debug!(%key, error = %e, "could not delete an answered claim; the next claim replaces it, and its lease ends it");
        }
        match answer {
            Ok(Ok(a)) => {
                // Granted or refused, the owner does not pool it (any more): its pool key may
                // still list it until the owner rewrites it; our copy stops believing it now.
                if let Some(listed) = lock(&self.per_range[range].view).pools.get_mut(&owner) {
                    listed.remove(&ip);
                }
                Ok(Some(a))
            }
            _ => Err(StoreError::Unavailable(Cause::new(format!(
                "{ip} is held in the address pool of replica {owner}, which did not answer a claim within {CLAIM_TIMEOUT:?}; retry"
            )))),
        }
    }

    /// Write `claim` at `key` unless a live claim is there: true when ours was written.
    ///
    /// Every claim hangs on a short lease of its own that nobody renews, so a claim left
    /// behind (its claimant died, or its delete failed) is gone within [`CLAIM_LEASE_TTL_S`]
    /// seconds. A claim that is finished already — answered, unreadable, an earlier one of
    /// ours, or addressed to a replica that no longer pools the address — is replaced at
    /// once (compare on its mod revision). So a stale claim never blocks an address.
    async fn write_claim(&self, client: &mut Client, key: &str, claim: &Claim) -> Result<bool, Cause> {
        let body = serde_json::to_vec(claim).map_err(|e| Cause::with("encoding a claim", e))?;
        let lease = call(self.timeout, client.lease_grant(CLAIM_LEASE_TTL_S, None)).await.map_err(|e| Cause::with("granting the claim's lease", e))?.id();
        let put = || TxnOp::put(key, body.clone(), Some(PutOptions::new().with_lease(lease)));
        let txn = Txn::new().when([Compare::version(key, CompareOp::Equal, 0)]).and_then([put()]).or_else([TxnOp::get(key, None)]);
        let resp = call(self.timeout, client.txn(txn)).await.map_err(|e| Cause::with("writing the claim", e))?;
        if resp.succeeded() {
            return Ok(true);
        }
        let existing = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())),
            _ => None,
        });
        let Some((value, revision)) = existing else { return Ok(false) };
        let finished = match serde_json::from_slice::<Claim>(&value) {
            Ok(c) => c.answer.is_some() || c.claimant == claim.claimant || c.owner != claim.owner,
            Err(_) => true,
        };
        if !finished {
            return Ok(false);
        }
        debug!(%key, "replacing a finished claim");
        let txn = Txn::new().when([Compare::mod_revision(key, CompareOp::Equal, revision)]).and_then([put()]);
        let resp = call(self.timeout, client.txn(txn)).await.map_err(|e| Cause::with("replacing a finished claim", e))?;
        Ok(resp.succeeded())
    }

    /// An address from this replica's pool, queueing the pool key rewrite and the refill it
    /// calls for.
    fn pop_pooled(&self, range: usize) -> Option<IpAddr> {
        let p = self.pool.pop(range, Instant::now())?;
        let queue = &self.per_range[range].queue;
        if p.sync {
            enqueue(queue, Op::SyncPool);
        }
        if let Some(n) = p.refill {
            enqueue(queue, Op::Fill(n));
        }
        Some(p.ip)
    }

    /// Kubernetes' band rule: a dynamic request gets a static-band address only when the
    /// dynamic band is full. Pools hold dynamic addresses in reserve, so when the map's pick
    /// is static while a pool (ours, just refilled, or another replica's) still holds a
    /// dynamic one, take that instead and give the static one back.
    async fn prefer_dynamic(&self, range: usize, ip: IpAddr) -> IpAddr {
        if !in_static_band(&self.ranges.cidrs()[range], ip) {
            return ip;
        }
        let better = match self.pop_pooled(range) {
            Some(ip) => Some(ip),
            None => self.claim_any(range).await,
        };
        let Some(better) = better else { return ip };
        if let Err(e) = self.submit(range, Op::Release(ip, None)).await {
            debug!(%ip, error = %e, "could not give back a static-band address; the repair pass reclaims it");
        }
        better
    }

    /// The range is full but for other replicas' pools: claim one of their addresses (a few
    /// candidates, in turn), so pools never make a range look full before it is.
    async fn claim_any(&self, range: usize) -> Option<IpAddr> {
        const CANDIDATES: usize = 16;
        let own = self.pool.lease().map(|l| l.member());
        let candidates: Vec<(IpAddr, String)> = {
            let view = lock(&self.per_range[range].view);
            view.pools
                .iter()
                .filter(|(m, _)| Some(m.as_str()) != own.as_deref())
                .flat_map(|(m, ips)| ips.iter().map(move |ip| (*ip, m.clone())))
                .take(CANDIDATES)
                .collect()
        };
        // An owner that does not answer (dead, its lease not yet expired) is asked once.
        let mut silent: BTreeSet<String> = BTreeSet::new();
        for (ip, owner) in candidates {
            if silent.contains(&owner) {
                continue;
            }
            match self.claim(range, ip, owner.clone()).await {
                Ok(()) => return Some(ip),
                Err(e) => {
                    debug!(%ip, error = %e, "claiming a pooled address failed; trying the next");
                    if e.is_transient() {
                        silent.insert(owner);
                    }
                }
            }
        }
        None
    }

    /// Give this replica's pool back (release its addresses, delete its pool keys) and
    /// revoke its lease. Called on shutdown; a replica that dies without it leaves its pool
    /// to the lease TTL and the repair pass.
    pub async fn return_pool(&self) -> Result<usize, StoreError> {
        self.pool.close();
        let Some(lease) = self.pool.lease() else { return Ok(0) };
        let mut returned = 0;
        for (i, _) in self.per_range.iter().enumerate() {
            let ips = self.pool.take_all(i);
            returned += ips.len();
            self.submit(i, Op::Return(ips)).await?;
        }
        self.pool.set_lease(None);
        let mut client = self.client.clone();
        if let Err(e) = client.lease_revoke(lease.id).await {
            debug!(error = %e, "revoking the pool lease failed; it expires by itself");
        }
        Ok(returned)
    }
}

/// The owner an allocation records: its parent, unless that is a Service (the
/// kube-apiserver records a Service's addresses itself, as IPAddress objects).
fn recorded_owner(parent: Option<&ParentRef>) -> Option<ParentRef> {
    parent.filter(|p| !p.is_service()).cloned()
}

/// What [`EtcdStore::rebuild_unreadable`] wrote for one range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rebuilt {
    pub key: String,
    /// Addresses in the new map.
    pub addresses: usize,
    /// Of those: held by the cluster (Services, IPAddress objects), recorded under an owner
    /// key, listed in a replica's pool key (an address may count in more than one).
    pub from_cluster: usize,
    pub owned: usize,
    pub pooled: usize,
}

impl EtcdStore {
    /// Replace every unreadable allocation map with one rebuilt from what else records an
    /// allocation: `cluster` (the addresses the cluster's Services and IPAddress objects
    /// hold), the range's owner keys, and every replica's pool key (pooled addresses must
    /// stay allocated: their replica may hand them out). Readable maps are left alone. The
    /// write compares the unreadable value's mod revision, so a map someone rewrote
    /// meanwhile is never overwritten. The running controllers' watches pick the new map up.
    pub async fn rebuild_unreadable(&self, cluster: &BTreeSet<IpAddr>) -> Result<Vec<Rebuilt>, StoreError> {
        let mut done = Vec::new();
        for (i, r) in self.per_range.iter().enumerate() {
            let cidr = &self.ranges.cidrs()[i];
            let key = &r.key;
            let resp = read(&mut self.client.clone(), key, Some(GetOptions::new().with_prefix()), self.timeout).await?;
            let Some(stored) = resp.kvs().iter().find(|kv| kv.key() == key.as_bytes()) else { continue };
            if AllocationMap::restore(cidr, stored.value()).is_ok() {
                continue;
            }
            let mut map = AllocationMap::new(cidr.clone());
            let (mut from_cluster, mut owned, mut pooled) = (0, 0, 0);
            for ip in cluster.iter().filter(|ip| cidr.contains(**ip)) {
                from_cluster += usize::from(map.allocate(*ip).is_ok() || map.has(*ip));
            }
            for kv in resp.kvs() {
                let Ok(k) = kv.key_str() else { continue };
                match classify(key, k) {
                    Under::Owner(ip) => owned += usize::from(map.allocate(ip).is_ok() || map.has(ip)),
                    Under::Pool(_) => {
                        for ip in decode_pool(kv.value()) {
                            pooled += usize::from(map.allocate(ip).is_ok() || map.has(ip));
                        }
                    }
                    _ => {}
                }
            }
            let txn = Txn::new()
                .when([Compare::mod_revision(key.clone(), CompareOp::Equal, stored.mod_revision())])
                .and_then([TxnOp::put(key.clone(), map.snapshot(), None)]);
            let resp = call(self.timeout, self.client.clone().txn(txn)).await.map_err(|e| e.unavailable(format!("writing the rebuilt map to {key}")))?;
            if !resp.succeeded() {
                return Err(StoreError::Unavailable(Cause::new(format!("{key} changed while it was being rebuilt; run the rebuild again"))));
            }
            info!(%key, addresses = map.used(), "rebuilt an unreadable allocation map");
            done.push(Rebuilt { key: key.clone(), addresses: map.used() as usize, from_cluster, owned, pooled });
        }
        Ok(done)
    }

    /// Whether range `range` may change: not while its map is unreadable.
    fn usable(&self, range: usize) -> Result<(), StoreError> {
        match lock(&self.per_range[range].view).map_unreadable(&self.per_range[range].key) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// After taking `ip` from a pool (ours, or another replica's by a claim): record its
    /// owner, if it has one to record.
    async fn own(&self, range: usize, ip: IpAddr, owner: Option<ParentRef>) -> Result<(), StoreError> {
        match owner {
            Some(o) => self.submit(range, Op::Own(ip, o)).await.map(|_| ()),
            None => Ok(()),
        }
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

    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError> {
        let range = self.ranges.index_of(ip)?;
        self.usable(range)?;
        let owner = recorded_owner(parent);
        if self.pool.take(range, ip) {
            // Ours, pooled: it is recorded already; the pool key is rewritten without it.
            enqueue(&self.per_range[range].queue, Op::SyncPool);
            return self.own(range, ip, owner).await;
        }
        let pooled_by = lock(&self.per_range[range].view).pool_owner(ip).map(str::to_string);
        if let Some(pooled_by) = pooled_by {
            if self.pool.lease().map(|l| l.member()) == Some(pooled_by.clone()) {
                // Our pool key still lists it, but our pool no longer holds it: handed out.
                return Err(StoreError::Alloc(AllocError::Allocated));
            }
            self.claim(range, ip, pooled_by).await?;
            return self.own(range, ip, owner).await;
        }
        self.submit(range, Op::Allocate(ip, owner)).await.map(|_| ())
    }

    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        if let Some(owner) = recorded_owner(parent) {
            // Pools are for Services; an owned address is chosen in a transaction that also
            // writes its owner key.
            let mut last = None;
            for range in self.ranges.of_family(family)? {
                match self.submit(range, Op::AllocateNext(Some(owner.clone()))).await {
                    Ok(ips) if !ips.is_empty() => return Ok(ips[0]),
                    Ok(_) | Err(StoreError::Alloc(AllocError::Full)) => last = Some(StoreError::Alloc(AllocError::Full)),
                    Err(e) => return Err(e),
                }
            }
            return Err(last.unwrap_or(StoreError::Alloc(AllocError::Full)));
        }
        let mut last = None;
        for range in self.ranges.of_family(family)? {
            // Not even from the pool while the map is unreadable: what it held is unknown.
            if let Err(e) = self.usable(range) {
                last = Some(e);
                continue;
            }
            if let Some(ip) = self.pop_pooled(range) {
                return Ok(ip);
            }
            if let Some(n) = self.pool.start_fill(range, Instant::now()) {
                enqueue(&self.per_range[range].queue, Op::Fill(n));
            }
            match self.submit(range, Op::AllocateNext(None)).await {
                Ok(ips) if !ips.is_empty() => return Ok(self.prefer_dynamic(range, ips[0]).await),
                // Full but for pools: ours (a refill may have landed in the same
                // transaction) or another replica's.
                Ok(_) | Err(StoreError::Alloc(AllocError::Full)) => match self.pop_pooled(range) {
                    Some(ip) => return Ok(ip),
                    None => match self.claim_any(range).await {
                        Some(ip) => return Ok(ip),
                        None => last = Some(StoreError::Alloc(AllocError::Full)),
                    },
                },
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(StoreError::Alloc(AllocError::Full)))
    }

    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(()) };
        if self.pool.holds(range, ip) {
            return Ok(()); // pooled here: free already
        }
        let own = self.pool.lease().map(|l| l.member());
        let other_pool = lock(&self.per_range[range].view).pool_owner(ip).map(str::to_string).filter(|m| Some(m) != own.as_ref());
        if let Some(owner) = other_pool {
            // Another replica's pool key lists it: still pooled there, or handed out a moment
            // ago (the key is rewritten after hand-outs). Only the owner knows; ask it with a
            // claim. Granted: it left the pool and is ours now; refused: it was handed out,
            // so it is a record. Either way it is released below; the map is never changed
            // while the owner could still hand it out.
            if self.ask_owner(range, ip, &owner).await?.is_none() {
                return Err(StoreError::Unavailable(Cause::new(format!("{ip} is being claimed from the address pool of replica {owner} right now; retry the release"))));
            }
        }
        self.submit(range, Op::Release(ip, None)).await.map(|_| ())
    }

    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        let Some(owner) = recorded_owner(Some(owner)) else { return self.release(ip).await };
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(()) };
        self.submit(range, Op::Release(ip, Some(owner))).await.map(|_| ())
    }

    async fn owner(&self, ip: IpAddr) -> Result<Option<ParentRef>, StoreError> {
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(None) };
        let mut client = self.client.clone();
        Ok(get(&mut client, &owner_key(&self.per_range[range].key, ip), self.timeout).await?.map(|(v, _)| decode_owner(&v)))
    }

    async fn owners(&self) -> Result<Vec<(IpAddr, ParentRef)>, StoreError> {
        let mut all = Vec::new();
        for r in &self.per_range {
            let prefix = owner_prefix(&r.key);
            let resp = read(&mut self.client.clone(), &prefix, Some(GetOptions::new().with_prefix()), self.timeout).await?;
            all.extend(owners_in(&prefix, resp.kvs()));
        }
        all.sort_by_key(|(ip, _)| *ip);
        Ok(all)
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        let member = self.pool.lease().map(|l| l.member());
        match self.ranges.index_of(ip) {
            Ok(range) => {
                self.usable(range)?;
                Ok(lock(&self.per_range[range].view).records(ip, &self.pool, member.as_deref(), range))
            }
            Err(_) => Ok(false),
        }
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        let member = self.pool.lease().map(|l| l.member());
        let mut all = Vec::new();
        for (i, r) in self.per_range.iter().enumerate() {
            // Not the last good copy of an unreadable map: what it holds now is unknown.
            self.usable(i)?;
            let v = lock(&r.view);
            all.extend(v.map.iter().filter(|ip| v.records(*ip, &self.pool, member.as_deref(), i)));
        }
        all.sort();
        Ok(all)
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        let member = self.pool.lease().map(|l| l.member());
        Ok(self
            .per_range
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let v = lock(&r.view);
                let mut pooled: BTreeSet<IpAddr> = v.pools.iter().filter(|(m, _)| Some(m.as_str()) != member.as_deref()).flat_map(|(_, s)| s.iter().copied()).collect();
                pooled.extend(self.pool.listing_peek(i));
                let pooled = pooled.into_iter().filter(|ip| v.map.has(*ip)).count() as u64;
                RangeUsage { cidr: v.map.cidr().clone(), used: v.map.used() - pooled, free: v.map.free() + pooled, pooled }
            })
            .collect())
    }

    async fn ready(&self) -> Result<(), StoreError> {
        for i in 0..self.per_range.len() {
            self.usable(i)?;
        }
        // One linearizable read: answered only while etcd has a quorum.
        let key = &self.per_range[0].key;
        read(&mut self.client.clone(), key, Some(GetOptions::new().with_count_only()), self.timeout.min(READY_TIMEOUT)).await.map(|_| ())
    }

    fn unreadable(&self) -> Vec<Unreadable> {
        let mut all = Vec::new();
        for r in &self.per_range {
            let v = lock(&r.view);
            all.extend(v.unreadable.iter().map(|(k, (kind, reason))| Unreadable { kind, record: k.clone(), reason: reason.clone() }));
        }
        all
    }

    async fn close(&self) -> Result<(), StoreError> {
        let n = self.return_pool().await?;
        if n > 0 {
            info!(returned = n, "returned the address pool");
        }
        Ok(())
    }
}

/// Decode a stored value into a map for `cidr`.
fn decode(key: &str, cidr: &ServiceCidr, value: &[u8]) -> Result<AllocationMap, StoreError> {
    AllocationMap::restore(cidr, value).map_err(|e| StoreError::Corrupt {
        record: format!("the allocation map stored at {key}"),
        reason: e.to_string(),
        consequence: MAP_CONSEQUENCE,
    })
}

/// One key's value and mod revision (None when absent), within `timeout`.
async fn get(client: &mut Client, key: &str, timeout: Duration) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
    let resp = read(client, key, None, timeout).await?;
    Ok(resp.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())))
}

/// One read (of a key, or with `with_prefix` of everything under it), within `timeout`.
async fn read(client: &mut Client, key: &str, options: Option<GetOptions>, timeout: Duration) -> Result<etcd_client::GetResponse, StoreError> {
    call(timeout, client.get(key, options)).await.map_err(|e| e.unavailable(format!("reading {key} from etcd")))
}

/// The owner keys among `kvs` (read under `prefix`, the range's owner prefix).
fn owners_in<'a>(prefix: &'a str, kvs: &'a [etcd_client::KeyValue]) -> impl Iterator<Item = (IpAddr, ParentRef)> + 'a {
    kvs.iter().filter_map(move |kv| {
        let ip = kv.key_str().ok()?.strip_prefix(prefix).and_then(|t| crate::cidr::parse_ip(t).ok())?;
        Some((ip, decode_owner(kv.value())))
    })
}

/// What a key under a range's prefix is.
enum Under<'a> {
    Map,
    Pool(&'a str),
    Claim(IpAddr),
    Owner(IpAddr),
    Other,
}

fn classify<'a>(range_key: &str, key: &'a str) -> Under<'a> {
    if key == range_key {
        return Under::Map;
    }
    let Some(rest) = key.strip_prefix(range_key).and_then(|r| r.strip_prefix('/')) else { return Under::Other };
    if let Some(member) = rest.strip_prefix("pool/") {
        return Under::Pool(member);
    }
    if let Some(Ok(ip)) = rest.strip_prefix("owner/").map(crate::cidr::parse_ip) {
        return Under::Owner(ip);
    }
    match rest.strip_prefix("claim/").map(crate::cidr::parse_ip) {
        Some(Ok(ip)) => Under::Claim(ip),
        _ => Under::Other,
    }
}

/// Apply one key's new value (None = deleted) at `mod_revision` to the view, and act on a
/// claim: answer one addressed to our pool, or wake our waiter on an answered one.
fn apply(ctx: &RangeCtx, key: &str, value: Option<&[u8]>, mod_revision: i64) {
    let mut v = lock(&ctx.view);
    v.watched = v.watched.max(mod_revision);
    match classify(&ctx.key, key) {
        Under::Map => {
            if mod_revision <= v.revision {
                return;
            }
            match value {
                Some(value) => match AllocationMap::restore(&ctx.cidr, value) {
                    Ok(map) => {
                        v.map = map;
                        v.revision = mod_revision;
                        if v.unreadable.remove(&ctx.key).is_some() {
                            info!(key = %ctx.key, "the allocation map is readable again; allocating from it");
                        }
                    }
                    Err(e) => {
                        // Keep the last good copy for reads, but change nothing until the
                        // map is readable again: a write based on the old copy would drop
                        // whatever was allocated since (fail closed).
                        warn!(key = %ctx.key, error = %e, "the allocation map in etcd is unreadable; allocating nothing from this range until `clusterip repair --rebuild`");
                        v.unreadable.insert(ctx.key.clone(), ("allocation_map", e.to_string()));
                    }
                },
                None => {
                    v.map = AllocationMap::new(ctx.cidr.clone());
                    v.revision = 0;
                    v.unreadable.remove(&ctx.key);
                }
            }
        }
        Under::Pool(member) => match value {
            Some(value) => {
                v.pools.insert(member.to_string(), decode_pool(value));
            }
            None => {
                v.pools.remove(member);
            }
        },
        Under::Owner(ip) => match value {
            Some(value) => {
                match parse_owner(value) {
                    Ok(_) => v.unreadable.remove(key),
                    Err(e) => {
                        warn!(%key, error = %e, "an owner record in etcd is unreadable; its address stays allocated");
                        v.unreadable.insert(key.to_string(), ("owner", e))
                    }
                };
                v.owners.insert(ip, decode_owner(value));
            }
            None => {
                v.unreadable.remove(key);
                v.owners.remove(&ip);
            }
        },
        Under::Claim(ip) => {
            drop(v);
            let Some(claim) = value.and_then(|b| serde_json::from_slice::<Claim>(b).ok()) else { return };
            match claim.answer {
                Some(answer) if claim.claimant == ctx.name => {
                    if let Some(tx) = lock(&ctx.waiters).remove(&ip) {
                        let _ = tx.send(answer);
                    }
                }
                None if ctx.pool.lease().map(|l| l.member()) == Some(claim.owner.clone()) => {
                    let ctx = ctx.clone();
                    let key = key.to_string();
                    tokio::spawn(async move { answer_claim(ctx, key, ip, claim).await });
                }
                _ => {}
            }
        }
        Under::Other => {}
    }
}

/// The owner's side of a claim: take the address out of our pool (from then on we never
/// hand it out) and say whether we still had it.
async fn answer_claim(ctx: RangeCtx, key: String, ip: IpAddr, claim: Claim) {
    let granted = ctx.pool.take(ctx.index, ip);
    if granted {
        enqueue(&ctx.queue, Op::SyncPool);
    }
    let answer = Claim { answer: Some(if granted { ClaimAnswer::Granted } else { ClaimAnswer::Refused }), ..claim };
    let Ok(body) = serde_json::to_vec(&answer) else { return };
    // Only while the claim exists (the claimant may have given up), keeping its lease.
    let txn = Txn::new()
        .when([Compare::version(key.clone(), CompareOp::Greater, 0)])
        .and_then([TxnOp::put(key.clone(), body, Some(PutOptions::new().with_ignore_lease()))]);
    let mut client = ctx.client.clone();
    match call(ctx.timeout, client.txn(txn)).await {
        Ok(r) if r.succeeded() => debug!(%ip, granted, claimant = %answer.claimant, "answered a claim on a pooled address"),
        Ok(_) => debug!(%ip, "a claim was withdrawn before it was answered; the address is left to repair"),
        Err(e) => warn!(%ip, error = %e, "could not answer a claim on a pooled address"),
    }
}

/// Replace the local copy with what etcd holds now under the range key's prefix.
async fn reload(ctx: &RangeCtx) -> Result<(), StoreError> {
    let key = &ctx.key;
    let resp = read(&mut ctx.client.clone(), key, Some(GetOptions::new().with_prefix()), ctx.timeout).await?;
    let mut map = Some(AllocationMap::new(ctx.cidr.clone()));
    let mut revision = 0;
    let mut unreadable = BTreeMap::new();
    let mut rest = Vec::new();
    for kv in resp.kvs() {
        let Ok(k) = kv.key_str() else { continue };
        match classify(key, k) {
            Under::Map => match AllocationMap::restore(&ctx.cidr, kv.value()) {
                Ok(m) => {
                    map = Some(m);
                    revision = kv.mod_revision();
                }
                Err(e) => {
                    warn!(%key, error = %e, "the allocation map in etcd is unreadable; allocating nothing from this range until `clusterip repair --rebuild`");
                    unreadable.insert(key.clone(), ("allocation_map", e.to_string()));
                    map = None;
                }
            },
            Under::Other => {}
            _ => rest.push((k.to_string(), kv.value().to_vec(), kv.mod_revision())),
        }
    }
    {
        let mut v = lock(&ctx.view);
        // An unreadable map keeps the last good copy (and its revision) for reads.
        if let Some(map) = map {
            v.map = map;
            v.revision = revision;
        }
        v.unreadable = unreadable;
        v.pools.clear();
        v.owners.clear();
        v.watched = resp.header().map(|h| h.revision()).unwrap_or(revision);
    }
    for (k, value, rev) in rest {
        apply(ctx, &k, Some(&value), rev);
    }
    Ok(())
}

struct Committer {
    ctx: RangeCtx,
    max_batch: usize,
    /// The local copy may be behind etcd after an error: re-read before deciding.
    stale: bool,
}

/// What one decided batch writes besides the map.
#[derive(Default)]
struct PoolWrite {
    /// Addresses the batch's fills recorded.
    filled: Vec<IpAddr>,
    /// A fill ran (successful or not): the pool is told when the batch ends.
    fills: bool,
    /// Rewrite the pool key.
    sync: bool,
    /// Delete the pool key (the pool was returned).
    delete: bool,
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
            let ops: Vec<Op> = batch.iter().map(|r| r.op.clone()).collect();
            match self.commit(&ops).await {
                Ok(results) => {
                    for (req, res) in batch.into_iter().zip(results) {
                        if let Some(reply) = req.reply {
                            let _ = reply.send(res);
                        }
                    }
                }
                Err(e) => {
                    for req in batch {
                        if let Some(reply) = req.reply {
                            let _ = reply.send(Err(e.clone()));
                        }
                    }
                }
            }
        }
    }

    /// Decide `ops` against the current map and make the result durable in one transaction.
    async fn commit(&mut self, ops: &[Op]) -> Result<Vec<Reply>, StoreError> {
        let result = self.commit_inner(ops).await;
        if ops.iter().any(|op| matches!(op, Op::Fill(_))) {
            // Tell the pool the fill ended, with nothing on failure (the map is unchanged then).
            // Addresses recorded under a lease that is no longer ours (lost meanwhile) are not
            // pooled: their pool key is gone, so they are records for the repair pass.
            let (filled, under) = match &result {
                Ok((_, filled, under)) => (filled.clone(), *under),
                Err(_) => (Vec::new(), None),
            };
            if !self.ctx.pool.fill_done(self.ctx.index, &filled, under) {
                warn!(key = %self.ctx.key, addresses = filled.len(), "a pool fill landed after its lease was lost; its addresses are left to the repair pass");
            }
        }
        result.map(|(results, _, _)| results)
    }

    #[allow(clippy::type_complexity)]
    async fn commit_inner(&mut self, ops: &[Op]) -> Result<(Vec<Reply>, Vec<IpAddr>, Option<i64>), StoreError> {
        let key = self.ctx.key.clone();
        for attempt in 0..MAX_CONFLICT_RETRIES {
            if self.stale {
                reload(&self.ctx).await?;
                self.stale = false;
            }
            let (mut map, revision, mut owners) = {
                let v = lock(&self.ctx.view);
                if let Some(e) = v.map_unreadable(&key) {
                    return Err(e);
                }
                (v.map.clone(), v.revision, v.owners.clone())
            };
            let lease = self.ctx.pool.lease();
            let mut changed = false;
            let mut release_missed = false;
            let mut pw = PoolWrite::default();
            // Owner keys to write or delete, and what each must be for the writes to apply.
            let mut owner_ops: Vec<TxnOp> = Vec::new();
            let mut owner_guards: Vec<Compare> = Vec::new();
            let results: Vec<Reply> = ops
                .iter()
                .map(|op| match op {
                    Op::Allocate(ip, owner) => match map.allocate(*ip) {
                        Ok(()) => {
                            changed = true;
                            if let Some(o) = owner {
                                owner_ops.push(TxnOp::put(owner_key(&key, *ip), encode_owner(o), None));
                                owners.insert(*ip, o.clone());
                            }
                            Ok(vec![*ip])
                        }
                        Err(e) => Err(e.into()),
                    },
                    Op::AllocateNext(owner) => match map.allocate_next() {
                        Ok(ip) => {
                            changed = true;
                            if let Some(o) = owner {
                                owner_ops.push(TxnOp::put(owner_key(&key, ip), encode_owner(o), None));
                                owners.insert(ip, o.clone());
                            }
                            Ok(vec![ip])
                        }
                        Err(e) => Err(e.into()),
                    },
                    Op::Release(ip, releaser) => {
                        let okey = owner_key(&key, *ip);
                        match (owners.get(ip), releaser) {
                            (Some(o), _) if o.resource == UNREADABLE_OWNER => {
                                return Err(StoreError::Corrupt {
                                    record: format!("the owner record {okey}"),
                                    reason: "not a parentRef".into(),
                                    consequence: OWNER_CONSEQUENCE,
                                })
                            }
                            (Some(o), None) => return Err(StoreError::NotOwner { ip: *ip, owner: o.clone() }),
                            (Some(o), Some(r)) if o != r => return Err(StoreError::NotOwner { ip: *ip, owner: o.clone() }),
                            (Some(o), Some(_)) => {
                                owner_guards.push(Compare::value(okey.clone(), CompareOp::Equal, encode_owner(o)));
                                owner_ops.push(TxnOp::delete(okey, None));
                                owners.remove(ip);
                            }
                            (None, Some(_)) if map.has(*ip) => {
                                return Err(StoreError::NoOwnerRecorded(*ip));
                            }
                            (None, _) => owner_guards.push(Compare::version(okey, CompareOp::Equal, 0)),
                        }
                        if map.has(*ip) {
                            map.release(*ip);
                            changed = true;
                        } else {
                            release_missed = true;
                        }
                        Ok(Vec::new())
                    }
                    Op::Own(ip, o) => {
                        if !map.has(*ip) || owners.contains_key(ip) {
                            return Err(AllocError::Allocated.into());
                        }
                        let okey = owner_key(&key, *ip);
                        owner_guards.push(Compare::version(okey.clone(), CompareOp::Equal, 0));
                        owner_ops.push(TxnOp::put(okey, encode_owner(o), None));
                        owners.insert(*ip, o.clone());
                        Ok(vec![*ip])
                    }
                    Op::Fill(n) => {
                        pw.fills = true;
                        if lease.is_none() {
                            return Ok(Vec::new());
                        }
                        // Dynamic band only: the static band is for requested addresses and
                        // for dynamic requests once the dynamic band is full, never a reserve.
                        let mut got = Vec::new();
                        while got.len() < *n {
                            match map.allocate_next() {
                                Ok(ip) if in_static_band(&self.ctx.cidr, ip) => {
                                    map.release(ip);
                                    break;
                                }
                                Ok(ip) => got.push(ip),
                                Err(_) => break,
                            }
                        }
                        changed |= !got.is_empty();
                        pw.filled.extend_from_slice(&got);
                        pw.sync = true;
                        Ok(got)
                    }
                    Op::SyncPool => {
                        pw.sync = true;
                        Ok(Vec::new())
                    }
                    Op::Return(ips) => {
                        for ip in ips {
                            if map.has(*ip) {
                                map.release(*ip);
                                changed = true;
                            }
                        }
                        pw.delete = true;
                        Ok(Vec::new())
                    }
                })
                .collect();
            let pool_op = match lease {
                Some(l) if pw.delete => Some(TxnOp::delete(format!("{}{}", pool_prefix(&key), l.member()), None)),
                Some(l) if pw.sync => {
                    let mut listing = self.ctx.pool.listing(self.ctx.index);
                    listing.extend_from_slice(&pw.filled);
                    Some(TxnOp::put(format!("{}{}", pool_prefix(&key), l.member()), encode_pool(listing), Some(PutOptions::new().with_lease(l.id))))
                }
                _ => None,
            };
            if !changed && pool_op.is_none() && owner_ops.is_empty() {
                // A release of an address our copy does not know may be racing the watch
                // (another process allocated it a moment ago): read etcd once and decide again.
                if release_missed && attempt == 0 {
                    self.stale = true;
                    continue;
                }
                return Ok((results, Vec::new(), None));
            }
            let mut then = Vec::new();
            let mut guards = Vec::new();
            if changed {
                guards.push(if revision == 0 {
                    Compare::version(key.clone(), CompareOp::Equal, 0)
                } else {
                    Compare::mod_revision(key.clone(), CompareOp::Equal, revision)
                });
                then.push(TxnOp::put(key.clone(), map.snapshot(), None));
            }
            then.extend(pool_op);
            guards.extend(owner_guards);
            then.extend(owner_ops);
            let txn = Txn::new()
                .when(guards)
                .and_then(then)
                .or_else([TxnOp::get(key.clone(), None), TxnOp::get(owner_prefix(&key), Some(GetOptions::new().with_prefix()))]);
            let resp = match call(self.ctx.timeout, self.ctx.client.clone().txn(txn)).await {
                Ok(r) => r,
                Err(e) => {
                    if e.lease_not_found() && lease.is_some() {
                        // Our lease ran out under us: the pool is no longer ours to hand
                        // out. Drop it and decide the batch again without pool writes.
                        self.ctx.pool.set_lease(None);
                        let dropped = self.ctx.pool.drop_all();
                        warn!(key = %key, dropped, "the address pool's etcd lease expired; pooled addresses are left to the repair pass");
                        continue;
                    }
                    self.stale = true;
                    return Err(e.unavailable(format!("writing {key} to etcd")));
                }
            };
            if resp.succeeded() {
                if changed {
                    let new_revision = resp.header().map(|h| h.revision()).unwrap_or(revision + 1);
                    let mut v = lock(&self.ctx.view);
                    if v.revision < new_revision {
                        v.map = map;
                        v.revision = new_revision;
                        v.owners = owners;
                    }
                }
                return Ok((results, pw.filled, lease.map(|l| l.id)));
            }
            // Lost the race: adopt what etcd holds and decide again.
            debug!(key = %key, attempt, "allocation map changed concurrently; retrying on the new version");
            let mut gets = resp.op_responses().into_iter().filter_map(|r| match r {
                TxnOpResponse::Get(g) => Some(g),
                _ => None,
            });
            let current = gets.next().and_then(|g| g.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())));
            let prefix = owner_prefix(&key);
            let now_owned: Option<BTreeMap<IpAddr, ParentRef>> = gets.next().map(|g| owners_in(&prefix, g.kvs()).collect());
            let (map, revision) = match current {
                Some((value, rev)) => match decode(&key, &self.ctx.cidr, &value) {
                    Ok(map) => (map, rev),
                    Err(e) => {
                        if let StoreError::Corrupt { reason, .. } = &e {
                            lock(&self.ctx.view).unreadable.insert(key.clone(), ("allocation_map", reason.clone()));
                        }
                        return Err(e);
                    }
                },
                None => (AllocationMap::new(self.ctx.cidr.clone()), 0),
            };
            let mut v = lock(&self.ctx.view);
            if v.revision <= revision {
                v.map = map;
                v.revision = revision;
                // Read in the same transaction as the map, so of the same moment.
                if let Some(owned) = now_owned {
                    v.owners = owned;
                }
            }
        }
        Err(StoreError::Unavailable(Cause::new(format!("{key}: gave up after {MAX_CONFLICT_RETRIES} conflicting writes"))))
    }
}

fn in_static_band(cidr: &ServiceCidr, ip: IpAddr) -> bool {
    cidr.static_band().is_some_and(|b| b.first <= ip && ip <= b.last)
}

/// Keep the local copy of one range current from etcd's watch of everything under the range
/// key (the map, pool keys, claims); re-read and re-watch after any interruption (etcd
/// restarted, compaction).
async fn watch_range(ctx: RangeCtx) {
    let mut client = ctx.client.clone();
    let key = ctx.key.clone();
    let mut backoff = Duration::from_millis(100);
    loop {
        let from = lock(&ctx.view).watched + 1;
        let started = client.watch(key.clone(), Some(WatchOptions::new().with_prefix().with_start_revision(from))).await;
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
                let Ok(k) = kv.key_str() else { continue };
                let value = match ev.event_type() {
                    EventType::Put => Some(kv.value()),
                    EventType::Delete => None,
                };
                apply(&ctx, k, value, kv.mod_revision());
            }
        }
        // Interrupted: the copy may have missed events; read the keys again before watching.
        if let Err(e) = reload(&ctx).await {
            debug!(%key, error = %e, "reload after watch interruption failed; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

/// Hold the pool's etcd lease: grant one, renew it every third of its TTL, and when it is
/// lost (expired, or not renewed in time) drop the pool and start over with a new lease.
/// Each new lease starts a fill of every range's pool.
async fn keep_lease(mut client: Client, pool: Arc<OwnPool>, queues: Vec<mpsc::Sender<Request>>) {
    let ttl = LEASE_TTL.as_secs() as i64;
    while !pool.is_closed() {
        let asked = Instant::now();
        let id = match client.lease_grant(ttl, None).await {
            Ok(r) => r.id(),
            Err(e) => {
                warn!(error = %e, "could not get an etcd lease for the address pool; admissions use etcd directly until it works");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut state = LeaseState { id, valid_until: asked + LEASE_TTL };
        pool.set_lease(Some(state));
        info!(lease = %state.member(), sizes = ?pool.targets(), "address pool started");
        for (i, q) in queues.iter().enumerate() {
            if let Some(n) = pool.start_fill(i, Instant::now()) {
                enqueue(q, Op::Fill(n));
            }
        }
        loop {
            tokio::time::sleep(LEASE_TTL / 3).await;
            if pool.is_closed() {
                return;
            }
            if pool.lease() != Some(state) {
                break; // dropped by the committer (lease not found)
            }
            let sent = Instant::now();
            match renew(&mut client, id).await {
                Ok(left) if left > 0 => {
                    state.valid_until = sent + Duration::from_secs(left as u64);
                    pool.set_lease(Some(state));
                }
                Ok(_) => break,
                Err(e) if Instant::now() + LEASE_MARGIN >= state.valid_until => {
                    warn!(error = %e, "the address pool's etcd lease could not be renewed in time");
                    break;
                }
                Err(e) => debug!(error = %e, "renewing the address pool's lease failed; retrying"),
            }
        }
        pool.set_lease(None);
        let dropped = pool.drop_all();
        warn!(dropped, "address pool lease lost: pooled addresses are no longer handed out (the repair pass reclaims them)");
    }
}

/// One keep-alive round trip; the TTL etcd reports (0 = the lease is gone).
async fn renew(client: &mut Client, id: i64) -> Result<i64, EtcdError> {
    let round = async {
        let (mut keeper, mut stream) = client.lease_keep_alive(id).await?;
        keeper.keep_alive().await?;
        match stream.message().await? {
            Some(r) => Ok(r.ttl()),
            None => Err(EtcdError::Closed("keep-alive stream closed")),
        }
    };
    let limit = Duration::from_secs(5);
    tokio::time::timeout(limit, round).await.map_err(|_| EtcdError::Timeout(limit))?
}
