//! What both clusterip binaries (`clusterip`, `clusterip-agent`) share, as Kubernetes'
//! `component-base` does for its components:
//! - [`duration`]: one duration syntax for every flag of both binaries — Kubernetes' (Go's
//!   `time.ParseDuration`: `1m30s`, `500ms`, `1.5h`), plus a bare number as seconds;
//! - [`config`]: a versioned configuration file (`--config`, like kube-proxy's
//!   KubeProxyConfiguration) whose fields are the flags, with flags on the command line
//!   overriding it and every invalid field named at start;
//! - [`logs`]: `--log-format text|json` and the tracing subscriber;
//! - [`metrics`]: the `process_*` metrics and `<component>_build_info`;
//! - [`memory`]: handing memory freed by a burst of work back to the operating system.

// One function needs unsafe code (memory::release_freed, a libc call); nothing else may.
#![deny(unsafe_code)]

pub mod config;
pub mod duration;
pub mod logs;
pub mod memory;
pub mod metrics;

pub use config::{expand_config, ConfigKind};
pub use duration::parse_duration;
