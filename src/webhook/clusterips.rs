//! Which ClusterIPs a Service needs, decided the way the kube-apiserver decides it (its
//! `initIPFamilyFields` and `allocClusterIPs`), before anything is reserved. Pure.
//!
//! The result is a [`Plan`]: the IP family policy, the families in order, and per family
//! either a requested address (a static allocation) or "choose one" (dynamic).

use std::net::IpAddr;

use k8s_openapi::api::core::v1::ServiceSpec;

use crate::cidr::{self, Family};
use crate::k8s::service;

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

/// A field error, as Kubernetes reports it in a 422 Status (`details.causes`): the field
/// path, the cause reason (`FieldValueInvalid`, `FieldValueNotSupported`, …) and the message
/// in Kubernetes' rendering (`Invalid value: <value>: <detail>`, values as JSON the way
/// v1.37's `field.Error` prints them: `"a"`, `["a","b"]`). The one home of these texts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub reason: &'static str,
    pub message: String,
}

impl FieldError {
    /// `field.Invalid(path, value, detail)`.
    pub fn invalid(field: impl Into<String>, value: &serde_json::Value, detail: impl std::fmt::Display) -> Self {
        Self { field: field.into(), reason: "FieldValueInvalid", message: format!("Invalid value: {}: {detail}", render(value)) }
    }

    /// `field.NotSupported(path, value, supported)`.
    fn not_supported(field: impl Into<String>, value: &str, supported: &[&str]) -> Self {
        let list = supported.iter().map(|s| render(&serde_json::Value::from(*s))).collect::<Vec<_>>().join(", ");
        Self {
            field: field.into(),
            reason: "FieldValueNotSupported",
            message: format!("Unsupported value: {}: supported values: {list}", render(&serde_json::Value::from(value))),
        }
    }

    /// `field.Duplicate(path, value)`.
    fn duplicate(field: impl Into<String>, value: &str) -> Self {
        Self { field: field.into(), reason: "FieldValueDuplicate", message: format!("Duplicate value: {}", render(&serde_json::Value::from(value))) }
    }
}

/// A value as Kubernetes v1.37 prints it in a field error: compact JSON.
fn render(value: &serde_json::Value) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| value.to_string())
}

/// The string slice value of `spec.clusterIPs` in a field error.
pub fn strings_value(items: &[String]) -> serde_json::Value {
    serde_json::Value::from(items.to_vec())
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Why Kubernetes refuses `text` as an IP address (its `IsValidIP`), or None when it is one
/// that we accept too. Kubernetes parses sloppily first (IPv4 octets with leading zeros
/// parse), then refuses leading zeros and IPv4-mapped IPv6 addresses with their own words.
pub fn invalid_ip_reason(text: &str) -> Option<&'static str> {
    const NOT_AN_IP: &str = "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)";
    if cidr::parse_ip(text).is_ok() {
        return None;
    }
    if text.contains(':') {
        return match text.parse::<std::net::Ipv6Addr>() {
            Ok(v6) if v6.to_ipv4_mapped().is_some() => Some("must not be an IPv4-mapped IPv6 address"),
            _ => Some(NOT_AN_IP),
        };
    }
    let octets: Vec<&str> = text.split('.').collect();
    let sloppy = octets.len() == 4
        && octets.iter().all(|o| !o.is_empty() && o.len() <= 3 && o.bytes().all(|b| b.is_ascii_digit()) && o.parse::<u16>().map(|n| n <= 255).unwrap_or(false));
    Some(if sloppy { "must not have leading 0s" } else { NOT_AN_IP })
}

