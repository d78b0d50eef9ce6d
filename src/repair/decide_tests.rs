use super::*;

fn ranges() -> Vec<ServiceCidr> {
    vec![ServiceCidr::parse("10.0.0.0/24").unwrap(), ServiceCidr::parse("fd00::/112").unwrap()]
}

fn svc(ns: &str, name: &str, created: i64, ips: &[&str]) -> ServiceView {
    ServiceView {
        namespace: ns.into(),
        name: name.into(),
        uid: Some(format!("uid-{name}")),
        created: Some(created),
        cluster_ips: ips.iter().map(|s| s.to_string()).collect(),
        reserved: None,
    }
}

fn map(ips: &[&str]) -> Records {
    Records::Map(ips.iter().map(|s| s.parse().unwrap()).collect())
}

fn etcd() -> Config {
    Config { ranges: ranges(), cluster_ranges: None, mode: Mode::Etcd, grace: DEFAULT_GRACE, release_leaks_now: false }
}

fn ipaddr() -> Config {
    Config { ranges: ranges(), cluster_ranges: None, mode: Mode::IpAddress { manager: "clusterip.allocator".into() }, grace: DEFAULT_GRACE, release_leaks_now: false }
}

fn record(name: &str, manager: &str, parent: Option<ParentRef>, age_secs: u64) -> RecordView {
    let family = if name.contains(':') { Family::IPv6 } else { Family::IPv4 };
    RecordView {
        name: name.into(),
        uid: Some(format!("uid-{name}")),
        resource_version: Some("1".into()),
        managed_by: Some(manager.into()),
        family_label: Some(family.as_str().into()),
        parent,
        age: Some(Duration::from_secs(age_secs)),
    }
}

fn only(report: &Report) -> &Finding {
    assert_eq!(report.findings.len(), 1, "expected one finding, got {:#?}", report.findings);
    &report.findings[0]
}

#[test]
fn consistent_is_empty() {
    let services = [svc("a", "web", 1, &["10.0.0.5", "fd00::5"]), svc("a", "headless", 2, &[])];
    let r = decide(&etcd(), &services, &map(&["10.0.0.5", "fd00::5"]), &mut LeakCounts::default());
    assert!(r.findings.is_empty(), "{:#?}", r.findings);
    assert_eq!((r.services, r.records), (2, 2));
}

#[test]
fn leak_released_on_third_consecutive_pass_only() {
    let mut counts = LeakCounts::default();
    let records = map(&["10.0.0.9"]);
    for pass in 1..=2 {
        let r = decide(&etcd(), &[], &records, &mut counts);
        let f = only(&r);
        assert_eq!(f.kind, Kind::Leak);
        assert_eq!(f.action, Action::ReleaseLater { seen: pass, of: 3 }, "pass {pass}");
    }
    let r = decide(&etcd(), &[], &records, &mut counts);
    assert_eq!(only(&r).action, Action::Release);
}

#[test]
fn leak_count_restarts_when_a_pass_sees_an_owner() {
    let mut counts = LeakCounts::default();
    let records = map(&["10.0.0.9"]);
    decide(&etcd(), &[], &records, &mut counts);
    decide(&etcd(), &[], &records, &mut counts);
    // A Service shows up holding it: not a leak, and the count is forgotten.
    let r = decide(&etcd(), &[svc("a", "late", 1, &["10.0.0.9"])], &records, &mut counts);
    assert!(r.findings.is_empty());
    assert!(counts.is_empty());
    let r = decide(&etcd(), &[], &records, &mut counts);
    assert_eq!(only(&r).action, Action::ReleaseLater { seen: 1, of: 3 });
}

#[test]
fn release_leaks_now_skips_the_count() {
    let cfg = Config { release_leaks_now: true, ..etcd() };
    let r = decide(&cfg, &[], &map(&["10.0.0.9"]), &mut LeakCounts::default());
    assert_eq!(only(&r).action, Action::Release);
}

#[test]
fn missing_map_record_is_recreated_with_kubernetes_event() {
    let r = decide(&etcd(), &[svc("a", "web", 1, &["10.0.0.7"])], &map(&[]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, &f.action), (Kind::MissingRecord, &Action::Create));
    let ev = f.event.as_ref().unwrap();
    assert_eq!(ev.reason, "ClusterIPNotAllocated");
    assert_eq!(ev.note, "Cluster IP [IPv4]:10.0.0.7 is not allocated; repairing");
}

