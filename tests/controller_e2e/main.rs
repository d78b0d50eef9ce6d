//! The admission webhook in front of the real kube-apiserver: Services created through the
//! API get addresses from our ranges (slices of 198.19.0.0/17 and fd00:10:96::/113, strict
//! subsets of the apiserver's 198.19.0.0/16 and fd00:10:96::/112), and requests we cannot
//! honour are rejected with the error the client sees in Kubernetes' words.
//!
//! Each test runs its own controller process(es) with webhook configurations that select
//! only a namespace of the test's own, so nothing else in the cluster is affected, and with
//! ranges of its own ([`harness::Slice`]): tests run side by side, and two controllers with
//! separate records assigning from one range are two independent allocators, which a real
//! cluster never has.
//!
//! One test binary (one link, one control plane), one module per subject on the shared
//! [`harness`]; a test is named `<subject>::<test>` (`cargo test --test controller_e2e
//! servicecidr::`).

#[path = "../controller_common/mod.rs"]
mod controller_common;
mod harness;

mod admission;
mod blocks;
mod client_auth;
mod concurrent_creates;
mod failed_creates;
mod failover;
mod faults;
mod ha_apiservers;
mod lagging_cache;
mod lifecycle;
mod pool;
mod range_change;
mod reconciler;
mod servicecidr;