/// Decide what `spec` needs on a cluster whose configured families are `cluster` (in order;
/// the first is the default family). Every problem found is returned, not only the first.
pub fn plan(spec: &ServiceSpec, cluster: &[Family]) -> Result<Decision, Vec<FieldError>> {
    if service::is_external_name(spec) {
        return Ok(Decision::NoAddress);
    }
    // Kubernetes' own validation first (`ValidateServiceClusterIPsRelatedFields`, in its
    // order); its errors end the request before any allocation rule is looked at.
    let mut errs = Vec::new();
    // The apiserver fills clusterIPs from clusterIP before it looks at either.
    let ips = service::cluster_ips(spec);
    let given = spec.cluster_ips.as_deref().unwrap_or_default();
    let single = spec.cluster_ip.as_deref().filter(|s| !s.is_empty());
    match (single, given.first()) {
        (Some(ip), Some(first)) if ip != first => errs.push(FieldError::invalid("spec.clusterIPs", &strings_value(&ips), "first value must match `clusterIP`")),
        (None, Some(_)) => errs.push(FieldError::invalid("spec.clusterIPs", &strings_value(&ips), "must be empty when `clusterIP` is not specified")),
        _ => {}
    }
    let mut families: Vec<Family> = Vec::new();
    let requested_families = spec.ip_families.clone().unwrap_or_default();
    for (i, f) in requested_families.iter().enumerate() {
        match Family::parse(f) {
            None => errs.push(FieldError::not_supported(format!("spec.ipFamilies[{i}]"), f, &Family::ALL.map(|f| f.as_str()))),
            Some(fam) if families.contains(&fam) => errs.push(FieldError::duplicate(format!("spec.ipFamilies[{i}]"), f)),
            Some(fam) => families.push(fam),
        }
    }
    let policy: &'static str = match spec.ip_family_policy.as_deref() {
        None => SINGLE_STACK,
        Some(SINGLE_STACK) => SINGLE_STACK,
        Some(PREFER_DUAL_STACK) => PREFER_DUAL_STACK,
        Some(REQUIRE_DUAL_STACK) => REQUIRE_DUAL_STACK,
        Some(other) => {
            errs.push(FieldError::not_supported("spec.ipFamilyPolicy", other, &[PREFER_DUAL_STACK, REQUIRE_DUAL_STACK, SINGLE_STACK]));
            SINGLE_STACK
        }
    };
    let headless = ips.first().map(String::as_str) == Some(service::HEADLESS);
    let mut bad_ips = false;
    let mut parsed: Vec<IpAddr> = Vec::new();
    for (i, text) in ips.iter().enumerate() {
        if i == 0 && headless {
            if ips.len() > 1 {
                bad_ips = true;
                errs.push(FieldError::invalid("spec.clusterIPs", &strings_value(&ips), "'None' must be the first and only value"));
            }
            continue;
        }
        match invalid_ip_reason(text) {
            Some(reason) => {
                bad_ips = true;
                errs.push(FieldError::invalid(format!("spec.clusterIPs[{i}]"), &serde_json::Value::from(text.as_str()), reason));
            }
            None => parsed.extend(cidr::parse_ip(text).ok()),
        }
    }
    if ips.len() > 2 {
        errs.push(FieldError::invalid("spec.clusterIPs", &strings_value(&ips), "may only hold up to 2 values"));
    }
    if bad_ips || ips.len() > 2 {
        return Err(errs);
    }
    if ips.len() > 1 && !(parsed.len() == 2 && Family::of(parsed[0]) != Family::of(parsed[1])) {
        errs.push(FieldError::invalid("spec.clusterIPs", &strings_value(&ips), "may specify no more than one IP for each IP family"));
    }
    if !headless {
        for (i, (text, ip)) in ips.iter().zip(&parsed).enumerate() {
            match requested_families.get(i).map(String::as_str).and_then(Family::parse) {
                Some(want) if want != Family::of(*ip) => errs.push(FieldError::invalid(
                    format!("spec.clusterIPs[{i}]"),
                    &serde_json::Value::from(text.as_str()),
                    format!("expected an {want} value as indicated by `ipFamilies[{i}]`"),
                )),
                _ => {}
            }
        }
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    if headless {
        return Ok(Decision::NoAddress);
    }

    // Then the allocation rules (the apiserver's `initIPFamilyFields`).
    let policy_value = serde_json::Value::from(policy);
    if policy == SINGLE_STACK {
        if parsed.len() > 1 {
            errs.push(FieldError::invalid("spec.ipFamilyPolicy", &policy_value, "must be 'RequireDualStack' or 'PreferDualStack' when multiple cluster IPs are specified"));
        }
        if families.len() > 1 {
            errs.push(FieldError::invalid("spec.ipFamilyPolicy", &policy_value, "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified"));
        }
    }
    // Families follow the requested addresses where ipFamilies is silent.
    for ip in &parsed {
        if !families.contains(&Family::of(*ip)) {
            families.push(Family::of(*ip));
        }
    }
    if families.is_empty() {
        match cluster.first() {
            Some(&f) => families.push(f),
            None => errs.push(FieldError::invalid("spec.ipFamilies", &serde_json::Value::Array(vec![]), "no service CIDR is configured")),
        }
    }
    for (i, f) in families.iter().enumerate() {
        if !cluster.contains(f) {
            errs.push(FieldError::invalid(format!("spec.ipFamilies[{i}]"), &serde_json::Value::from(f.as_str()), "not configured on this cluster"));
        }
    }
    let dual_cluster = cluster.contains(&Family::IPv4) && cluster.contains(&Family::IPv6);
    if errs.is_empty() && policy == REQUIRE_DUAL_STACK && !dual_cluster {
        errs.push(FieldError::invalid("spec.ipFamilyPolicy", &policy_value, "this cluster is not configured for dual-stack services"));
    }
    if policy != SINGLE_STACK && dual_cluster && families.len() == 1 {
        families.push(families[0].other());
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
    families.iter().map(|f| f.as_str().to_string()).collect()
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
        assert_eq!(errors(&s, &[V4]), vec!["spec.ipFamilyPolicy: Invalid value: \"RequireDualStack\": this cluster is not configured for dual-stack services"]);
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
        assert_eq!(e[0], "spec.clusterIPs[0]: Invalid value: \"010.0.0.1\": must not have leading 0s");
        let mapped = spec(|s| s.cluster_ip = Some("::ffff:10.0.0.1".into()));
        assert_eq!(errors(&mapped, &[V4]), vec!["spec.clusterIPs[0]: Invalid value: \"::ffff:10.0.0.1\": must not be an IPv4-mapped IPv6 address"]);
        let garbage = spec(|s| s.cluster_ip = Some("garbage".into()));
        assert_eq!(errors(&garbage, &[V4]), vec!["spec.clusterIPs[0]: Invalid value: \"garbage\": must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)"]);

        let mismatch = spec(|s| {
            s.cluster_ip = Some("10.0.0.1".into());
            s.cluster_ips = Some(vec!["10.0.0.2".into()]);
        });
        assert_eq!(errors(&mismatch, &[V4]), vec!["spec.clusterIPs: Invalid value: [\"10.0.0.2\"]: first value must match `clusterIP`"]);

        let two_v4 = spec(|s| {
            s.cluster_ip = Some("10.0.0.1".into());
            s.cluster_ips = Some(vec!["10.0.0.1".into(), "10.0.0.2".into()]);
            s.ip_family_policy = Some(PREFER_DUAL_STACK.into());
        });
        assert!(errors(&two_v4, &[V4, V6]).contains(&"spec.clusterIPs: Invalid value: [\"10.0.0.1\",\"10.0.0.2\"]: may specify no more than one IP for each IP family".to_string()));

        let single_two = spec(|s| {
            s.cluster_ip = Some("10.0.0.1".into());
            s.cluster_ips = Some(vec!["10.0.0.1".into(), "fd00::1".into()]);
        });
        assert_eq!(
            errors(&single_two, &[V4, V6]),
            vec!["spec.ipFamilyPolicy: Invalid value: \"SingleStack\": must be 'RequireDualStack' or 'PreferDualStack' when multiple cluster IPs are specified"]
        );

        let wrong_family = spec(|s| {
            s.cluster_ip = Some("10.0.0.1".into());
            s.ip_families = Some(vec!["IPv6".into()]);
        });
        assert_eq!(errors(&wrong_family, &[V4, V6]), vec!["spec.clusterIPs[0]: Invalid value: \"10.0.0.1\": expected an IPv6 value as indicated by `ipFamilies[0]`"]);

        let unconfigured = spec(|s| s.ip_families = Some(vec!["IPv6".into()]));
        assert_eq!(errors(&unconfigured, &[V4]), vec!["spec.ipFamilies[0]: Invalid value: \"IPv6\": not configured on this cluster"]);

        let bogus = spec(|s| s.ip_families = Some(vec!["IPv5".into()]));
        assert_eq!(errors(&bogus, &[V4]), vec!["spec.ipFamilies[0]: Unsupported value: \"IPv5\": supported values: \"IPv4\", \"IPv6\""]);
    }
}
