//! Which ClusterIPs a Service needs, decided the way the kube-apiserver decides it (its
//! `initIPFamilyFields` and `allocClusterIPs`), before anything is reserved. Pure.
//!
//! The result is a [`Plan`]: the IP family policy, the families in order, and per family
//! either a requested address (a static allocation) or "choose one" (dynamic).

use std::net::IpAddr;

use k8s_openapi::api::core::v1::ServiceSpec;

use crate::cidr::{self, Family};

pub const SINGLE_STACK: &str = "SingleStack";
pub const PREFER_DUAL_STACK: &str = "PreferDualStack";
pub const REQUIRE_DUAL_STACK: &str = "RequireDualStack";

/// One address to reserve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// The user asked for this address.
    Static(IpAddr),
    /// Choose one of this family.
    Dynamic(Family),
}

/// What a Service needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub policy: &'static str,
    pub families: Vec<Family>,
    pub wants: Vec<Want>,
}

/// The decision for a Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No address: ExternalName, or headless (`clusterIP: None`).
    NoAddress,
    Allocate(Plan),
}

/// A field error, as Kubernetes reports it in a 422 Status (`details.causes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

fn family_name(f: Family) -> &'static str {
    match f {
        Family::IPv4 => "IPv4",
        Family::IPv6 => "IPv6",
    }
}

fn parse_family(s: &str) -> Option<Family> {
    match s {
        "IPv4" => Some(Family::IPv4),
        "IPv6" => Some(Family::IPv6),
        _ => None,
    }
}

/// Decide what `spec` needs on a cluster whose configured families are `cluster` (in order;
/// the first is the default family). Every problem found is returned, not only the first.
pub fn plan(spec: &ServiceSpec, cluster: &[Family]) -> Result<Decision, Vec<FieldError>> {
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok(Decision::NoAddress);
    }
    let mut errs = Vec::new();
    let mut ips: Vec<String> = spec.cluster_ips.clone().unwrap_or_default();
    let single = spec.cluster_ip.clone().filter(|s| !s.is_empty());
    match (&single, ips.first()) {
        (Some(ip), None) => ips = vec![ip.clone()],
        (Some(ip), Some(first)) if ip != first => errs.push(FieldError::new("spec.clusterIPs", "first value must match `clusterIP`")),
        (None, Some(_)) => errs.push(FieldError::new("spec.clusterIPs", "must be empty when `clusterIP` is not specified")),
        _ => {}
    }
    if ips.first().map(String::as_str) == Some("None") {
        if ips.len() > 1 {
            errs.push(FieldError::new("spec.clusterIPs", "'None' must be the first and only value"));
            return Err(errs);
        }
        return if errs.is_empty() { Ok(Decision::NoAddress) } else { Err(errs) };
    }
    if ips.len() > 2 {
        errs.push(FieldError::new("spec.clusterIPs", "may only hold up to 2 values"));
    }
    let mut parsed: Vec<IpAddr> = Vec::new();
    for (i, text) in ips.iter().enumerate() {
        match cidr::parse_ip(text) {
            Ok(ip) => parsed.push(ip),
            Err(e) => errs.push(FieldError::new(format!("spec.clusterIPs[{i}]"), format!("Invalid value: {text:?}: {e}"))),
        }
    }
    if parsed.len() == 2 && Family::of(parsed[0]) == Family::of(parsed[1]) {
        errs.push(FieldError::new("spec.clusterIPs[1]", "may specify no more than one IP for each IP family"));
    }

    let mut families: Vec<Family> = Vec::new();
    for (i, f) in spec.ip_families.clone().unwrap_or_default().iter().enumerate() {
        match parse_family(f) {
            None => errs.push(FieldError::new(format!("spec.ipFamilies[{i}]"), format!("Unsupported value: {f:?}: supported values: \"IPv4\", \"IPv6\""))),
            Some(fam) if families.contains(&fam) => errs.push(FieldError::new(format!("spec.ipFamilies[{i}]"), format!("Duplicate value: {f:?}"))),
            Some(fam) => families.push(fam),
        }
    }
    if families.len() > 2 {
        errs.push(FieldError::new("spec.ipFamilies", "may only hold up to 2 values"));
    }
    let policy: &'static str = match spec.ip_family_policy.as_deref() {
        None => SINGLE_STACK,
        Some(SINGLE_STACK) => SINGLE_STACK,
        Some(PREFER_DUAL_STACK) => PREFER_DUAL_STACK,
        Some(REQUIRE_DUAL_STACK) => REQUIRE_DUAL_STACK,
        Some(other) => {
            errs.push(FieldError::new(
                "spec.ipFamilyPolicy",
                format!("Unsupported value: {other:?}: supported values: \"PreferDualStack\", \"RequireDualStack\", \"SingleStack\""),
            ));
            SINGLE_STACK
        }
    };
    if policy == SINGLE_STACK {
        if parsed.len() > 1 {
            errs.push(FieldError::new("spec.ipFamilyPolicy", "must be 'RequireDualStack' or 'PreferDualStack' when multiple cluster IPs are specified"));
        }
        if families.len() > 1 {
            errs.push(FieldError::new("spec.ipFamilyPolicy", "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified"));
        }
    }
    let dual_cluster = cluster.contains(&Family::IPv4) && cluster.contains(&Family::IPv6);
    if policy == REQUIRE_DUAL_STACK && !dual_cluster {
        errs.push(FieldError::new("spec.ipFamilyPolicy", "this cluster is not configured for dual-stack services"));
    }
    // Families follow the requested addresses where ipFamilies is silent.
    for (i, ip) in parsed.iter().enumerate() {
        let fam = Family::of(*ip);
        match families.get(i) {
            Some(&want) if want != fam => errs.push(FieldError::new(
                format!("spec.clusterIPs[{i}]"),
                format!("expected an {} value as indicated by `ipFamilies[{i}]`", family_name(want)),
            )),
            Some(_) => {}
            None if !families.contains(&fam) => families.push(fam),
            None => {}
        }
    }
    if families.is_empty() {
        match cluster.first() {
            Some(&f) => families.push(f),
            None => errs.push(FieldError::new("spec.ipFamilies", "no service CIDR is configured")),
        }
    }
    for (i, f) in families.iter().enumerate() {
        if !cluster.contains(f) {
            errs.push(FieldError::new(format!("spec.ipFamilies[{i}]"), format!("{}: not configured on this cluster", family_name(*f))));
        }
    }
    if policy != SINGLE_STACK && dual_cluster && families.len() == 1 {
        let other = if families[0] == Family::IPv4 { Family::IPv6 } else { Family::IPv4 };
        families.push(other);
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    let wants = families
        .iter()
        .enumerate()
        .map(|(i, f)| parsed.get(i).map(|ip| Want::Static(*ip)).unwrap_or(Want::Dynamic(*f)))
        .collect();
    Ok(Decision::Allocate(Plan { policy, families, wants }))
}

