#![forbid(unsafe_code)]

use clap::{CommandFactory, Parser};
use clusterip_agent::cli::{run, Args};
use clusterip_component_base::{expand_config, ConfigKind};

fn main() -> std::process::ExitCode {
    // `--config FILE`: the file's fields become flags first.
    let argv = match expand_config(&Args::command(), None, ConfigKind::Agent, std::env::args_os().collect()) {
        Ok(argv) => argv,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let args = Args::parse_from(argv);
    clusterip_component_base::logs::init(args.log_format);
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
