//! Logging set-up shared by the `clusterip` binaries and `clusterip-agent`: text for people,
//! JSON for collectors. Both take it as `--log-format text|json` (env `CLUSTERIP_LOG_FORMAT`).



use tracing_subscriber::{fmt, EnvFilter};

/// Output format of the logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Install the global tracing subscriber. `RUST_LOG` overrides the default level (`info`).
/// Logs go to stderr so that command output on stdout stays machine-readable.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second init (tests) is harmless: try_init reports it and we ignore that.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
