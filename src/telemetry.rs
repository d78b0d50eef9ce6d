//! Logging set-up shared by every binary: `clusterip-component-base`'s `logs`
//! (`component-base/`), which the node agent uses too.

pub use clusterip_component_base::logs::{init, LogFormat};
