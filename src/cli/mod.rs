//! The `clusterip` command line: one subcommand per job.

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

/// clusterip: allocates Service ClusterIPs from service CIDRs, records them durably,
/// answers the admission path and repairs drift.
#[derive(Debug, Parser)]
#[command(name = "clusterip", version, about, long_about = None, propagate_version = true)]
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
        Command::Range(args) => {
            let _ = args;
            anyhow::bail!("not yet built")
        }
    }
}
