//! clusterip: the Service virtual-IP subsystem of a Kubernetes control plane.
//!
//! Modules are named for what they are in Kubernetes:
//! - [`cidr`]: a service CIDR as an ordered set of usable addresses, with the static band.
//! - [`alloc`]: the allocation map (pure, no I/O): static and dynamic allocation, release.
//! - [`cli`]: the `clusterip` command line.
//! - [`clock`]: the injected clock of the Lease protocols (leader election, address blocks).
//! - [`k8s`]: our readings of Services, IPAddresses, ServiceCIDRs and our annotations, and
//!   the IPAddress objects we write.
//! - [`repair`]: the consistency pass between Services, allocation records and ranges.
//! - [`serve`]: HTTP serving with limits on what one client may hold (webhook, metrics).
//! - [`telemetry`]: logging set-up shared by every binary.
#![forbid(unsafe_code)]

pub mod alloc;
pub mod capacity;
pub mod cidr;
pub mod cli;
pub mod clock;
pub mod controller;
pub mod crds;
/// The fuzz harnesses (feature `fuzzing`: tests/fuzz and tests/fuzz_corpora.rs).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod history;
pub mod k8s;
pub mod metrics;
pub mod repair;
/// HTTP serving with limits on what one client may hold (the `clusterip-serve` crate, shared
/// with the node agent).
pub use clusterip_serve as serve;
pub mod store;
pub mod sync;
pub mod telemetry;
pub mod webhook;
pub mod whatif;
