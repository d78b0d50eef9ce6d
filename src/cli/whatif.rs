//! `clusterip what-if`: what a ServiceCIDR change would do, changing nothing (see
//! [`crate::whatif`]).

use std::path::PathBuf;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::api::{Api, ListParams};

use super::repair::{EXIT_CONSISTENT, EXIT_DRIFT};
use super::OutputFormat;
use crate::cidr::ServiceCidr;
use crate::whatif::{Change, NodeView};

#[derive(Debug, clap::Args)]
#[command(after_long_help = "Reads the cluster's ServiceCIDRs, Services and Nodes; changes nothing.\n\n\
Exit codes: 0 = safe (every Service address stays covered, no overlap with a pod CIDR or a \
node address), 1 = blocked or unsafe, 2 = error.\n\n\
Examples:\n  clusterip what-if delete-cidr extra\n  clusterip what-if add-cidr 10.100.0.0/16\n  \
clusterip what-if shrink kubernetes 10.96.0.0/13 -o json")]
pub struct WhatIfArgs {
    #[command(subcommand)]
    pub change: WhatIfChange,

    /// kubeconfig (default: KUBECONFIG, then in-cluster).
    #[arg(long, env = "KUBECONFIG", global = true)]
    pub kubeconfig: Option<PathBuf>,

    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Text, global = true)]
    pub output: OutputFormat,
}

#[derive(Debug, clap::Subcommand)]
pub enum WhatIfChange {
    /// Delete the ServiceCIDR NAME: the Services that would be left in no ServiceCIDR (and
    /// keep the deletion waiting).
    DeleteCidr {
        /// The ServiceCIDR's name.
        name: String,
    },
    /// Create a ServiceCIDR with CIDR: its band split and size, the Service addresses it
    /// covers, its overlaps with other ServiceCIDRs (allowed) and with pod CIDRs and node
    /// addresses (unsafe).
    AddCidr {
        /// The range, e.g. 10.100.0.0/16.
        cidr: String,
    },
    /// Narrow the ServiceCIDR NAME to CIDR (inside its range of that family): the Services
    /// left outside.
    Shrink {
        /// The ServiceCIDR's name.
        name: String,
        /// The narrower range.
        cidr: String,
    },
}

pub async fn run(args: WhatIfArgs) -> anyhow::Result<i32> {
    let change = match &args.change {
        WhatIfChange::DeleteCidr { name } => Change::Delete { name: name.clone() },
        WhatIfChange::AddCidr { cidr } => Change::Add { cidr: ServiceCidr::parse(cidr)? },
        WhatIfChange::Shrink { name, cidr } => Change::Shrink { name: name.clone(), cidr: ServiceCidr::parse(cidr)? },
    };
    let client = super::backend::kube_client(args.kubeconfig.as_deref()).await?;
    let servicecidrs: crate::whatif::ServiceCidrs = Api::<ServiceCIDR>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing ServiceCIDRs")?
        .items
        .iter()
        .map(|o| (o.metadata.name.clone().unwrap_or_default(), crate::k8s::servicecidr::ranges(o)))
        .collect();
    let services = crate::repair::list_services(&client, &|_, _| {}).await?;
    let nodes: Vec<NodeView> = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing Nodes")?
        .items
        .into_iter()
        .map(NodeView::of)
        .collect();
    let found = crate::whatif::judge(&change, &servicecidrs, &services, &nodes).map_err(anyhow::Error::msg)?;
    match args.output {
        OutputFormat::Text => println!("{found}"),
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&found)?),
    }
    Ok(if found.safe { EXIT_CONSISTENT } else { EXIT_DRIFT })
}
