//! `networking.k8s.io/v1` IPAddress objects: the one builder of the objects we write, and
//! the readings of a name, the labels and the parentRef.
//!
//! An IPAddress is named by the canonical text of its address, carries a parentRef to the
//! owning object and the labels `ipaddress.kubernetes.io/ip-family` and
//! `ipaddress.kubernetes.io/managed-by`.

use std::net::IpAddr;

use k8s_openapi::api::networking::v1::{IPAddress, IPAddressSpec, ParentReference};
use kube::api::ObjectMeta;

use crate::cidr::{self, Family};

/// Label naming the address family of an IPAddress.
pub const LABEL_IP_FAMILY: &str = "ipaddress.kubernetes.io/ip-family";
/// Label naming the controller that manages an IPAddress.
pub const LABEL_MANAGED_BY: &str = "ipaddress.kubernetes.io/managed-by";
/// The kube-apiserver's value of the managed-by label.
pub const KUBE_APISERVER_MANAGER: &str = "ipallocator.k8s.io";

/// The IPAddress object for `ip`, owned by `parent`, managed by `manager`.
pub fn build(ip: IpAddr, parent: ParentReference, manager: &str) -> IPAddress {
    IPAddress {
        metadata: ObjectMeta {
            name: Some(ip.to_string()),
            labels: Some([(LABEL_IP_FAMILY.to_string(), Family::of(ip).as_str().to_string()), (LABEL_MANAGED_BY.to_string(), manager.to_string())].into()),
            ..Default::default()
        },
        spec: IPAddressSpec { parent_ref: parent },
    }
}

/// The address an IPAddress name records (parsed strictly), if it is one.
pub fn address(name: &str) -> Option<IpAddr> {
    cidr::parse_ip(name).ok()
}

/// The address an IPAddress name records when the name is its canonical text (the only
/// name the kube-apiserver's allocator and ours ever write).
pub fn canonical_address(name: &str) -> Option<IpAddr> {
    address(name).filter(|ip| ip.to_string() == name)
}

/// The value of a label of an IPAddress.
pub fn label<'a>(obj: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    obj.labels.as_ref()?.get(key).map(String::as_str)
}

/// Whether `manager` manages the object (its managed-by label).
pub fn managed_by(obj: &IPAddress, manager: &str) -> bool {
    label(&obj.metadata, LABEL_MANAGED_BY) == Some(manager)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipaddress_is_named_by_its_address_and_labelled_with_family_and_manager() {
        let parent = ParentReference { group: None, resource: "services".into(), namespace: Some("default".into()), name: "web".into() };
        let obj = build("fd00:10:96::5".parse().expect("ip"), parent.clone(), "clusterip.allocator");
        assert_eq!(obj.metadata.name.as_deref(), Some("fd00:10:96::5"));
        assert_eq!(label(&obj.metadata, LABEL_IP_FAMILY), Some("IPv6"));
        assert!(managed_by(&obj, "clusterip.allocator") && !managed_by(&obj, KUBE_APISERVER_MANAGER));
        assert_eq!(obj.spec.parent_ref, parent);
        assert_eq!(canonical_address("fd00:10:96::5"), Some("fd00:10:96::5".parse().expect("ip")));
    }

    #[test]
    fn names_that_record_no_address() {
        assert_eq!(address("fd00:10:96:0::5"), Some("fd00:10:96::5".parse().expect("ip")));
        assert_eq!(canonical_address("fd00:10:96:0::5"), None);
        assert_eq!(address("010.0.0.1"), None);
        assert_eq!(address("not-an-ip"), None);
    }
}