#[test]
fn duplicate_is_an_event_on_the_younger_service_only() {
    let services = [svc("b", "young", 20, &["10.0.0.7"]), svc("a", "old", 10, &["10.0.0.7"])];
    let r = decide(&etcd(), &services, &map(&["10.0.0.7"]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, &f.action), (Kind::Duplicate, &Action::Event));
    let ev = f.event.as_ref().unwrap();
    assert_eq!(ev.target, EventTarget::Service { namespace: "b".into(), name: "young".into(), uid: Some("uid-young".into()) });
    assert_eq!(ev.reason, "ClusterIPAlreadyAllocated");
    assert_eq!(ev.note, "Cluster IP [IPv4]:10.0.0.7 was assigned to multiple services; please recreate service");
    assert!(!f.action.changes_records());
}

#[test]
fn out_of_range_only_for_addresses_we_assigned() {
    // 10.0.1.5 is outside our ranges: another allocator's, unless our webhook assigned it.
    let mut foreign = svc("a", "theirs", 1, &["10.0.1.5"]);
    let r = decide(&etcd(), std::slice::from_ref(&foreign), &map(&[]), &mut LeakCounts::default());
    assert!(r.findings.is_empty());
    assert_eq!(r.foreign, 1);
    foreign.reserved = Some("10.0.1.5".into());
    let r = decide(&etcd(), &[foreign.clone()], &map(&[]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, &f.action), (Kind::OutOfRange, &Action::Event));
    let ev = f.event.as_ref().unwrap();
    assert_eq!(ev.reason, "ClusterIPOutOfRange");
    assert_eq!(ev.note, "Cluster IP [IPv4]:10.0.1.5 is not within the service CIDR 10.0.0.0/24; please recreate service");
    // The IPAddress repair's wording.
    let r = decide(&ipaddr(), &[foreign], &Records::Objects(vec![]), &mut LeakCounts::default());
    assert_eq!(only(&r).event.as_ref().unwrap().note, "Cluster IP [IPv4]: 10.0.1.5 is not within any configured Service CIDR; please recreate service");
}

#[test]
fn out_of_range_against_the_clusters_own_ranges() {
    // Our 10.0.0.0/24 inside the cluster's 10.0.0.0/16: 10.0.1.5 is the apiserver's; 10.1.0.5
    // is in no range at all.
    let cfg = Config { cluster_ranges: Some(vec![ServiceCidr::parse("10.0.0.0/16").unwrap()]), ..etcd() };
    let services = [svc("a", "theirs", 1, &["10.0.1.5"]), svc("a", "nowhere", 1, &["10.1.0.5"])];
    let r = decide(&cfg, &services, &map(&[]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, f.owner.as_str()), (Kind::OutOfRange, "a/nowhere"));
    assert_eq!(r.foreign, 1);
    // The family is known from the cluster's ranges even when none of ours has it.
    let cfg = Config {
        ranges: vec![ServiceCidr::parse("10.0.0.0/24").unwrap()],
        cluster_ranges: Some(vec![ServiceCidr::parse("10.0.0.0/16").unwrap(), ServiceCidr::parse("fd00::/112").unwrap()]),
        ..etcd()
    };
    let r = decide(&cfg, &[svc("a", "v6", 1, &["fd00::5", "fd01::5"])], &map(&[]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, f.address.as_str()), (Kind::OutOfRange, "fd01::5"));
    assert_eq!(f.event.as_ref().unwrap().note, "Cluster IP [IPv6]: fd01::5 is not within any configured Service CIDR; please recreate service");
}

#[test]
fn network_and_broadcast_are_out_of_range() {
    let mut s = svc("a", "edge", 1, &["10.0.0.0", "10.0.0.255"]);
    s.reserved = Some(s.cluster_ips.join(",").into());
    let r = decide(&etcd(), &[s], &map(&[]), &mut LeakCounts::default());
    assert_eq!(r.count(Kind::OutOfRange), 2);
}

