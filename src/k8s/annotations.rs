//! Our annotations on objects we do not own.
//!
//! (The address-block Leases' annotations, `clusterip.allocator/range`,
//! `clusterip.allocator/addresses` and `clusterip.allocator/wanted-by`, are written and read
//! by `store/ipaddress/blocks/` on the Leases it owns.)

use kube::api::ObjectMeta;

/// Annotation that earlier versions put on every Service they assigned addresses to. It is
/// user-settable, so admission never reads it; the repair pass still reads it on old
/// Services for one narrow case (see docs/repair.md).
pub const RESERVED: &str = "clusterip.allocator/reserved";

/// The addresses an object's [`RESERVED`] annotation names, as written: a comma-separated
/// list, blanks dropped.
pub fn reserved(meta: &ObjectMeta) -> Vec<String> {
    let Some(value) = meta.annotations.as_ref().and_then(|a| a.get(RESERVED)) else { return Vec::new() };
    reserved_in(value).map(str::to_string).collect()
}

/// The addresses a [`RESERVED`] annotation's value names.
pub fn reserved_in(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(annotations: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta { annotations: Some(annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()), ..Default::default() }
    }

    #[test]
    fn the_reserved_annotation_is_a_list_of_addresses() {
        assert_eq!(reserved(&meta(&[(RESERVED, "198.19.0.7")])), ["198.19.0.7"]);
        assert_eq!(reserved(&meta(&[(RESERVED, " 198.19.0.7, fd00::7 ,,")])), ["198.19.0.7", "fd00::7"]);
        assert!(reserved(&meta(&[("other", "198.19.0.7")])).is_empty());
        assert!(reserved(&ObjectMeta::default()).is_empty());
    }
}
