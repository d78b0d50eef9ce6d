//! `clusterip controller`: the control-plane Deployment's entrypoint. Serves the admission
//! webhook over HTTPS, metrics and the kubelet's probes over HTTP (each on its own port).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tracing::info;

use crate::controller::events::ServiceEvents;
use crate::controller::leader::{self, ElectionConfig};
use crate::controller::supervise::{self, Ended};
use crate::metrics::Metrics;
use crate::serve;
use crate::store::ipaddress::apiserver_ips::ApiserverIps;
use crate::store::AllocationStore as _;
use crate::webhook::admission::Admission;
use crate::webhook::{server, tls};

use super::backend::{kube_client, BackendArgs, BackendKind, ReplicaBackend, Role};
use super::reconcilers::Reconcilers;

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// A configuration file whose fields are these flags, in camelCase (`--leader-elect-lease-name`
    /// → `leaderElectLeaseName`; a repeatable flag takes a list, a switch true or false),
    /// under `apiVersion: clusterip.allocator/v1alpha1` and `kind: ControllerConfiguration`.
    /// A flag given here overrides its field; a field overrides an environment variable.
    /// Every field is checked at start, and each bad one named (docs/operations.md,
    /// "Configuration file").
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    #[command(flatten)]
    pub backend: BackendArgs,

    /// (etcd backend) Addresses per range each replica records in etcd ahead of need and
    /// hands out from memory, so a dynamic admission does not wait for an etcd write. Pooled
    /// addresses are free, not leaks: they are listed under a pool key on this replica's etcd
    /// lease and returned on shutdown. Capped per range at an eighth of its dynamic band.
    /// 0 = allocate with one etcd transaction per admission. Default 1024. Refused with
    /// the ipaddress backend.
    #[arg(long, value_parser = parse_pool)]
    pub etcd_address_pool: Option<usize>,

    /// (ipaddress backend) Addresses per block. Each replica answers dynamic requests from
    /// blocks of the range it holds exclusively (a Lease `clusterip-block-…` per block in
    /// --leader-elect-namespace), from memory; a replica whose blocks are used up while
    /// others hold the rest asks one of them to hand a block over. Unset: per range, a
    /// sixteenth of the addresses its CIDR spans, at most 256 (8 for a /25,
    /// 256 from a /20 up). Set: keep it at most (addresses in the range) / (4 × replicas).
    /// Replicas with different sizes never share an address (docs/backends.md).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub address_block_size: Option<u64>,

    /// (ipaddress backend) How long another replica observes a block's Lease unchanged, on
    /// its own clock, before it takes the block over (its holder stopped renewing it).
    #[arg(long, default_value = "120s", value_parser = parse_timeout)]
    pub address_block_lease_duration: std::time::Duration,

    /// (ipaddress backend) A replica stops answering from a block this long before anyone
    /// may take it over. Must exceed the kube-apiserver's --request-timeout (60s by
    /// default): the longest an answered address can stay unrecorded.
    #[arg(long, default_value = "75s", value_parser = parse_timeout)]
    pub address_block_margin: std::time::Duration,

    /// The kube-apiserver's --request-timeout (Kubernetes' default 1m0s): the longest a
    /// create can stay in the apiserver after our webhook answered it. No API tells it, so
    /// state it here when the apiserver's is raised. The controller refuses to start unless
    /// --in-flight-limit and (ipaddress backend) --address-block-margin exceed it.
    #[arg(long, default_value = "60s", value_parser = parse_timeout)]
    pub apiserver_request_timeout: std::time::Duration,

    /// Address of the HTTPS admission webhook (POST /mutate, POST /validate). Port 0 picks
    /// a free port; the "clusterip controller started" log line names the one bound.
    #[arg(long, default_value = "0.0.0.0:9443")]
    pub webhook_bind_address: SocketAddr,

    /// PEM certificate chain the webhook serves; re-read when the file changes.
    #[arg(long, env = "CLUSTERIP_TLS_CERT_FILE")]
    pub tls_cert_file: PathBuf,

    /// PEM private key of the serving certificate; re-read when the file changes.
    #[arg(long, env = "CLUSTERIP_TLS_PRIVATE_KEY_FILE")]
    pub tls_private_key_file: PathBuf,

    /// PEM bundle of the CAs that sign the kube-apiserver's client certificate for webhooks
    /// (the one its --admission-control-config-file presents; docs/operations.md). Every
    /// connection to the webhook must present a certificate from one of them, or the TLS
    /// handshake fails and nothing is admitted or reserved. Re-read when the file changes.
    #[arg(long, env = "CLUSTERIP_CLIENT_CA_FILE")]
    pub client_ca_file: PathBuf,

    /// Client certificate names allowed to call the webhook, comma-separated: a certificate
    /// passes when its subject common name or one of its DNS subject alternative names is
    /// in the list. If empty, any client certificate validated by --client-ca-file is
    /// allowed (then use a CA that signs nothing but the apiserver's certificate).
    #[arg(long, value_delimiter = ',')]
    pub allowed_client_names: Vec<String>,

    /// Time a webhook client has for each of: the TLS handshake, a request's headers, a
    /// request's body, and its first request on a new connection; a client slower than
    /// that is disconnected (a body gets HTTP 408). E.g. 10s.
    #[arg(long, default_value = "10s", value_parser = parse_timeout)]
    pub webhook_read_timeout: std::time::Duration,

    /// Webhook connections served at once. At the limit a connection without a request in
    /// flight is closed to make room for a new one (one still in its TLS handshake first,
    /// from the address holding the most); only when every connection has a request in
    /// flight do new ones wait in the kernel's accept queue. The kube-apiserver needs few
    /// (it multiplexes over HTTP/2).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub webhook_max_connections: u32,

    /// TLS handshakes one client address may run at once on the webhook port; its further
    /// connections wait for a turn (in arrival order) and are closed when none came within
    /// --webhook-read-timeout. Bounds the handshake work one client can cause; the
    /// kube-apiserver dials dozens of connections at once in a burst of admissions, which
    /// wait rather than fail.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub webhook_max_unauthenticated_connections_per_source: u32,

    /// The limit that the webhook gives to clients for the maximum number of streams
    /// (concurrent requests) in an HTTP/2 connection; the kube-apiserver opens another
    /// connection beyond it.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u32).range(1..))]
    pub http2_max_streams_per_connection: u32,

    /// Time to delay the termination on SIGTERM. During that time the webhook keeps serving
    /// requests normally, /healthz and /livez return success, but /readyz immediately
    /// returns failure, so the webhook Service's endpoints drop this replica before it stops
    /// accepting connections. E.g. 5s; 0 stops at once.
    #[arg(long, default_value = "5s", value_parser = clusterip_component_base::parse_duration)]
    pub shutdown_delay_duration: std::time::Duration,

    /// After the shutdown delay, how long requests in flight may take to finish (new
    /// connections are refused by then); what is still open afterwards is closed. The
    /// replica then settles its answers (see --in-flight-limit) and returns the address pool
    /// or blocks. E.g. 15s.
    #[arg(long, default_value = "15s", value_parser = clusterip_component_base::parse_duration)]
    pub shutdown_drain_timeout: std::time::Duration,

    /// How long an address the webhook answered may stay unrecorded by the kube-apiserver
    /// before it is released. A create that fails after our answer (validation, another
    /// admission plugin, a quota) frees its address at once, when the apiserver releases its
    /// own record of it; this limit covers what never gets that far (a later mutating
    /// webhook refused the request). Must exceed the apiserver's --request-timeout (60s by
    /// default), e.g. 90s. On SIGTERM, after the drain, the replica waits up to this long
    /// for its own answers to settle (no wait when every one was stored): keep delay + drain
    /// + this inside the pod's terminationGracePeriodSeconds.
    #[arg(long, default_value = "90s", value_parser = parse_timeout)]
    pub in_flight_limit: std::time::Duration,

    /// Address of the plain-HTTP endpoint for /metrics (also /healthz and /readyz, for
    /// people; port 0: as for --webhook-bind-address). Point the kubelet's probes at
    /// --health-probe-bind-address instead.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_bind_address: SocketAddr,

    /// Address of the plain-HTTP endpoint for the kubelet's probes: /healthz, /livez,
    /// /readyz. A listener of its own, so that clients of the metrics port can never crowd
    /// the probes out (port 0: as for --webhook-bind-address).
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub health_probe_bind_address: SocketAddr,

    /// Run the reconcilers only while holding the leader Lease (every replica serves the
    /// webhook either way). Turn off only for a single replica. If the election itself fails
    /// (a bug), the reconcilers are stopped and the process exits with status 1.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,

    /// Namespace of the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    pub leader_elect_namespace: String,

    /// Name of the leader Lease.
    #[arg(long, default_value = "clusterip-controller")]
    pub leader_elect_lease_name: String,

    /// Identity in the Lease (default: POD_NAME, else host name and process id).
    #[arg(long, env = "POD_NAME")]
    pub leader_elect_identity: Option<String>,

    /// How long a replica that does not lead waits, after the last change it saw to the
    /// Lease, before it takes the Lease over (measured on its own clock, never by the
    /// timestamps in the Lease). The longest a crashed leader's reconcilers stay without a
    /// successor. Whole seconds, greater than the renew deadline; e.g. 15s.
    #[arg(long, default_value = "15s", value_parser = clusterip_component_base::parse_duration)]
    pub leader_elect_lease_duration: std::time::Duration,

    /// How long the leader keeps leading when it cannot renew the Lease (apiserver
    /// unreachable, requests hanging): once its last successful renewal is this old, it stops
    /// its reconcilers and becomes a candidate again, before anyone else may take over.
    /// Greater than 1.2 × the retry period, less than the lease duration; e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = clusterip_component_base::parse_duration)]
    pub leader_elect_renew_deadline: std::time::Duration,

    /// How often the leader renews the Lease, and the others look at it (they add up to 20%
    /// jitter), e.g. 2s.
    #[arg(long, default_value = "2s", value_parser = clusterip_component_base::parse_duration)]
    pub leader_elect_retry_period: std::time::Duration,

    /// How often the leader runs the repair pass (also once when it starts leading), e.g.
    /// 3m; 0 turns the repair loop off.
    #[arg(long, default_value = "3m", value_parser = clusterip_component_base::parse_duration)]
    pub repair_interval: std::time::Duration,

    /// (ipaddress backend) An IPAddress of ours whose Service does not exist is released by
    /// the repair pass once older than this.
    #[arg(long, default_value = "60s", value_parser = clusterip_component_base::parse_duration)]
    pub repair_grace_period: std::time::Duration,

    /// How many chunks of the address history are kept in all, over 16 shards (ConfigMaps
    /// `clusterip-address-history-<shard>-<n>` in --leader-elect-namespace, up to 64 KiB
    /// each: who held each address, from when to when, and which decision of ours began or
    /// ended each holding, for `clusterip explain`). The leader records; every replica adds
    /// its own decisions. 0: record none.
    #[arg(long, env = "CLUSTERIP_ADDRESS_HISTORY_CHUNKS", default_value_t = crate::history::DEFAULT_CHUNKS)]
    pub address_history_chunks: usize,
}

