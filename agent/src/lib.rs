//! clusterip-agent: the node agent that turns Services and EndpointSlices into kernel
//! forwarding rules (nftables by default, iptables with `--mode iptables`), like kube-proxy.
//!
//! Data flows one way: API objects ([`watch`]) → the pure [`model`] → a dataplane
//! ([`nftables`], [`iptables`]) driven by the [`sync`] loop, with [`conntrack`] cleanup,
//! [`healthz`] and [`metrics`] beside it.

pub mod cli;
pub mod conntrack;
/// The fuzz harnesses (feature `fuzzing`: tests/fuzz and tests/fuzz_corpora.rs).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod healthz;
pub mod http;
pub mod iptables;
pub mod locks;
pub mod metrics;
pub mod model;
mod netlink;
pub mod netns;
pub mod nftables;
pub mod proxier;
pub mod service_health;
pub mod sync;
pub mod watch;
