#![forbid(unsafe_code)]

use clap::Parser;
use clusterip::cli::{self, Cli};

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
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
