//! The IPAddress backend (`--backend ipaddress`): Service addresses recorded as
//! `networking.k8s.io/v1` IPAddress objects, named by the address — the record the
//! kube-apiserver (≥ 1.33) itself keeps of every Service address, so creating the object
//! named by an address is the cluster-wide lock.
//!
//! Two stores, each run in one place, over one view of the cluster's records:
//! - [`apiserver_ips::ApiserverIps`]: the addresses the cluster records as IPAddress objects
//!   (the kube-apiserver's own included), a watch-fed view. Every component that hands out
//!   addresses reads it: the controller's store, admission, the Service reconciler.
//! - [`blocks::BlockStore`]: **the controller's** store (`clusterip controller`). The
//!   webhook answers Service addresses from memory, inside address blocks the replica holds
//!   exclusively through Leases; it writes no IPAddress object (the kube-apiserver records
//!   the Service's addresses when it stores the Service). Ranges: `--service-cidr` and,
//!   with `--use-servicecidrs`, the cluster's ServiceCIDR objects, followed while it runs
//!   ([`blocks::BlockStore::follow_servicecidrs`]).
//! - [`objects::IpAddressStore`]: **the one-shot commands'** store (`clusterip allocate`,
//!   `release`; the store the conformance tests run): every allocation creates its
//!   IPAddress object (the create is the lock), for any parent. Ranges: `--service-cidr`
//!   and, with `--use-servicecidrs`, the cluster's ServiceCIDR objects.
//!
//! Which one a command opens is decided in one place, `cli::backend::BackendArgs::build`;
//! the repair pass reads the IPAddress objects themselves (`repair::Target::IpAddress`).

pub mod apiserver_ips;
pub mod blocks;
pub mod objects;

pub use objects::{IpAddressConfig, IpAddressStore, DEFAULT_MANAGER};
