//! `clusterip explain IP`: everything the cluster and our records say about one address —
//! the range and band it falls in, the Services that hold it, its IPAddress object, the
//! backend's own record (the etcd map and its owner record, or the address block and its
//! holder) — and whether they agree, judged by the repair pass's own rules ([`decide`])
//! on that one address, so `explain` and `repair` never tell two stories.
//!
//! Reads only: one IPAddress, the Services a field selector finds (`spec.clusterIP`) and
//! the Service the IPAddress names, the backend's record, the ServiceCIDRs and the block
//! Leases. A Service holding the address only as its second family's address, with no
//! IPAddress naming it, is not found (no field selects `spec.clusterIPs[1]`); `clusterip
//! repair` lists every Service and finds it.

use std::net::IpAddr;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, ListParams};
use serde::Serialize;

use super::decide::{decide, Config, Finding, LeakCounts, Mode, RecordView, Records, ServiceView, DEFAULT_GRACE};
use super::{record_view, service_view, RepairError, Target};
use crate::cidr::{self, ServiceCidr};
use crate::k8s::ipaddress::KUBE_APISERVER_MANAGER;
use crate::store::ipaddress::blocks::{ADDRESSES_ANNOTATION, BLOCK_LABEL};
use crate::store::ParentRef;

/// Where the address falls among the ranges.
#[derive(Clone, Debug, Serialize)]
pub struct RangeFact {
    pub cidr: String,
    /// "static" (the band reserved for requested addresses) or "dynamic".
    pub band: &'static str,
    /// Offset among the range's usable addresses (0 = the first).
    pub offset: u64,
}

/// A Service holding the address.
#[derive(Clone, Debug, Serialize)]
pub struct ServiceFact {
    pub namespace: String,
    pub name: String,
    pub cluster_ips: Vec<String>,
    /// Whether our webhook assigned the address (its annotation says so).
    pub assigned_by_us: bool,
}

/// The address's IPAddress object.
#[derive(Clone, Debug, Serialize)]
pub struct IpAddressFact {
    /// The parentRef: `services/<ns>/<name>`, `<resource>.<group>/<ns>/<name>`.
    pub parent: Option<String>,
    pub managed_by: Option<String>,
    pub age_seconds: Option<u64>,
}

/// The etcd backend's record of the address.
#[derive(Clone, Debug, Serialize)]
pub struct MapFact {
    pub allocated: bool,
    /// The owner record of a non-Service owner (`clusterip allocate --parent`).
    pub owner: Option<String>,
}

/// The address block (ipaddress backend) whose Lease names the address.
#[derive(Clone, Debug, Serialize)]
pub struct BlockFact {
    pub lease: String,
    pub holder: Option<String>,
    pub renewed: Option<String>,
}

/// Who held the address over one stretch of time, per the address history
/// ([`crate::history`]); times in RFC 3339.
#[derive(Clone, Debug, Serialize)]
pub struct HoldingFact {
    pub parent: String,
    pub manager: String,
    /// None: before the history begins.
    pub from: Option<String>,
    /// None: holds it still.
    pub to: Option<String>,
    /// `to` is when a list found the record gone (no replica was recording when it went).
    pub to_approximate: bool,
    /// The decision of ours that recorded it (None: its manager did — the kube-apiserver, at
    /// the Service's admission, for `ipallocator.k8s.io`).
    pub began_by: Option<DecisionFact>,
    /// The decision of ours that released it (None while held, or when the record was
    /// deleted by its manager or by hand and no decision of ours was noted).
    pub ended_by: Option<DecisionFact>,
}

/// A decision of ours about the address, per the address history.
#[derive(Clone, Debug, Serialize)]
pub struct DecisionFact {
    /// RFC 3339.
    pub at: String,
    /// Its code (`service-deleted`, `repair-released`, `create-failed`, …).
    pub decision: &'static str,
    /// The replica that made it.
    pub by: String,
    /// The parent it was made for (`-`: none known).
    pub parent: String,
    /// What it was, in words.
    pub says: &'static str,
}

