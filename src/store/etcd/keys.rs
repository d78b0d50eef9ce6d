//! The etcd keys of one range and what their values mean: the allocation map at the range
//! key, owner keys, and (read through [`super::pool`]) pool keys and claims.

use std::net::IpAddr;


use crate::cidr::ServiceCidr;
use crate::store::ParentRef;

/// The key a range is stored under.
pub fn range_key(prefix: &str, cidr: &ServiceCidr) -> String {
    format!("{}/{}", prefix.trim_end_matches('/'), cidr)
}

/// `<range key>/owner/` — the prefix of the owner keys of one range's addresses.
pub fn owner_prefix(range_key: &str) -> String {
    format!("{range_key}/owner/")
}

/// The owner key of an address.
pub fn owner_key(range_key: &str, ip: IpAddr) -> String {
    format!("{}{ip}", owner_prefix(range_key))
}

/// An owner key's value.
pub(super) fn encode_owner(owner: &ParentRef) -> Vec<u8> {
    serde_json::to_vec(owner).unwrap_or_default()
}

/// The resource of the owner an unreadable owner key stands for.
pub const UNREADABLE_OWNER: &str = "unreadable-owner-record";

/// An owner key's value read back. An unreadable value still marks the address as owned
/// (by an owner that cannot be named), so no unowned release takes it: it fails closed.
pub(super) fn decode_owner(value: &[u8]) -> ParentRef {
    parse_owner(value).unwrap_or_else(|_| ParentRef {
        group: String::new(),
        resource: UNREADABLE_OWNER.into(),
        namespace: None,
        name: String::from_utf8_lossy(value).chars().take(64).collect(),
    })
}

/// An owner key's value, strictly: a parentRef naming a resource and an object.
pub(super) fn parse_owner(value: &[u8]) -> Result<ParentRef, String> {
    let p: ParentRef = serde_json::from_slice(value).map_err(|e| format!("not a parentRef: {e}"))?;
    if p.resource.is_empty() || p.name.is_empty() {
        return Err("a parentRef without a resource or a name".into());
    }
    Ok(p)
}

/// Why an allocation map may not be used, for the errors callers get.
pub(super) const MAP_CONSEQUENCE: &str = "no address of this range is allocated or released until the map is rebuilt: `clusterip repair --rebuild`";
pub(super) const OWNER_CONSEQUENCE: &str = "the address stays allocated; only an operator releases it (docs/operations.md, \"Corrupt records\")";

/// The owner keys among `kvs` (read under `prefix`, the range's owner prefix).
pub(super) fn owners_in<'a>(prefix: &'a str, kvs: &'a [etcd_client::KeyValue]) -> impl Iterator<Item = (IpAddr, ParentRef)> + 'a {
    kvs.iter().filter_map(move |kv| {
        let ip = kv.key_str().ok()?.strip_prefix(prefix).and_then(|t| crate::cidr::parse_ip(t).ok())?;
        Some((ip, decode_owner(kv.value())))
    })
}

/// What a key under a range's prefix is.
pub(super) enum Under<'a> {
    Map,
    /// A pool key, by its name below `<range key>/pool/` (`<member>/<chunk>`, or `<member>`).
    Pool(&'a str),
    Claim(IpAddr),
    Owner(IpAddr),
    Other,
}

pub(super) fn classify<'a>(range_key: &str, key: &'a str) -> Under<'a> {
    if key == range_key {
        return Under::Map;
    }
    let Some(rest) = key.strip_prefix(range_key).and_then(|r| r.strip_prefix('/')) else { return Under::Other };
    if let Some(member) = rest.strip_prefix("pool/") {
        return Under::Pool(member);
    }
    if let Some(Ok(ip)) = rest.strip_prefix("owner/").map(crate::cidr::parse_ip) {
        return Under::Owner(ip);
    }
    match rest.strip_prefix("claim/").map(crate::cidr::parse_ip) {
        Some(Ok(ip)) => Under::Claim(ip),
        _ => Under::Other,
    }
}

