//! Command line and process wiring.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use clusterip_component_base::logs::LogFormat;
use ipnet::IpNet;

use crate::healthz::ProxyHealth;
use crate::http::{self, Response};
use crate::iptables::IptablesProxier;
use crate::metrics::{CodeLabel, Dataplane, Metrics, RestClientMetrics};
use crate::model::service::{ServiceLimits, DEFAULT_MAX_SERVICE_ADDRESSES};
use crate::model::state::{NodeInfo, ProxyState};
use crate::netns::Executor;
use crate::nftables::render::RenderOptions;
use crate::nftables::{NftablesProxier, DEFAULT_MAX_OPS};
use crate::proxier::Proxier;
use crate::sync::{self, Shared, SyncConfig};
use crate::watch;

/// Dataplane to program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// `ip clusterip` / `ip6 clusterip` nftables tables (default).
    Nftables,
    /// kube-proxy's iptables layout (KUBE-SERVICES, KUBE-SVC-*, KUBE-SEP-*, KUBE-NODEPORTS), IPv4 and IPv6.
    Iptables,
}

/// clusterip-agent: the node agent that programs Service VIPs into the kernel from
/// Services and EndpointSlices, like kube-proxy (nftables by default, iptables with
/// --mode iptables).
#[derive(Debug, Parser)]
#[command(name = "clusterip-agent", version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("CLUSTERIP_BUILD_COMMIT"), ")"), about, long_about = None)]
pub struct Args {
    /// A configuration file whose fields are these flags, in camelCase (`--min-sync-period` →
    /// `minSyncPeriod`; a repeatable flag takes a list, a switch true or false), under
    /// `apiVersion: clusterip.allocator/v1alpha1` and `kind: AgentConfiguration` (as
    /// kube-proxy's --config reads a KubeProxyConfiguration). A flag given here overrides
    /// its field; a field overrides an environment variable. Every field is checked at
    /// start, and each bad one named (docs/agent.md, "Configuration file").
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,

    /// Log format on stderr: text (human-readable lines) or json (one JSON object per line),
    /// as the controller's --log-format. RUST_LOG sets the level (default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "CLUSTERIP_LOG_FORMAT")]
    pub log_format: LogFormat,

    /// Kubeconfig to reach the API server. Without it: in-cluster config, then $KUBECONFIG / ~/.kube/config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,

    /// This node's name: endpoints with this nodeName are local (Local traffic policies), and
    /// the Node object of this name gives the zone (topology hints) and healthz eligibility.
    /// Defaults to the hostname.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,

    /// Dataplane: nftables (default) or iptables.
    #[arg(long, value_enum, default_value = "nftables")]
    pub mode: Mode,

    /// Minimum time between the end of one sync and the start of the next: changes arriving
    /// meanwhile are coalesced into one sync (e.g. 1s, 200ms).
    #[arg(long, default_value = "1s", value_parser = clusterip_component_base::parse_duration)]
    pub min_sync_period: Duration,

    /// Full resync period: everything is re-rendered and diffed against the in-memory mirror
    /// (see --verify-period for comparing with the kernel). Failed syncs are retried with
    /// backoff up to this period. healthz reports unhealthy when a change waits longer than
    /// twice this period.
    #[arg(long, default_value = "30s", value_parser = clusterip_component_base::parse_duration)]
    pub sync_period: Duration,

    /// Address for /healthz (node eligible and rules up to date) and /livez (rules up to
    /// date). Empty disables it.
    #[arg(long, default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,

    /// Address for /metrics (Prometheus text format). Empty disables it.
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: String,

    /// Remove every table, chain and rule the agent creates (both modes, both families), then exit.
    #[arg(long)]
    pub cleanup: bool,

    /// Program the rules in this network namespace (a name under /run/netns or a path such as
    /// /proc/<pid>/ns/net) instead of the agent's own. The agent itself stays where it is, so
    /// it can still reach the API server; only nft / iptables-restore / conntrack run inside.
    #[arg(long)]
    pub netns: Option<String>,

    /// Handle only Services labelled service.kubernetes.io/service-proxy-name=<this>.
    /// Without it, only Services without that label (kube-proxy's rule).
    #[arg(long)]
    pub service_proxy_name: Option<String>,

    /// Masquerade all traffic sent to ClusterIPs.
    #[arg(long)]
    pub masquerade_all: bool,