fn parse_pool(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= 4096 => Ok(n),
        _ => Err(format!("invalid pool size {s:?}: must be a whole number from 0 to 4096")),
    }
}

fn parse_timeout(s: &str) -> Result<std::time::Duration, String> {
    match clusterip_component_base::parse_duration(s)? {
        d if d.is_zero() => Err(format!("invalid timeout {s:?}: must be longer than 0")),
        d => Ok(d),
    }
}

/// The timing rules that rest on the kube-apiserver's request timeout T: an answered address
/// is kept in flight longer than T (`--in-flight-limit`), and a block holder stops answering
/// more than T before anyone may take its block over (`--address-block-margin`, ipaddress
/// backend). The error names both values.
fn check_request_timeout(args: &ControllerArgs) -> Result<(), String> {
    let t = args.apiserver_request_timeout;
    if args.in_flight_limit <= t {
        return Err(format!(
            "--in-flight-limit {:?} must exceed --apiserver-request-timeout {t:?} (the kube-apiserver's --request-timeout): an address answered by the webhook can stay unrecorded that long, and releasing it sooner could give it to two Services",
            args.in_flight_limit
        ));
    }
    if args.backend.backend == BackendKind::Ipaddress && args.address_block_margin <= t {
        return Err(format!(
            "--address-block-margin {:?} must exceed --apiserver-request-timeout {t:?} (the kube-apiserver's --request-timeout): a block holder stops answering this long before another replica may take the block over, and every answer must be stored (or failed) by then; raise --address-block-margin and --address-block-lease-duration",
            args.address_block_margin
        ));
    }
    Ok(())
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "clusterip".into());
    format!("{host}-{}", std::process::id())
}

