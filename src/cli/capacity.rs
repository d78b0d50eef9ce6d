//! `clusterip capacity`: used and free addresses per range and band, the recent
//! allocation and release rates, and when each range runs full (see [`crate::capacity`]).

use super::backend::{BackendArgs, Role};
use super::OutputFormat;

#[derive(Debug, clap::Args)]
#[command(after_long_help = "Reads, never changes. Used and free come from the backend's records; the rates \
and the forecast from the address history the leading controller keeps in its namespace \
(--namespace): allocations and releases over the last 1h, 24h and 7d, as far as the history \
reaches, and the days until full at the net pace of the longest window it covers.\n\n\
Example:\n  clusterip capacity --backend ipaddress --service-cidr 10.96.0.0/12 --namespace clusterip-system")]
pub struct CapacityArgs {
    #[command(flatten)]
    pub backend: BackendArgs,

    /// Namespace of the controller (its --leader-elect-namespace), where the address history
    /// is kept.
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    pub namespace: String,

    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

pub async fn run(args: CapacityArgs) -> anyhow::Result<i32> {
    let client = super::backend::kube_client(args.backend.kubeconfig.as_deref()).await?;
    let store = args.backend.build(Role::Command { etcd_address_pool: 0 }).await?.store;
    let allocated = store.allocated().await?;
    let log = match crate::history::read(&client, &args.namespace).await {
        Ok(log) => log,
        Err(kube::Error::Api(s)) if s.code == 403 || s.code == 404 => Vec::new(),
        Err(e) => return Err(anyhow::Error::new(e).context("reading the address history")),
    };
    let report = crate::capacity::report(&store.ranges(), &allocated, &log, k8s_openapi::jiff::Timestamp::now().as_second());
    let _ = store.close().await;
    match args.output {
        OutputFormat::Text => println!("{report}"),
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
    }
    Ok(0)
}
