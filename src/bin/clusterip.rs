#![forbid(unsafe_code)]

use clap::{CommandFactory, Parser};
use clusterip::cli::{self, Cli};
use clusterip_component_base::{expand_config, ConfigKind};

#[tokio::main]
async fn main() {
    // `clusterip controller --config FILE`: the file's fields become flags first.
    let args = match expand_config(&Cli::command(), Some("controller"), ConfigKind::Controller, std::env::args_os().collect()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let cli = Cli::parse_from(args);
    clusterip::telemetry::init(cli.log_format);
    let code = match cli::run(cli).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            2
        }
    };
    std::process::exit(code);
}