pub async fn run(args: ControllerArgs) -> anyhow::Result<i32> {
    let metrics = Arc::new(Metrics::new());
    let client_auth = tls::ClientAuth::new(args.client_ca_file.clone(), args.allowed_client_names.clone()).map_err(anyhow::Error::msg)?;
    let tls = tls::server_config(args.tls_cert_file.clone(), args.tls_private_key_file.clone(), client_auth).map_err(anyhow::Error::msg)?;
    let identity = args.leader_elect_identity.clone().unwrap_or_else(default_identity);
    let election = election_config(&args, &identity)?;
    check_request_timeout(&args).map_err(anyhow::Error::msg)?;

    // What the cluster already records (the kube-apiserver's own allocations included):
    // never handed out; the backend (docs/backends.md) is built beside it.
    let client = kube_client(args.backend.kubeconfig.as_deref()).await?;
    let recorded = watch_records(client.clone()).await?;
    let backend = args.backend.build(Role::Controller(replica_backend(&args, &client, &recorded, &identity))).await?;
    let store = backend.metered(metrics.clone());
    // The address history: the leader records every change; every replica writes its own
    // decisions (the webhook's releases among them).
    let history = (args.address_history_chunks > 0).then(|| crate::history::Notes::new(&identity));
    let history_writer = || crate::history::Writer::new(client.clone(), &args.leader_elect_namespace, args.address_history_chunks);
    let history_loop = history.clone().map(|notes| tokio::spawn(crate::history::write_loop(history_writer(), notes)));
    let admission = Arc::new(Admission::new(store.clone(), Some(recorded.clone())).with_in_flight_limit(args.in_flight_limit).with_metrics(metrics.clone()).with_history(history.clone()));
    let [_follow_records, periodic_sweep] = settle_answers(&admission, &recorded, args.in_flight_limit);
    let answers = admission.clone();

    let listeners = Listeners::bind(&args).await?;
    let ranges: Vec<String> = store.ranges().iter().map(|c| c.to_string()).collect();
    info!(backend = ?backend.kind, ranges = %ranges.join(","), webhook = %listeners.webhook_addr, metrics = %listeners.metrics_addr, health = %listeners.health_addr, "clusterip controller started");

    // Shutdown (SIGTERM): `draining` turns /readyz to 503 at once; `stop` closes the webhook's
    // listener after --shutdown-delay-duration and drains its connections.
    let draining = Arc::new(AtomicBool::new(false));
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let hook = server::Webhook { admission, metrics: metrics.clone(), body_timeout: args.webhook_read_timeout, draining: draining.clone(), nodes: Some(kube::Api::all(client.clone())) };
    let mut web = server::serve_on_own_thread(listeners.webhook, tls, hook, webhook_limits(&args), stop_rx, args.shutdown_drain_timeout).context("starting the webhook thread")?;
    let reconcilers = Reconcilers {
        client: client.clone(),
        store: store.clone(),
        recorded,
        events: ServiceEvents::new(client.clone(), Some(identity.clone())),
        metrics: metrics.clone(),
        identity: identity.clone(),
        repair_target: backend.repair,
        repair_interval: args.repair_interval,
        repair_grace: args.repair_grace_period,
        history_namespace: args.leader_elect_namespace.clone(),
        history: history.clone(),
    };
    let mut signals = Signals::new()?;
    let mut election = match args.leader_elect {
        true => Some(Election::start(&args, election, &metrics).await?),
        false => None,
    };
    let health = super::monitoring::Health::new(store.clone(), metrics.clone(), draining.clone());
    let mon = tokio::spawn(super::monitoring::serve_metrics(listeners.metrics, health.clone()));
    let probes = tokio::spawn(super::monitoring::serve_probes(listeners.probes, health));
    // Until a signal: the reconcilers follow the election; a dead election, webhook or metrics
    // server ends the process (with the reconcilers stopped first).
    let stopping = until_stopped(&mut web, mon, probes, &mut signals);
    let which = match election.as_mut() {
        Some(election) => match election.lead(&reconcilers, &metrics, &identity, stopping).await? {
            Some(which) => which,
            None => return Ok(1),
        },
        None => {
            let _unelected = reconcilers.start();
            stopping.await?
        }
    };
    info!(signal = which, delay = ?args.shutdown_delay_duration, "shutting down: /readyz reports 503; serving on until the delay has passed");
    draining.store(true, Ordering::SeqCst);
    // The reconcilers are stopped (supervise returned): hand the Lease over at once
    // (client-go's ReleaseOnCancel), while the webhook serves on through the delay.
    if let Some(election) = election {
        election.release(args.leader_elect_renew_deadline).await;
    }
    // Keep serving while the webhook Service's endpoints drop this replica (a second signal
    // cuts the wait short).
    tokio::select! {
        _ = tokio::time::sleep(args.shutdown_delay_duration) => {}
        which = signals.next() => info!(signal = which, "signalled again: not waiting for the rest of the shutdown delay"),
    }
    // Stop accepting, let the requests in flight finish (bounded by the drain timeout, which
    // the webhook thread enforces), then hand back what the store holds.
    let _ = stop.send(true);
    let margin = std::time::Duration::from_secs(5);
    match tokio::time::timeout(args.shutdown_drain_timeout + margin, &mut web).await {
        Ok(_) => info!("webhook stopped"),
        Err(_) => tracing::warn!("the webhook thread did not stop within the drain timeout; exiting anyway"),
    }
    // Settle what this replica answered (nothing new is answered now): an answer whose
    // request failed holds its address until we release it, else until the repair pass.
    // Bounded by --in-flight-limit; a second signal cuts it short.
    periodic_sweep.abort();
    let _ = periodic_sweep.await;
    if answers.in_flight() > 0 {
        info!(answers = answers.in_flight(), limit = ?args.in_flight_limit, "settling this replica's answers before exit: each until its Service is stored, its create fails, or it is past the in-flight limit");
        tokio::select! {
            settled = answers.settle_before_exit() => match settled.waiting {
                0 => info!(settled = settled.settled, released = settled.released.len(), "answers settled"),
                left => tracing::warn!(settled = settled.settled, released = settled.released.len(), left, "answers left unsettled at exit: the repair pass releases any whose request failed"),
            },
            which = signals.next() => tracing::warn!(signal = which, left = answers.in_flight(), "signalled again: exiting with answers unsettled (the repair pass releases any whose request failed)"),
        }
    }
    // Write the decisions noted since the last flush (the releases just made among them).
    if let (Some(task), Some(notes)) = (history_loop, &history) {
        task.abort();
        let _ = task.await;
        // Another replica may write the same chunk at once: a write that loses is tried
        // again (the chunk read anew) until the lines are written or the time is up.
        let mut writer = history_writer();
        let last = async {
            while notes.waiting() > 0 {
                if writer.flush(notes).await == 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
            }
        };
        if tokio::time::timeout(HISTORY_LAST_FLUSH, last).await.is_err() {
            tracing::warn!(lines = notes.waiting(), "could not write the last lines of the address history before exit");
        }
    }
    // Hand back what was held ahead of need (the etcd backend's address pool, the address
    // blocks), so it is free at once instead of after its lease and the repair pass.
    if let Err(e) = crate::store::AllocationStore::close(store.as_ref()).await {
        tracing::warn!(error = %e, "could not return the address pool; its lease expires and the repair pass reclaims it");
    }
    info!("stopped");
    Ok(0)
}

