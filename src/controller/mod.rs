//! Control loops of `clusterip controller`, run by the elected leader only:
//! - [`services`]: keeps the allocation records and the Services consistent (release on
//!   delete, record an address a Service holds that the records lack), with Events in
//!   Kubernetes' reasons;
//! - [`servicecidrs`]: the ServiceCIDR finalizer and Ready condition;
//! - [`leader`]: a coordination.k8s.io Lease so one replica writes while every replica
//!   serves the webhook.

pub mod events;
pub mod leader;
pub mod servicecidrs;
pub mod services;