/// One finding of the repair rules about the address.
#[derive(Clone, Debug, Serialize)]
pub struct FindingFact {
    pub kind: &'static str,
    pub owner: String,
    /// What `clusterip repair --fix` (and the controller's repair loop) does about it.
    pub action: String,
}

/// Everything known about one address.
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    pub address: String,
    pub backend: &'static str,
    /// The range of ours it falls in, if any.
    pub range: Option<RangeFact>,
    /// The cluster's ServiceCIDR ranges covering it (when the API is served).
    pub cluster_ranges: Option<Vec<String>>,
    pub services: Vec<ServiceFact>,
    pub ipaddress: Option<IpAddressFact>,
    pub map: Option<MapFact>,
    pub block: Option<BlockFact>,
    /// Who holds it, in one phrase: `services/<ns>/<name>`, another parentRef, or None.
    pub owner: Option<String>,
    /// Whether every record agrees (no finding).
    pub agree: bool,
    pub findings: Vec<FindingFact>,
    /// Who held it, oldest first, as far as the address history reaches (None: no history
    /// could be read).
    pub history: Option<Vec<HoldingFact>>,
    /// Decisions of ours in the history that began or ended no holding of it (an answer the
    /// kube-apiserver never recorded, a map address released with no record to show it).
    pub decisions: Vec<DecisionFact>,
}

/// Gather what the cluster and the backend of `target` hold for `ip`; block Leases and the
/// address history are read from `namespace` (the controller's) when given. The reads are
/// independent and made at once: the answer takes as long as the slowest (at 50k Services,
/// the field-selected Service list or the history's shard), not their sum.
pub async fn explain(client: &kube::Client, target: &Target, ip: IpAddr, namespace: Option<&str>) -> Result<Explanation, RepairError> {
    let now = k8s_openapi::jiff::Timestamp::now();
    let (own, mode, backend) = match target {
        Target::Etcd(store) => (store.ranges(), Mode::Etcd, "etcd"),
        Target::IpAddress { manager, ranges, .. } => (ranges.clone(), Mode::IpAddress { manager: manager.clone() }, "ipaddress"),
        Target::Audit => (Vec::new(), Mode::Audit { manager: KUBE_APISERVER_MANAGER.into() }, "kube-apiserver"),
    };
    let object = async {
        let ipaddresses: Api<IPAddress> = Api::all(client.clone());
        Ok(ipaddresses.get_opt(&ip.to_string()).await.map_err(|source| RepairError::List { what: "IPAddresses", source })?.map(|o| record_view(o, now)))
    };
    let map = async {
        match target {
            Target::Etcd(store) => {
                let (allocated, owner) = futures::try_join!(store.has(ip), store.owner(ip))?;
                Ok::<_, RepairError>(Some(MapFact { allocated, owner: owner.as_ref().map(ParentRef::to_string) }))
            }
            _ => Ok(None),
        }
    };
    let block = async {
        match (backend, namespace) {
            ("ipaddress", Some(ns)) => block_of(client, ns, ip).await,
            _ => Ok(None),
        }
    };
    let history = async {
        match namespace {
            Some(ns) => match crate::history::read_for(client, ns, ip).await {
                Ok(log) => Ok(Some(crate::history::holdings(&log, ip))),
                Err(kube::Error::Api(s)) if s.code == 403 || s.code == 404 => Ok(None),
                Err(source) => Err(RepairError::List { what: "address history ConfigMaps", source }),
            },
            None => Ok(None),
        }
    };
    let (object, map, (ranges, cluster_ranges), selected, block, history) =
        futures::try_join!(object, map, target.ranges(client, own), by_cluster_ip(client, ip), block, history)?;
    let services = holders(client, ip, selected, object.as_ref()).await?;
    let mut found = judge(ip, backend, &ranges, cluster_ranges, services, object, map, block, mode);
    if let Some((holdings, apart)) = history {
        found.history = Some(holdings.into_iter().map(holding_fact).collect());
        found.decisions = apart.into_iter().map(decision_fact).collect();
    }
    Ok(found)
}

fn time(t: Option<i64>) -> Option<String> {
    t.and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok()).map(|t| t.to_string())
}

