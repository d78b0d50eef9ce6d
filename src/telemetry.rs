//! Logging set-up shared by every binary: the `clusterip-telemetry` crate (`telemetry/`),
//! which the node agent uses too.

pub use clusterip_telemetry::{init, LogFormat};
