//! Control loops of `clusterip controller`, run by the elected leader only:
//! - [`services`]: keeps the allocation records and the Services consistent (release on
//!   delete, record an address a Service holds that the records lack), with Events in
//!   Kubernetes' reasons;
//! - [`servicecidrs`]: the ServiceCIDR finalizer and Ready condition;
//! - [`leader`]: a coordination.k8s.io Lease so one replica writes while every replica
//!   serves the webhook;
//! - [`supervise`]: runs the loops above exactly while the election says we lead, and stops
//!   them when it does not (or when the election task is gone).

pub mod events;
pub mod leader;
pub mod servicecidrs;
pub mod services;
pub mod supervise;
