#![forbid(unsafe_code)]

use clap::Parser;
use clusterip_agent::cli::{run, Args};

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    clusterip_telemetry::init(args.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("clusterip-agent: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "clusterip-agent failed");
            eprintln!("clusterip-agent: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