/// How long the last write of the address history may take at exit.
const HISTORY_LAST_FLUSH: std::time::Duration = std::time::Duration::from_secs(10);

/// The leader election's settings (checked when the election is on).
fn election_config(args: &ControllerArgs, identity: &str) -> anyhow::Result<ElectionConfig> {
    let election = ElectionConfig {
        namespace: args.leader_elect_namespace.clone(),
        name: args.leader_elect_lease_name.clone(),
        identity: identity.to_string(),
        lease_duration: args.leader_elect_lease_duration,
        renew_deadline: args.leader_elect_renew_deadline,
        retry_period: args.leader_elect_retry_period,
    };
    if args.leader_elect {
        election.validate().map_err(anyhow::Error::msg)?;
    }
    Ok(election)
}

/// The cluster's IPAddress objects, watched; returns once the first list has arrived.
async fn watch_records(client: kube::Client) -> anyhow::Result<ApiserverIps> {
    let (recorded, mut synced, _watch) = ApiserverIps::start(client);
    tokio::time::timeout(std::time::Duration::from_secs(60), synced.wait_for(|s| *s))
        .await
        .context("the IPAddress list did not arrive within 60s: is the kube-apiserver reachable?")?
        .context("IPAddress watch stopped")?;
    Ok(recorded)
}

