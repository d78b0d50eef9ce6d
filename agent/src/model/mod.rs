//! The pure model: Services and EndpointSlices turned into what one node must program.
//!
//! Nothing here does I/O. [`service`] reads a core/v1 Service into its ports,
//! [`endpointslice`] reads a discovery.k8s.io/v1 EndpointSlice, [`topology`] picks the
//! endpoints a node uses for a Service port (kube-proxy's `CategorizeEndpoints`), and
//! [`state`] keeps the current objects and says which Services changed since the last sync.

#![forbid(unsafe_code)]

pub mod endpointslice;
pub mod service;
pub mod state;
pub mod topology;

use std::fmt;
use std::net::IpAddr;

/// The namespace and name of an object.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamespacedName {
    pub namespace: String,
    pub name: String,
}

impl NamespacedName {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self { namespace: namespace.into(), name: name.into() }
    }
}

impl fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// L4 protocol of a Service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Parse the Kubernetes spelling ("TCP", "UDP", "SCTP"); a missing protocol is TCP.
    pub fn from_k8s(s: Option<&str>) -> Option<Self> {
        match s.unwrap_or("TCP") {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// The nft / iptables keyword.
    pub fn keyword(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.keyword())
    }
}

/// IP family of an address, a table, an EndpointSlice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub fn of(ip: &IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];
}

/// Identifies one port of one Service: kube-proxy's `ServicePortName`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub service: NamespacedName,
    /// `spec.ports[].name`; empty for a single unnamed port.
    pub port_name: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.service, self.port_name, self.protocol)
    }
}

/// An endpoint of a Service port as read from an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    /// `conditions.ready`, a missing value counts as true.
    pub ready: bool,
    /// `conditions.serving`, a missing value counts as true.
    pub serving: bool,
    /// `conditions.terminating`, a missing value counts as false.
    pub terminating: bool,
    /// `nodeName == this node`.
    pub is_local: bool,
    pub zone: Option<String>,
    /// `hints.forZones[].name`; None when the endpoint carries no zone hints.
    pub zone_hints: Option<Vec<String>>,
    /// `hints.forNodes[].name`; None when the endpoint carries no node hints.
    pub node_hints: Option<Vec<String>>,
}

impl Endpoint {
    /// A ready, local-less endpoint, for tests and benchmarks.
    pub fn ready(ip: IpAddr, port: u16) -> Self {
        Endpoint {
            ip,
            port,
            ready: true,
            serving: true,
            terminating: false,
            is_local: false,
            zone: None,
            zone_hints: None,
            node_hints: None,
        }
    }
}
