//! The `clusterip` command line: one subcommand per job.

mod allocate;
pub mod backend;
mod capacity;
pub mod completion;
mod controller;
mod explain;
mod import;
mod monitoring;
mod reconcilers;
mod repair;
mod whatif;

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

/// clusterip: allocates Service ClusterIPs from service CIDRs, records them durably,
/// answers the admission path and repairs drift.
#[derive(Debug, Parser)]
#[command(name = "clusterip", version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("CLUSTERIP_BUILD_COMMIT"), ")"), about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CLUSTERIP_LOG_FORMAT")]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the facts of a service CIDR: usable size, first and last address, the static
    /// band (reserved for requested addresses) and the dynamic band (handed out first).
    Range(RangeArgs),
    /// Reserve addresses in the allocation records: chosen ones (--count, from the dynamic
    /// band first) or requested ones (--ip). Prints one address per line.
    Allocate(allocate::AllocateArgs),
    /// Release addresses from the allocation records.
    Release(allocate::ReleaseArgs),
    /// Run the controller: the admission webhook that assigns ClusterIPs from our ranges
    /// (mutating) and rejects addresses we cannot honour with HTTP 422 (validating), plus
    /// /metrics, /healthz and /readyz.
    Controller(Box<controller::ControllerArgs>),
    /// Migrate Kubernetes' legacy Service IP bitmap (a RangeAllocation, from a file or an
    /// etcd key such as /registry/ranges/serviceips) into the etcd backend's allocation map.
    /// A union: nothing already recorded is dropped; re-running is harmless.
    ImportRangeallocation(import::ImportArgs),
    /// Compare every Service with the allocation records and the ranges and report drift
    /// (leaks, missing records, duplicates, out-of-range addresses, ...); --fix repairs it.
    /// Exit code: 0 = consistent, 1 = drift found (or left), 2 = error.
    Repair(repair::RepairArgs),
    /// Explain one address: the range and band it falls in, the Services that hold it, its
    /// IPAddress object, the backend's record (etcd map and owner record, or address block),
    /// and whether they all agree. Exit code: 0 = they agree, 1 = they disagree, 2 = error.
    Explain(explain::ExplainArgs),
    /// Capacity per range and band (static, dynamic): used and free addresses, allocations
    /// and releases over the last 1h, 24h and 7d (from the address history), and the days
    /// until each range is full at that pace.
    Capacity(capacity::CapacityArgs),
    /// What a ServiceCIDR change would do, changing nothing: Services a deletion or a shrink
    /// would leave uncovered, a new range's bands and its overlaps with ServiceCIDRs, pod
    /// CIDRs and node addresses. Exit code: 0 = safe, 1 = blocked or unsafe, 2 = error.
    WhatIf(whatif::WhatIfArgs),
    /// Print the CustomResourceDefinitions the project ships (IPAddress and ServiceCIDR in
    /// networking.k8s.io/v1, for clusters older than 1.33 that do not serve them) as YAML.
    Crds,
    /// Print the completion script of a shell (bash, zsh or fish) on stdout.
    ///
    /// `source <(clusterip completion bash)` completes in this shell; the list below says
    /// how to install it for every new shell.
    Completion(completion::CompletionArgs),
}

#[derive(Debug, clap::Args)]
pub struct RangeArgs {
    /// The service CIDR, e.g. 10.96.0.0/12 or fd00:10:96::/112.
    pub cidr: String,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

/// Output format for commands that print a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

/// Run the parsed command line; returns the process exit code.
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Range(args) => range(args),
        Command::Allocate(args) => allocate::allocate(args).await,
        Command::Release(args) => allocate::release(args).await,
        Command::Controller(args) => controller::run(*args).await,
        Command::ImportRangeallocation(args) => import::run(args).await,
        Command::Repair(args) => repair::run(args).await,
        Command::Explain(args) => explain::run(args).await,
        Command::Capacity(args) => capacity::run(args).await,
        Command::WhatIf(args) => whatif::run(args).await,
        Command::Crds => {
            print!("{}", crate::crds::yaml()?);
            Ok(0)
        }
        Command::Completion(args) => completion::run(args),
    }
}

/// `clusterip range CIDR`: the range's facts as text or JSON.
fn range(args: RangeArgs) -> anyhow::Result<i32> {
    let cidr = crate::cidr::ServiceCidr::parse(&args.cidr)?;
    let facts = cidr.facts();
    match args.output {
        OutputFormat::Text => println!("{facts}"),
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&facts)?),
    }
    Ok(0)
}