#[test]
fn family_not_configured() {
    let cfg = Config { ranges: vec![ServiceCidr::parse("10.0.0.0/24").unwrap()], ..etcd() };
    let mut s = svc("a", "v6", 1, &["fd00::5"]);
    s.reserved = Some("fd00::5".into());
    let r = decide(&cfg, &[s], &map(&[]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!(f.kind, Kind::FamilyNotConfigured);
    let ev = f.event.as_ref().unwrap();
    assert_eq!(ev.reason, "ClusterIPNotValid");
    assert_eq!(ev.note, "Cluster IP fd00::5(IPv6) is of ip family that is no longer configured on cluster; please recreate service");
}

#[test]
fn malformed_service_address() {
    let r = decide(&etcd(), &[svc("a", "bad", 1, &["10.0.0.1x"])], &map(&[]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, &f.action), (Kind::Malformed, &Action::Event));
    assert_eq!(f.event.as_ref().unwrap().note, "Cluster IP 10.0.0.1x is not a valid IP; please recreate Service");
}

#[test]
fn ipaddress_missing_record_is_created() {
    let r = decide(&ipaddr(), &[svc("a", "web", 1, &["fd00::7"])], &Records::Objects(vec![]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, &f.action), (Kind::MissingRecord, &Action::Create));
    assert_eq!(f.service, Some(("a".into(), "web".into())));
    assert_eq!(f.event.as_ref().unwrap().note, "Cluster IP [IPv6]: fd00::7 is not allocated; repairing");
}

#[test]
fn ipaddress_leak_waits_for_the_grace_period() {
    let parent = Some(ParentRef::service("a", "gone"));
    let young = Records::Objects(vec![record("10.0.0.9", "clusterip.allocator", parent.clone(), 10)]);
    let r = decide(&ipaddr(), &[], &young, &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!(f.kind, Kind::Leak);
    assert_eq!(f.action, Action::ReleaseAfterGrace { age: Some(Duration::from_secs(10)), grace: DEFAULT_GRACE });
    assert!(f.event.is_none());
    let old = Records::Objects(vec![record("10.0.0.9", "clusterip.allocator", parent.clone(), 70)]);
    let r = decide(&ipaddr(), &[], &old, &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!(f.action, Action::Release);
    let ev = f.event.as_ref().unwrap();
    assert_eq!(ev.reason, "IPAddressNotAllocated");
    assert_eq!(ev.note, "IPAddress: 10.0.0.9 for Service a/gone appears to have leaked: cleaning up");
    // Exactly the grace period is not older than it.
    let edge = Records::Objects(vec![record("10.0.0.9", "clusterip.allocator", parent, 60)]);
    assert!(matches!(only(&decide(&ipaddr(), &[], &edge, &mut LeakCounts::default())).action, Action::ReleaseAfterGrace { .. }));
}

#[test]
fn others_records_are_never_changed() {
    // The kube-apiserver's orphan: not judged in ipaddress mode.
    let parent = Some(ParentRef::service("a", "gone"));
    let recs = Records::Objects(vec![record("10.0.0.9", "ipallocator.k8s.io", parent, 600)]);
    assert!(decide(&ipaddr(), &[], &recs, &mut LeakCounts::default()).findings.is_empty());
    // A wrong reference on another manager's object is reported, not fixed.
    let recs = Records::Objects(vec![record("10.0.0.7", "ipallocator.k8s.io", Some(ParentRef::service("a", "other")), 600)]);
    let r = decide(&ipaddr(), &[svc("a", "web", 1, &["10.0.0.7"]), svc("a", "other", 1, &[])], &recs, &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!(f.kind, Kind::WrongReference);
    assert_eq!(f.action, Action::None("managed by ipallocator.k8s.io".into()));
    assert!(f.event.is_none());
}

#[test]
fn wrong_reference_on_our_record_is_replaced() {
    let recs = Records::Objects(vec![record("10.0.0.7", "clusterip.allocator", Some(ParentRef::service("a", "gone")), 5)]);
    let r = decide(&ipaddr(), &[svc("a", "web", 1, &["10.0.0.7"])], &recs, &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, &f.action), (Kind::WrongReference, &Action::Replace));
    assert_eq!(f.service, Some(("a".into(), "web".into())));
    let ev = f.event.as_ref().unwrap();
    assert_eq!(ev.reason, "ClusterIPNotAllocated");
    assert_eq!(ev.note, "the ClusterIP [IPv4]: 10.0.0.7 for Service a/web has a wrong reference; repairing");
}

#[test]
fn record_of_a_live_service_that_does_not_hold_it_is_released() {
    let recs = Records::Objects(vec![record("10.0.0.8", "clusterip.allocator", Some(ParentRef::service("a", "web")), 5)]);
    let r = decide(&ipaddr(), &[svc("a", "web", 1, &["10.0.0.7"])], &recs, &mut LeakCounts::default());
    // 10.0.0.7 has no record (missing) and 10.0.0.8 names web, which does not hold it.
    assert_eq!(r.count(Kind::MissingRecord), 1);
    let f = r.findings.iter().find(|f| f.kind == Kind::WrongReference).unwrap();
    assert_eq!(f.action, Action::Release);
    let ev = f.event.as_ref().unwrap();
    assert_eq!(ev.reason, "IPAddressWrongReference");
    assert_eq!(ev.note, "IPAddress: 10.0.0.8 for Service a/web has a wrong reference; cleaning up");
}

#[test]
fn wrong_labels_on_our_record_are_replaced() {
    let mut rec = record("10.0.0.7", "clusterip.allocator", Some(ParentRef::service("a", "web")), 5);
    rec.family_label = Some("IPv6".into());
    let r = decide(&ipaddr(), &[svc("a", "web", 1, &["10.0.0.7"])], &Records::Objects(vec![rec]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, &f.action), (Kind::WrongLabels, &Action::Replace));
    assert!(f.owner.contains("ip-family=IPv6"), "{}", f.owner);
}

#[test]
fn our_orphans_outside_our_ranges_are_not_judged() {
    let recs = Records::Objects(vec![record("10.9.0.9", "clusterip.allocator", Some(ParentRef::service("a", "gone")), 600)]);
    assert!(decide(&ipaddr(), &[], &recs, &mut LeakCounts::default()).findings.is_empty());
}

#[test]
fn non_service_parents_of_ours_are_not_judged() {
    let gw = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("a".into()), name: "gw".into() };
    let recs = Records::Objects(vec![record("10.0.0.9", "clusterip.allocator", Some(gw), 600)]);
    assert!(decide(&ipaddr(), &[], &recs, &mut LeakCounts::default()).findings.is_empty());
}

#[test]
fn audit_reports_and_never_acts() {
    let cfg = Config { ranges: ranges(), cluster_ranges: None, mode: Mode::Audit { manager: "ipallocator.k8s.io".into() }, grace: DEFAULT_GRACE, release_leaks_now: true };
    let recs = Records::Objects(vec![
        record("10.0.0.9", "ipallocator.k8s.io", Some(ParentRef::service("a", "gone")), 600),
        record("10.0.0.7", "clusterip.allocator", Some(ParentRef::service("a", "web")), 600),
    ]);
    let services = [svc("a", "web", 1, &["10.0.0.7"]), svc("a", "nope", 1, &["10.0.0.6"]), svc("a", "out", 1, &["10.0.5.5"])];
    let r = decide(&cfg, &services, &recs, &mut LeakCounts::default());
    let kinds: Vec<Kind> = r.findings.iter().map(|f| f.kind).collect();
    assert_eq!(kinds, vec![Kind::Leak, Kind::MissingRecord, Kind::OutOfRange, Kind::WrongLabels]);
    for f in &r.findings {
        assert_eq!(f.action, Action::None("read-only audit".into()), "{f:?}");
        assert!(f.event.is_none());
    }
}

#[test]
fn metric_types_are_kubernetes_labels() {
    let types: BTreeSet<&str> = [
        Kind::Leak,
        Kind::WrongReference,
        Kind::MissingRecord,
        Kind::Duplicate,
        Kind::OutOfRange,
        Kind::FamilyNotConfigured,
        Kind::Malformed,
        Kind::WrongLabels,
    ]
    .iter()
    .map(|k| k.metric_type())
    .collect();
    assert_eq!(types, ["duplicate", "invalid", "leak", "outOfRange", "repair"].into_iter().collect());
}

/// A Service stored before the apiserver validated strictly holds the address its text
/// spells, as Kubernetes' repair reads it (`ParseIPSloppy`): no `ClusterIPNotValid`; recorded
/// → consistent, unrecorded → a missing record of the canonical address.
#[test]
fn a_stored_legacy_form_is_the_address_it_spells() {
    let r = decide(&etcd(), &[svc("a", "zeros", 1, &["10.0.0.01"]), svc("a", "mapped", 2, &["::ffff:10.0.0.2"])], &map(&["10.0.0.1", "10.0.0.2"]), &mut LeakCounts::default());
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let r = decide(&etcd(), &[svc("a", "zeros", 1, &["10.0.0.005"])], &map(&[]), &mut LeakCounts::default());
    let f = only(&r);
    assert_eq!((f.kind, f.address.as_str()), (Kind::MissingRecord, "10.0.0.5"));
}