/// What a replica's backend needs beside `--backend` and its flags.
fn replica_backend<'a>(args: &'a ControllerArgs, client: &'a kube::Client, recorded: &'a ApiserverIps, identity: &'a str) -> ReplicaBackend<'a> {
    ReplicaBackend {
        client,
        recorded,
        identity,
        namespace: &args.leader_elect_namespace,
        etcd_address_pool: args.etcd_address_pool,
        address_block_size: args.address_block_size,
        address_block_lease_duration: args.address_block_lease_duration,
        address_block_margin: args.address_block_margin,
    }
}

/// Settle the webhook's answers: an answered address whose create fails later goes back as
/// the apiserver releases its own record of it; a sweep every quarter of the in-flight
/// limit (1 to 10 s) returns answered addresses the apiserver never recorded after the
/// limit. Every replica settles its own.
fn settle_answers(admission: &Arc<Admission>, recorded: &ApiserverIps, in_flight_limit: std::time::Duration) -> [tokio::task::JoinHandle<()>; 2] {
    let failed_creates = tokio::spawn(admission.clone().follow_records(recorded.changes()));
    let admission = admission.clone();
    let sweep = tokio::spawn(async move {
        let mut every = tokio::time::interval((in_flight_limit / 4).clamp(std::time::Duration::from_secs(1), std::time::Duration::from_secs(10)));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let swept = admission.sweep_in_flight().await;
            if !swept.released.is_empty() {
                info!(released = swept.released.len(), waiting = swept.waiting, "released addresses whose Service was never stored");
            }
        }
    });
    [failed_creates, sweep]
}