fn holding_fact(h: crate::history::Holding) -> HoldingFact {
    HoldingFact {
        parent: h.parent,
        manager: h.manager,
        from: time(h.from),
        to: time(h.to),
        to_approximate: h.to_approximate,
        began_by: h.began_by.map(decision_fact),
        ended_by: h.ended_by.map(decision_fact),
    }
}

fn decision_fact(d: crate::history::Decided) -> DecisionFact {
    DecisionFact { at: time(Some(d.at)).unwrap_or_default(), decision: d.decision.code(), by: d.by, parent: d.parent, says: d.decision.describe() }
}

/// The Services whose `spec.clusterIP` is `ip` (a field selector).
async fn by_cluster_ip(client: &kube::Client, ip: IpAddr) -> Result<Vec<ServiceView>, RepairError> {
    let all: Api<Service> = Api::all(client.clone());
    let list = all.list(&ListParams::default().fields(&format!("spec.clusterIP={ip}"))).await.map_err(|source| RepairError::List { what: "Services", source })?;
    Ok(list.items.into_iter().map(service_view).collect())
}

/// The Services holding `ip`: those whose `spec.clusterIP` it is (`found`), and the one its
/// IPAddress names if that one holds it too (its second family's address).
async fn holders(client: &kube::Client, ip: IpAddr, mut found: Vec<ServiceView>, object: Option<&RecordView>) -> Result<Vec<ServiceView>, RepairError> {
    if let Some(ParentRef { group, resource, namespace: Some(ns), name }) = object.and_then(|o| o.parent.clone()) {
        if group.is_empty() && resource == "services" && !found.iter().any(|s| s.namespace == ns && s.name == name) {
            let api: Api<Service> = Api::namespaced(client.clone(), &ns);
            if let Some(svc) = api.get_opt(&name).await.map_err(|source| RepairError::List { what: "Services", source })? {
                let view = service_view(svc);
                if view.cluster_ips.iter().any(|t| cidr::parse_ip(t).ok() == Some(ip)) {
                    found.push(view);
                }
            }
        }
    }
    Ok(found)
}

/// The block Lease in `namespace` whose addresses include `ip`.
async fn block_of(client: &kube::Client, namespace: &str, ip: IpAddr) -> Result<Option<BlockFact>, RepairError> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let list = api.list(&ListParams::default().labels(BLOCK_LABEL)).await.map_err(|source| RepairError::List { what: "block Leases", source })?;
    let covers = |l: &Lease| -> bool {
        let Some((a, b)) = l.metadata.annotations.as_ref().and_then(|m| m.get(ADDRESSES_ANNOTATION)).and_then(|t| t.split_once('-')) else { return false };
        match (cidr::parse_ip(a.trim()), cidr::parse_ip(b.trim())) {
            (Ok(a), Ok(b)) => cidr::Family::of(a) == cidr::Family::of(ip) && cidr::Family::of(b) == cidr::Family::of(ip) && number(a) <= number(ip) && number(ip) <= number(b),
            _ => false,
        }
    };
    Ok(list.items.iter().find(|l| covers(l)).map(|l| BlockFact {
        lease: l.metadata.name.clone().unwrap_or_default(),
        holder: l.spec.as_ref().and_then(|s| s.holder_identity.clone()),
        renewed: l.spec.as_ref().and_then(|s| s.renew_time.as_ref()).map(|t| t.0.to_string()),
    }))
}

fn number(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v) => u128::from(u32::from(v)),
        IpAddr::V6(v) => u128::from(v),
    }
}