    /// Pod CIDRs (comma separated): traffic to a ClusterIP from outside them is masqueraded.
    #[arg(long, value_delimiter = ',')]
    pub cluster_cidr: Vec<IpNet>,

    /// Bound on the operations (chains, rules, map elements) of one nftables transaction; a
    /// larger sync (a cold start with many Services) is split at Service boundaries.
    #[arg(long, default_value_t = DEFAULT_MAX_OPS)]
    pub max_ops_per_transaction: usize,

    /// How often a full resync also lists the kernel tables and compares them with what was
    /// programmed, to repair rules changed behind the agent's back (0 disables). Listing costs
    /// seconds at 10k Services, hence its own period.
    #[arg(long, default_value = "5m", value_parser = clusterip_component_base::parse_duration)]
    pub verify_period: Duration,

    /// Kill a dataplane tool (nft, iptables-restore, iptables-save) still running after this
    /// long; the sync that needed it fails and is retried with backoff.
    #[arg(long, default_value = "2m", value_parser = clusterip_component_base::parse_duration)]
    pub tool_timeout: Duration,

    /// At most this many VIP:port pairs per Service: ports × (ClusterIPs + externalIPs +
    /// load-balancer IPs). A Service over it is programmed with its ClusterIPs only (and not
    /// at all if those alone are over it), with a warning and the
    /// services_over_address_limit gauge. 0: no limit.
    #[arg(long, default_value_t = DEFAULT_MAX_SERVICE_ADDRESSES)]
    pub max_service_addresses: usize,

