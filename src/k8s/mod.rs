//! Our readings of Kubernetes objects, and the objects we write: one home per reading, so
//! that the webhook, the reconcilers, the backends and the repair pass read a Service's
//! addresses, an IPAddress's name and labels, a ServiceCIDR's ranges and our annotations
//! the same way (as linkerd2 keeps its shared readings of API objects in `k8s/api`).
//!
//! Pure: Kubernetes' types and range math in, values out; nothing of stores, admission or
//! controllers (they use this, never the reverse).

pub mod annotations;
pub mod ipaddress;
pub mod lease;
pub mod service;
pub mod servicecidr;