/// The controller's three listeners, bound (port 0 picks a free port; the addresses say
/// which).
struct Listeners {
    webhook: TcpListener,
    metrics: TcpListener,
    probes: TcpListener,
    webhook_addr: SocketAddr,
    metrics_addr: SocketAddr,
    health_addr: SocketAddr,
}

impl Listeners {
    async fn bind(args: &ControllerArgs) -> anyhow::Result<Self> {
        let webhook = TcpListener::bind(args.webhook_bind_address)
            .await
            .with_context(|| format!("binding the webhook to {}", args.webhook_bind_address))?;
        let metrics = TcpListener::bind(args.metrics_bind_address)
            .await
            .with_context(|| format!("binding metrics to {}", args.metrics_bind_address))?;
        let probes = TcpListener::bind(args.health_probe_bind_address)
            .await
            .with_context(|| format!("binding the health probes to {}", args.health_probe_bind_address))?;
        Ok(Self {
            webhook_addr: webhook.local_addr().context("the webhook's bound address")?,
            metrics_addr: metrics.local_addr().context("the metrics endpoint's bound address")?,
            health_addr: probes.local_addr().context("the health probes' bound address")?,
            webhook,
            metrics,
            probes,
        })
    }
}

fn webhook_limits(args: &ControllerArgs) -> serve::Limits {
    serve::Limits {
        read_timeout: args.webhook_read_timeout,
        max_connections: args.webhook_max_connections as usize,
        max_unauthenticated_per_source: args.webhook_max_unauthenticated_connections_per_source as usize,
        max_streams: args.http2_max_streams_per_connection,
        ..serve::Limits::default()
    }
}

/// Resolves with the signal that asks the controller to stop, or an error when the
/// webhook, metrics or probe server stops by itself.
async fn until_stopped(
    web: &mut tokio::sync::oneshot::Receiver<String>,
    mut mon: tokio::task::JoinHandle<()>,
    mut probes: tokio::task::JoinHandle<()>,
    signals: &mut Signals,
) -> anyhow::Result<&'static str> {
    tokio::select! {
        r = web => Err(anyhow::anyhow!("webhook server stopped: {}", r.unwrap_or_else(|_| "its thread panicked".into()))),
        r = &mut mon => Err(match r {
            Ok(()) => anyhow::anyhow!("metrics server stopped"),
            Err(e) => anyhow::anyhow!("metrics server stopped: {e}"),
        }),
        r = &mut probes => Err(match r {
            Ok(()) => anyhow::anyhow!("health probe server stopped"),
            Err(e) => anyhow::anyhow!("health probe server stopped: {e}"),
        }),
        which = signals.next() => Ok(which),
    }
}

/// The leader election, running: its task, whether we lead, and how to stop it. It has a
/// client of its own, so its requests never queue behind the watches'.
struct Election {
    task: tokio::task::JoinHandle<()>,
    leading: tokio::sync::watch::Receiver<bool>,
    stop: tokio::sync::watch::Sender<bool>,
    lease_name: String,
}