/// The explanation of what was read about `ip`: pure, the repair rules applied to the one
/// address (a leak counts as seen once: a one-shot look, like `clusterip repair`).
#[allow(clippy::too_many_arguments)]
pub fn judge(
    ip: IpAddr,
    backend: &'static str,
    ranges: &[ServiceCidr],
    cluster_ranges: Option<Vec<ServiceCidr>>,
    services: Vec<ServiceView>,
    object: Option<RecordView>,
    map: Option<MapFact>,
    block: Option<BlockFact>,
    mode: Mode,
) -> Explanation {
    let range = ranges.iter().find(|c| c.contains(ip)).and_then(|c| {
        let offset = c.offset_of(ip)?;
        Some(RangeFact { cidr: c.to_string(), band: if offset < c.band_offset() { "static" } else { "dynamic" }, offset })
    });
    let records = match &map {
        // An address with an owner record is its owner's, never a leak (as in the pass).
        Some(m) => Records::Map(if m.allocated && m.owner.is_none() { [ip].into_iter().collect() } else { Default::default() }),
        None => Records::Objects(object.iter().cloned().collect()),
    };
    let cfg = Config { ranges: ranges.to_vec(), cluster_ranges: cluster_ranges.clone(), mode, grace: DEFAULT_GRACE, release_leaks_now: false };
    let report = decide(&cfg, &services, &records, &mut LeakCounts::default());
    let findings: Vec<FindingFact> = report.findings.iter().filter(|f| concerns(f, ip)).map(|f| FindingFact { kind: f.kind.as_str(), owner: f.owner.clone(), action: f.action.to_string() }).collect();
    let owner = match (services.first(), &object, &map) {
        (Some(s), _, _) => Some(format!("services/{}/{}", s.namespace, s.name)),
        (None, Some(o), _) => o.parent.as_ref().map(ParentRef::to_string),
        (None, None, Some(MapFact { owner: Some(o), .. })) => Some(o.clone()),
        _ => None,
    };
    Explanation {
        address: ip.to_string(),
        backend,
        range,
        cluster_ranges: cluster_ranges.map(|c| c.iter().filter(|r| r.covers(ip)).map(|r| r.to_string()).collect()),
        services: services
            .iter()
            .map(|s| ServiceFact { namespace: s.namespace.clone(), name: s.name.clone(), cluster_ips: s.cluster_ips.clone(), assigned_by_us: s.assigned_by_us().any(|t| cidr::parse_ip(t).ok() == Some(ip)) })
            .collect(),
        ipaddress: object.map(|o| IpAddressFact { parent: o.parent.as_ref().map(ParentRef::to_string), managed_by: o.managed_by, age_seconds: o.age.map(|a| a.as_secs()) }),
        map,
        block,
        owner,
        agree: findings.is_empty(),
        findings,
        history: None,
        decisions: Vec::new(),
    }
}

/// Whether a finding is about `ip` (a Service's other family's address is not).
fn concerns(f: &Finding, ip: IpAddr) -> bool {
    cidr::parse_ip(&f.address).ok() == Some(ip)
}

