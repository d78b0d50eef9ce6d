//! The admission path for Services: decide which ClusterIPs a Service needs
//! ([`clusterips`]), reserve and patch them in or reject the request ([`admission`]), over
//! HTTPS with a certificate that follows its files ([`tls`], [`server`]); and the overlap
//! check of ServiceCIDRs ([`servicecidr`]).

pub mod admission;
pub mod clusterips;
pub mod server;
pub mod servicecidr;
pub mod tls;
