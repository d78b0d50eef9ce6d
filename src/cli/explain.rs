//! `clusterip explain IP`: who holds an address and whether every record agrees (see
//! [`crate::repair::explain`]).

use anyhow::Context as _;

use super::backend::BackendArgs;
use super::repair::{EXIT_CONSISTENT, EXIT_DRIFT};
use super::OutputFormat;

#[derive(Debug, clap::Args)]
#[command(after_long_help = "Reads, never changes. The verdict applies the repair pass's rules to this one \
address: \"the records agree\", or each disagreement with what `clusterip repair --fix` does about it.\n\n\
Exit codes: 0 = the records agree (held, or free), 1 = they disagree, 2 = error.\n\n\
Examples:\n  clusterip explain 10.96.0.10 --backend ipaddress --service-cidr 10.96.0.0/12\n  \
clusterip explain 10.96.0.10 --backend etcd --etcd-endpoints https://etcd:2379 --service-cidr 10.96.0.0/12 -o json")]
pub struct ExplainArgs {
    /// The address, e.g. 10.96.0.10 or fd00:10:96::a.
    pub ip: String,

    #[command(flatten)]
    pub backend: BackendArgs,

    /// Namespace of the controller (its --leader-elect-namespace): where its address block
    /// Leases (ipaddress backend) and the address history are kept.
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    pub namespace: String,

    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

pub async fn run(args: ExplainArgs) -> anyhow::Result<i32> {
    let ip = crate::cidr::parse_ip(&args.ip).with_context(|| format!("{:?} is not an IP address", args.ip))?;
    let client = super::backend::kube_client(args.backend.kubeconfig.as_deref()).await?;
    let target = args.backend.repair_target().await?;
    let found = crate::repair::explain::explain(&client, &target, ip, Some(&args.namespace)).await.with_context(|| format!("explaining {ip}"))?;
    match args.output {
        OutputFormat::Text => println!("{found}"),
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&found)?),
    }
    Ok(if found.agree { EXIT_CONSISTENT } else { EXIT_DRIFT })
}