impl std::fmt::Display for Explanation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.address)?;
        match &self.range {
            Some(r) => writeln!(f, "  range      {} ({} band, offset {})", r.cidr, r.band, r.offset)?,
            None => writeln!(f, "  range      in none of ours")?,
        }
        match &self.cluster_ranges {
            Some(c) if c.is_empty() => writeln!(f, "  cluster    in no ServiceCIDR")?,
            Some(c) => writeln!(f, "  cluster    ServiceCIDR range {}", c.join(", "))?,
            None => {}
        }
        if self.services.is_empty() {
            writeln!(f, "  Service    none holds it")?;
        }
        for s in &self.services {
            writeln!(f, "  Service    {}/{} (clusterIPs {}{})", s.namespace, s.name, s.cluster_ips.join(","), if s.assigned_by_us { "; assigned by clusterip" } else { "" })?;
        }
        match &self.ipaddress {
            Some(o) => writeln!(
                f,
                "  IPAddress  parentRef {}, managed by {}{}",
                o.parent.as_deref().unwrap_or("<none>"),
                o.managed_by.as_deref().unwrap_or("<no label>"),
                o.age_seconds.map(|a| format!(", {a}s old")).unwrap_or_default()
            )?,
            None => writeln!(f, "  IPAddress  none")?,
        }
        if let Some(m) = &self.map {
            let what = match (m.allocated, &m.owner) {
                (false, _) => "free".to_string(),
                (true, None) => "allocated".to_string(),
                (true, Some(o)) => format!("allocated, owner record {o}"),
            };
            writeln!(f, "  etcd map   {what}")?;
        }
        if self.backend == "ipaddress" {
            match &self.block {
                Some(b) => writeln!(f, "  block      {} held by {}{}", b.lease, b.holder.as_deref().unwrap_or("<nobody>"), b.renewed.as_ref().map(|t| format!(", renewed {t}")).unwrap_or_default())?,
                None => writeln!(f, "  block      none names it")?,
            }
        }
        match &self.history {
            Some(h) if h.is_empty() => writeln!(f, "  history    none recorded")?,
            Some(h) => {
                for (i, x) in h.iter().enumerate() {
                    let to = match (&x.to, x.to_approximate) {
                        (Some(t), false) => t.clone(),
                        (Some(t), true) => format!("before {t}"),
                        (None, _) => "now".into(),
                    };
                    writeln!(f, "  {}{} {} → {to}", if i == 0 { "history    " } else { "           " }, x.parent, x.from.as_deref().unwrap_or("(before the history)"))?;
                    let began = match &x.began_by {
                        Some(d) => Some(format!("{} ({}, {})", d.says, d.by, d.at)),
                        None if x.from.is_some() && x.manager == KUBE_APISERVER_MANAGER => Some("recorded by the kube-apiserver at the Service's admission".into()),
                        None => None,
                    };
                    let ended = match &x.ended_by {
                        Some(d) => Some(format!("{} ({}, {})", d.says, d.by, d.at)),
                        None if x.to.is_some() && x.manager == KUBE_APISERVER_MANAGER => Some("the kube-apiserver deleted its record (the Service was deleted or gave the address up); no decision of ours noted".into()),
                        None if x.to.is_some() => Some(format!("its record was deleted, by its manager ({}) or by hand; no decision of ours noted", x.manager)),
                        None => None,
                    };
                    for (what, why) in [("began", began), ("ended", ended)] {
                        if let Some(why) = why {
                            writeln!(f, "             {what}: {why}")?;
                        }
                    }
                }
            }
            None => {}
        }
        for (i, d) in self.decisions.iter().enumerate() {
            writeln!(f, "  {}{} {} for {}: {} ({})", if i == 0 { "decisions  " } else { "           " }, d.at, d.decision, d.parent, d.says, d.by)?;
        }
        let recorded = self.ipaddress.is_some() || self.map.as_ref().is_some_and(|m| m.allocated);
        let owner = match (&self.owner, recorded) {
            (Some(o), _) => format!("held by {o}"),
            (None, true) => "recorded for no owner".into(),
            (None, false) => "free".into(),
        };
        if self.agree {
            write!(f, "  verdict    {owner}; the records agree")
        } else {
            writeln!(f, "  verdict    {owner}; the records disagree:")?;
            for (i, x) in self.findings.iter().enumerate() {
                write!(f, "    - {} ({}): repair: {}", x.kind, if x.owner.is_empty() { "-" } else { &x.owner }, x.action)?;
                if i + 1 < self.findings.len() {
                    writeln!(f)?;
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, created: i64, ips: &[&str]) -> ServiceView {
        ServiceView { namespace: "ns".into(), name: name.into(), created: Some(created), cluster_ips: ips.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    /// A duplicate (which a stock kube-apiserver refuses at admission, so no integration test
    /// can make one through it): the oldest Service is named the holder, the records disagree,
    /// and the other family's address of a dual-stack holder is not this address's finding.
    #[test]
    fn two_services_on_one_address_disagree_and_the_oldest_holds_it() {
        let ip: IpAddr = "198.19.0.5".parse().expect("ip");
        let ranges = [ServiceCidr::parse("198.19.0.0/24").expect("range")];
        let services = vec![svc("old", 1, &["198.19.0.5", "fd00::5"]), svc("new", 2, &["198.19.0.5"])];
        let map = Some(MapFact { allocated: true, owner: None });
        let e = judge(ip, "etcd", &ranges, None, services, None, map, None, Mode::Etcd);
        assert_eq!(e.owner.as_deref(), Some("services/ns/old"));
        assert!(!e.agree);
        assert_eq!(e.findings.iter().map(|f| f.kind).collect::<Vec<_>>(), vec!["duplicate"], "{:#?}", e.findings);
        assert_eq!(e.range.as_ref().map(|r| (r.band, r.offset)), Some(("static", 4)));
        assert!(e.to_string().contains("held by services/ns/old; the records disagree:"), "{e}");
    }
}