    /// Only externalIPs inside these CIDRs (comma separated) are programmed; others are
    /// ignored, with a warning and the external_ips_ignored gauge. Empty: any address.
    #[arg(long, value_delimiter = ',')]
    pub external_ip_cidrs: Vec<IpNet>,
}

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Exec(#[from] crate::netns::ExecError),
    #[error(transparent)]
    Dataplane(#[from] crate::proxier::DataplaneError),
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig { path: String, message: String },
    #[error("kube client: {0}")]
    Kube(#[from] kube::Error),
    #[error("kube config: {0}")]
    InferConfig(#[from] kube::config::InferConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: std::io::Error },
    #[error("no --node-name and no hostname: {0}")]
    NodeName(String),
    #[error("cannot start the sync thread: {0}")]
    Thread(std::io::Error),
}

fn hostname() -> Result<String, AgentError> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .map_err(|e| AgentError::NodeName(e.to_string()))
}

/// The kube client, its requests recorded in `rest_client` (client-go's metrics).
async fn kube_client(args: &Args, rest_client: &RestClientMetrics) -> Result<kube::Client, AgentError> {
    let config = match &args.kubeconfig {
        Some(p) => {
            let err = |message: String| AgentError::Kubeconfig { path: p.display().to_string(), message };
            let kc = kube::config::Kubeconfig::read_from(p).map_err(|e| err(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.map_err(|e| err(e.to_string()))?
        }
        None => kube::Config::infer().await?,
    };
    let host = config.cluster_url.authority().map(|a| a.to_string()).unwrap_or_default();
    Ok(kube::client::ClientBuilder::try_from(config)?.with_layer(&rest_client.layer(host)).build())
}

/// Build the dataplane for `args`.
pub fn proxier(args: &Args, exec: Executor) -> Box<dyn Proxier> {
    match args.mode {
        Mode::Nftables => {
            let opts = RenderOptions { masquerade_all: args.masquerade_all, cluster_cidrs: args.cluster_cidr.clone() };
            Box::new(NftablesProxier::new(exec, opts, args.max_ops_per_transaction))
        }
        Mode::Iptables => Box::new(IptablesProxier::new(exec, args.masquerade_all, args.cluster_cidr.clone())),
    }
}

/// `--cleanup`: remove what both modes create.
pub fn cleanup(exec: &Executor) -> Result<(), AgentError> {
    NftablesProxier::new(exec.clone(), RenderOptions::default(), DEFAULT_MAX_OPS).cleanup()?;
    IptablesProxier::new(exec.clone(), false, vec![]).cleanup()?;
    Ok(())
}

/// Run the agent until SIGINT/SIGTERM.
pub async fn run(args: Args) -> Result<(), AgentError> {
    let exec = match &args.netns {
        Some(ns) => Executor::in_netns(ns)?,
        None => Executor::host(),
    }
    .with_timeout(args.tool_timeout);
    if args.cleanup {
        cleanup(&exec)?;
        tracing::info!("cleanup done");
        return Ok(());
    }
    let node_name = match &args.node_name {
        Some(n) => n.clone(),
        None => hostname()?,
    };
    let metrics = Metrics::for_dataplane(match args.mode {
        Mode::Nftables => Dataplane::Nftables,
        Mode::Iptables => Dataplane::Iptables,
    });
    let client = kube_client(&args, &metrics.rest_client).await?;
    let limits = ServiceLimits { max_addresses: args.max_service_addresses, external_ip_cidrs: args.external_ip_cidrs.clone() };
    let state = ProxyState::new(NodeInfo { name: node_name.clone(), zone: None }, args.service_proxy_name.clone()).with_limits(limits);
    let health = ProxyHealth::new(args.sync_period * 2);
    let shared = Shared::new(state, health, metrics);

    if !args.healthz_bind_address.is_empty() {
        let s = shared.clone();
        let handler: http::Handler = Arc::new(move |path| match path {
            "/healthz" | "/livez" => {
                let a = s.health.answer(path == "/healthz");
                let (ours, kube_proxy) = if path == "/healthz" {
                    (&s.metrics.healthz, &s.metrics.kube_proxy.healthz)
                } else {
                    (&s.metrics.livez, &s.metrics.kube_proxy.livez)
                };
                let code = CodeLabel { code: a.code.to_string() };
                ours.get_or_create(&code).inc();
                kube_proxy.get_or_create(&code).inc();
                Response::new(a.code, "application/json", a.body)
            }
            _ => Response::new(404, "text/plain", "not found\n"),
        });
        let addr = http::serve("healthz", &args.healthz_bind_address, handler)
            .await
            .map_err(|source| AgentError::Listen { addr: args.healthz_bind_address.clone(), source })?;
        tracing::info!(%addr, "healthz listening");
    }
    if !args.metrics_bind_address.is_empty() {
        let s = shared.clone();
        let handler: http::Handler = Arc::new(move |path| match path {
            "/metrics" => Response::new(200, "application/openmetrics-text; version=1.0.0; charset=utf-8", s.metrics.encode()),
            _ => Response::new(404, "text/plain", "not found\n"),
        });
        let addr = http::serve("metrics", &args.metrics_bind_address, handler)
            .await
            .map_err(|source| AgentError::Listen { addr: args.metrics_bind_address.clone(), source })?;
        tracing::info!(%addr, "metrics listening");
    }

    tokio::spawn(watch::services(client.clone(), shared.clone(), args.service_proxy_name.clone()));
    tokio::spawn(watch::endpoint_slices(client.clone(), shared.clone()));
    let events_client = client.clone();
    tokio::spawn(watch::node(client, shared.clone(), node_name.clone()));

    let cfg = SyncConfig {
        min_sync_period: args.min_sync_period,
        sync_period: args.sync_period,
        verify_period: (!args.verify_period.is_zero()).then_some(args.verify_period),
    };
    let dataplane = proxier(&args, exec.clone());
    tracing::info!(node = %node_name, mode = dataplane.mode(), netns = ?args.netns, "clusterip-agent starting");
    let health_servers = crate::service_health::ServiceHealthServers::new(exec.netns_file(), tokio::runtime::Handle::current(), shared.health.clone())
        .with_events(events_client, &node_name);
    let s = shared.clone();
    let loop_thread = std::thread::Builder::new()
        .name("sync".into())
        .spawn(move || sync::run(s, dataplane, exec, cfg, Some(health_servers)))
        .map_err(AgentError::Thread)?;

    wait_for_signal().await;
    tracing::info!("shutting down (rules are left in place; use --cleanup to remove them)");
    shared.shutdown();
    let _ = tokio::task::spawn_blocking(move || loop_thread.join()).await;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_format_takes_the_controllers_values() {
        let parse = |a: &[&str]| Args::try_parse_from([&["clusterip-agent"], a].concat());
        assert_eq!(parse(&[]).expect("defaults").log_format, LogFormat::Text);
        assert_eq!(parse(&["--log-format", "json"]).expect("json").log_format, LogFormat::Json);
        assert_eq!(parse(&["--log-format=text"]).expect("text").log_format, LogFormat::Text);
        assert!(parse(&["--log-format", "logfmt"]).is_err(), "an unknown format is refused");
        assert_eq!(parse(&[]).expect("defaults").metrics_bind_address, "127.0.0.1:10249", "kube-proxy's default");
    }
}