impl Election {
    async fn start(args: &ControllerArgs, election: ElectionConfig, metrics: &Metrics) -> anyhow::Result<Self> {
        let client = kube_client(args.backend.kubeconfig.as_deref()).await?;
        let lease_name = format!("{}/{}", election.namespace, election.name);
        let (tx, leading) = tokio::sync::watch::channel(false);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let api = kube::Api::namespaced(client, &election.namespace);
        let task = tokio::spawn(leader::run(api, election, tx, stopped));
        metrics.set_leading(&lease_name, false);
        Ok(Self { task, leading, stop, lease_name })
    }

    /// Run the reconcilers exactly while we lead (`supervise.rs`), until `stopping` resolves:
    /// its signal, or None when the election itself failed (the pod is to be restarted).
    async fn lead(
        &mut self,
        reconcilers: &Reconcilers,
        metrics: &Metrics,
        identity: &str,
        stopping: impl std::future::Future<Output = anyhow::Result<&'static str>>,
    ) -> anyhow::Result<Option<&'static str>> {
        let lease_name = self.lease_name.clone();
        let report = |lead: bool| {
            metrics.set_leading(&lease_name, lead);
            if lead {
                info!(lease = %lease_name, identity = %identity, leading = true, "leadership changed: reconcilers started");
            } else {
                info!(lease = %lease_name, identity = %identity, leading = false, "leadership changed: reconcilers stopped");
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let stopping = async move {
            let _ = tx.send(stopping.await);
        };
        match supervise::supervise(&mut self.task, self.leading.clone(), || reconcilers.start(), report, stopping).await {
            Ended::Shutdown => Ok(Some(rx.await.unwrap_or_else(|_| Err(anyhow::anyhow!("shutdown signal lost")))?)),
            Ended::Election(why) => {
                tracing::error!(lease = %self.lease_name, "{why}; the reconcilers are stopped; exiting so that the pod is restarted");
                Ok(None)
            }
        }
    }

    /// Hand the Lease over at once, waiting for the election to stop at most `deadline`.
    async fn release(self, deadline: std::time::Duration) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(deadline, self.task).await.is_err() {
            tracing::warn!(lease = %self.lease_name, "the leader election did not stop within the renew deadline; another replica takes over once the Lease expires");
        }
    }
}

/// SIGTERM and SIGINT (Ctrl-C), as one stream.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
        })
    }

    /// The name of the next signal received.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    fn parse(extra: &[&str]) -> ControllerArgs {
        let mut argv = vec!["clusterip", "controller", "--service-cidr=10.96.0.0/16", "--tls-cert-file=c", "--tls-private-key-file=k", "--client-ca-file=ca"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).expect("flags parse").command {
            Command::Controller(a) => *a,
            other => panic!("not the controller: {other:?}"),
        }
    }

    #[test]
    fn the_defaults_respect_kubernetes_default_request_timeout() {
        assert_eq!(check_request_timeout(&parse(&[])), Ok(()));
        assert_eq!(check_request_timeout(&parse(&["--backend=etcd"])), Ok(()));
    }

    #[test]
    fn a_raised_request_timeout_needs_a_larger_margin_and_in_flight_limit() {
        let e = check_request_timeout(&parse(&["--apiserver-request-timeout=80s"])).expect_err("margin 75s < 80s");
        assert!(e.starts_with("--address-block-margin 75s must exceed --apiserver-request-timeout 80s"), "{e}");
        let e = check_request_timeout(&parse(&["--apiserver-request-timeout=120s", "--address-block-margin=150s", "--address-block-lease-duration=240s"])).expect_err("in-flight 90s < 120s");
        assert!(e.starts_with("--in-flight-limit 90s must exceed --apiserver-request-timeout 120s"), "{e}");
        // The margin is the ipaddress backend's; the etcd backend checks the in-flight limit only.
        assert_eq!(check_request_timeout(&parse(&["--backend=etcd", "--apiserver-request-timeout=80s"])), Ok(()));
        assert_eq!(
            check_request_timeout(&parse(&["--apiserver-request-timeout=120s", "--address-block-margin=150s", "--address-block-lease-duration=240s", "--in-flight-limit=150s"])),
            Ok(())
        );
    }
}