/// The `ipFamilies` strings of a plan.
pub fn family_names(families: &[Family]) -> Vec<String> {
    families.iter().map(|f| family_name(*f).to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4: Family = Family::IPv4;
    const V6: Family = Family::IPv6;

    fn spec(f: impl FnOnce(&mut ServiceSpec)) -> ServiceSpec {
        let mut s = ServiceSpec::default();
        f(&mut s);
        s
    }

    fn ok(s: &ServiceSpec, cluster: &[Family]) -> Plan {
        match plan(s, cluster) {
            Ok(Decision::Allocate(p)) => p,
            other => panic!("expected a plan, got {other:?}"),
        }
    }

    fn errors(s: &ServiceSpec, cluster: &[Family]) -> Vec<String> {
        plan(s, cluster).expect_err("expected errors").iter().map(|e| e.to_string()).collect()
    }

    #[test]
    fn externalname_and_headless_get_nothing() {
        assert_eq!(plan(&spec(|s| s.type_ = Some("ExternalName".into())), &[V4]), Ok(Decision::NoAddress));
        assert_eq!(plan(&spec(|s| s.cluster_ip = Some("None".into())), &[V4, V6]), Ok(Decision::NoAddress));
        let both = spec(|s| {
            s.cluster_ip = Some("None".into());
            s.cluster_ips = Some(vec!["None".into()]);
        });
        assert_eq!(plan(&both, &[V4]), Ok(Decision::NoAddress));
    }

    #[test]
    fn default_is_single_stack_in_the_first_family() {
        let p = ok(&ServiceSpec::default(), &[V6, V4]);
        assert_eq!(p, Plan { policy: SINGLE_STACK, families: vec![V6], wants: vec![Want::Dynamic(V6)] });
    }

    #[test]
    fn prefer_dual_stack_adds_the_other_family_only_on_a_dual_stack_cluster() {
        let s = spec(|s| s.ip_family_policy = Some(PREFER_DUAL_STACK.into()));
        assert_eq!(ok(&s, &[V4, V6]).wants, vec![Want::Dynamic(V4), Want::Dynamic(V6)]);
        assert_eq!(ok(&s, &[V4]).wants, vec![Want::Dynamic(V4)]);
    }

    #[test]
    fn require_dual_stack_on_single_stack_is_rejected() {
        let s = spec(|s| s.ip_family_policy = Some(REQUIRE_DUAL_STACK.into()));
        assert_eq!(errors(&s, &[V4]), vec!["spec.ipFamilyPolicy: this cluster is not configured for dual-stack services"]);
    }

    #[test]
    fn requested_addresses_are_static_and_set_the_families() {
        let s = spec(|s| {
            s.cluster_ip = Some("fd00::10".into());
            s.cluster_ips = Some(vec!["fd00::10".into(), "10.0.0.10".into()]);
            s.ip_family_policy = Some(REQUIRE_DUAL_STACK.into());
        });
        let p = ok(&s, &[V4, V6]);
        assert_eq!(p.families, vec![V6, V4]);
        assert_eq!(p.wants, vec![Want::Static("fd00::10".parse().unwrap()), Want::Static("10.0.0.10".parse().unwrap())]);
    }

    #[test]
    fn one_requested_address_plus_a_dynamic_second_family() {
        let s = spec(|s| {
            s.cluster_ip = Some("10.0.0.10".into());
            s.ip_family_policy = Some(PREFER_DUAL_STACK.into());
        });
        assert_eq!(ok(&s, &[V4, V6]).wants, vec![Want::Static("10.0.0.10".parse().unwrap()), Want::Dynamic(V6)]);
    }

    #[test]
    fn malformed_and_inconsistent_requests_name_the_field() {
        let bad = spec(|s| s.cluster_ip = Some("010.0.0.1".into()));
        let e = errors(&bad, &[V4]);
        assert_eq!(e.len(), 1);
        assert!(e[0].starts_with("spec.clusterIPs[0]: Invalid value: \"010.0.0.1\""), "{e:?}");

        let mismatch = spec(|s| {
            s.cluster_ip = Some("10.0.0.1".into());
            s.cluster_ips = Some(vec!["10.0.0.2".into()]);
        });
        assert_eq!(errors(&mismatch, &[V4]), vec!["spec.clusterIPs: first value must match `clusterIP`"]);

        let two_v4 = spec(|s| {
            s.cluster_ip = Some("10.0.0.1".into());
            s.cluster_ips = Some(vec!["10.0.0.1".into(), "10.0.0.2".into()]);
            s.ip_family_policy = Some(PREFER_DUAL_STACK.into());
        });
        assert!(errors(&two_v4, &[V4, V6]).contains(&"spec.clusterIPs[1]: may specify no more than one IP for each IP family".to_string()));

        let single_two = spec(|s| {
            s.cluster_ip = Some("10.0.0.1".into());
            s.cluster_ips = Some(vec!["10.0.0.1".into(), "fd00::1".into()]);
        });
        assert_eq!(
            errors(&single_two, &[V4, V6]),
            vec!["spec.ipFamilyPolicy: must be 'RequireDualStack' or 'PreferDualStack' when multiple cluster IPs are specified"]
        );

        let wrong_family = spec(|s| {
            s.cluster_ip = Some("10.0.0.1".into());
            s.ip_families = Some(vec!["IPv6".into()]);
        });
        assert_eq!(errors(&wrong_family, &[V4, V6]), vec!["spec.clusterIPs[0]: expected an IPv6 value as indicated by `ipFamilies[0]`"]);

        let unconfigured = spec(|s| s.ip_families = Some(vec!["IPv6".into()]));
        assert_eq!(errors(&unconfigured, &[V4]), vec!["spec.ipFamilies[0]: IPv6: not configured on this cluster"]);

        let bogus = spec(|s| s.ip_families = Some(vec!["IPv5".into()]));
        assert!(errors(&bogus, &[V4])[0].starts_with("spec.ipFamilies[0]: Unsupported value: \"IPv5\""));
    }
}
