//! The iptables dataplane (`--mode iptables`), kube-proxy's layout: `KUBE-SERVICES` (one
//! rule per VIP:port), `KUBE-NODEPORTS`, per-Service `KUBE-SVC-*` / `KUBE-SVL-*` /
//! `KUBE-EXT-*` chains choosing an endpoint with `statistic --probability` rules, one
//! `KUBE-SEP-*` chain per endpoint (hairpin mark + DNAT), `KUBE-MARK-MASQ` /
//! `KUBE-POSTROUTING` for masquerading, and REJECT/DROP rules in the filter table for
//! Services without (usable) endpoints. Applied with `iptables-restore --noflush` (and
//! `ip6tables-restore`); a partial sync rewrites the top-level chains and only the chains
//! of Services that changed (kube-proxy's MinimizeIPTablesRestore).

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::model::state::DesiredPort;
use crate::model::{Endpoint, IpFamily, NamespacedName, ServicePortName};
use crate::netns::{ExecError, Executor};
use crate::proxier::{DataplaneError, Proxier, SyncBatch, SyncReport};

const MASQ_MARK: &str = "0x4000";

/// Jump rules from the built-in chains, as (table, chain, rule args).
const JUMPS: [(&str, &str, &str); 7] = [
    ("nat", "PREROUTING", "-m comment --comment clusterip-agent -j KUBE-SERVICES"),
    ("nat", "OUTPUT", "-m comment --comment clusterip-agent -j KUBE-SERVICES"),
    ("nat", "POSTROUTING", "-m comment --comment clusterip-agent -j KUBE-POSTROUTING"),
    ("filter", "INPUT", "-m conntrack --ctstate NEW -m comment --comment clusterip-agent -j KUBE-EXTERNAL-SERVICES"),
    ("filter", "INPUT", "-m conntrack --ctstate NEW -m comment --comment clusterip-agent -j KUBE-SERVICES"),
    ("filter", "FORWARD", "-m conntrack --ctstate NEW -m comment --comment clusterip-agent -j KUBE-SERVICES"),
    ("filter", "OUTPUT", "-m conntrack --ctstate NEW -m comment --comment clusterip-agent -j KUBE-SERVICES"),
];

const NAT_TOP: [&str; 4] = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"];
const FILTER_TOP: [&str; 2] = ["KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES"];

fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::new();
    let (mut buf, mut bits) = (0u32, 0);
    for b in bytes {
        buf = (buf << 8) | u32::from(*b);
        bits += 8;
        while bits >= 5 {
            out.push(ALPHABET[((buf >> (bits - 5)) & 31) as usize] as char);
            bits -= 5;
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((buf << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// kube-proxy's chain naming: prefix + base32(sha256(name))[:16].
pub fn chain_name(prefix: &str, name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    let mut s = base32(&digest);
    s.truncate(16);
    format!("{prefix}{s}")
}

/// The probability of picking endpoint `i` of `n` so that the choice is uniform.
pub fn probability(i: usize, n: usize) -> String {
    format!("{:.10}", 1.0 / (n - i) as f64)
}

fn host_cidr(ip: &IpAddr) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}/32"),
        IpAddr::V6(a) => format!("{a}/128"),
    }
}

fn target(ip: &IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// What one Service port puts in the tables of one family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortRules {
    /// Rules of KUBE-SERVICES (nat).
    pub nat_services: Vec<String>,
    /// Rules of KUBE-NODEPORTS (nat).
    pub nat_nodeports: Vec<String>,
    /// Rules of filter KUBE-SERVICES (rejects/drops).
    pub filter_services: Vec<String>,
    /// Rules of filter KUBE-EXTERNAL-SERVICES.
    pub filter_external: Vec<String>,
    /// The Service's own nat chains → rules.
    pub chains: BTreeMap<String, Vec<String>>,
}

/// Render one Service port for one family.
pub fn render_port(d: &DesiredPort, family: IpFamily, masquerade_all: bool, cluster_cidrs: &[IpNet]) -> PortRules {
    let mut r = PortRules::default();
    let sp = &d.port;
    let in_family = |a: &&IpAddr| IpFamily::of(a) == family;
    let cluster_ips: Vec<&IpAddr> = sp.cluster_ips.iter().filter(in_family).collect();
    if cluster_ips.is_empty() {
        return r;
    }
    let eps = d.endpoints(family);
    let proto = sp.name.protocol.keyword();
    let name = port_name_text(&sp.name, family);
    let svc_chain = chain_name("KUBE-SVC-", &name);
    let svl_chain = chain_name("KUBE-SVL-", &name);
    let ext_chain = chain_name("KUBE-EXT-", &name);
    let has_cluster = sp.uses_cluster_endpoints() && !eps.cluster.is_empty();
    let has_local = sp.uses_local_endpoints() && !eps.local.is_empty();
    let no_ep_target = if eps.has_any { "DROP" } else { "REJECT" };
    let comment = format!("-m comment --comment \"{}\"", sp.name);
    let mut sep_chains: BTreeMap<(IpAddr, u16), String> = BTreeMap::new();
    let mut lb = |chain: &str, list: &[Endpoint], r: &mut PortRules, internal: bool| {
        let mut rules = Vec::new();
        if internal {
            for cip in &cluster_ips {
                let m = format!("{comment} -d {} -p {proto} -m {proto} --dport {}", host_cidr(cip), sp.port);
                if masquerade_all {
                    rules.push(format!("{m} -j KUBE-MARK-MASQ"));
                } else {
                    for cidr in cluster_cidrs.iter().filter(|c| IpFamily::of(&c.addr()) == family) {
                        rules.push(format!("{m} ! -s {cidr} -j KUBE-MARK-MASQ"));
                    }
                }
            }
        }
        let seps: Vec<String> = list
            .iter()
            .map(|ep| {
                sep_chains
                    .entry((ep.ip, ep.port))
                    .or_insert_with(|| chain_name("KUBE-SEP-", &format!("{name}{}", target(&ep.ip, ep.port))))
                    .clone()
            })
            .collect();
        if let Some(t) = sp.affinity_timeout {
            for sep in &seps {
                rules.push(format!("{comment} -m recent --name {sep} --mask {} --rsource --rcheck --seconds {t} --reap -j {sep}", full_mask(family)));
            }
        }
        let n = seps.len();
        for (i, sep) in seps.iter().enumerate() {
            if i + 1 < n {
                rules.push(format!("{comment} -m statistic --mode random --probability {} -j {sep}", probability(i, n)));
            } else {
                rules.push(format!("{comment} -j {sep}"));
            }
        }
        r.chains.insert(chain.to_string(), rules);
    };
    if has_cluster {
        lb(&svc_chain, &eps.cluster, &mut r, !sp.internal_policy_local);
    }
    if has_local {
        lb(&svl_chain, &eps.local, &mut r, sp.internal_policy_local);
    }
    // Endpoint chains.
    let all: Vec<&Endpoint> = if has_cluster { eps.cluster.iter().collect() } else { vec![] };
    let all = all.into_iter().chain(if has_local { eps.local.iter().collect::<Vec<_>>() } else { vec![] });
    for ep in all {
        let Some(sep) = sep_chains.get(&(ep.ip, ep.port)) else { continue };
        if r.chains.contains_key(sep) {
            continue;
        }
        let mut rules = vec![format!("{comment} -s {} -j KUBE-MARK-MASQ", host_cidr(&ep.ip))];
        let recent = if sp.affinity_timeout.is_some() { format!(" -m recent --name {sep} --mask {} --rsource --set", full_mask(family)) } else { String::new() };
        rules.push(format!("{comment}{recent} -p {proto} -m {proto} -j DNAT --to-destination {}", target(&ep.ip, ep.port)));
        r.chains.insert(sep.clone(), rules);
    }
    let internal = if sp.internal_policy_local { has_local.then_some(&svl_chain) } else { has_cluster.then_some(&svc_chain) };
    for cip in &cluster_ips {
        let m = format!("{comment} -d {} -p {proto} -m {proto} --dport {}", host_cidr(cip), sp.port);
        match internal {
            Some(c) => r.nat_services.push(format!("{m} -j {c}")),
            None => r.filter_services.push(format!("{m} -j {no_ep_target}")),
        }
    }
    if sp.externally_accessible() {
        // As kube-proxy: the ext chain exists whenever the port has endpoints, even with
        // eTP=Local and none on this node — its short-circuit sends this node's own
        // connections to the cluster's endpoints; anything else falls through it undNATed and
        // meets the no-endpoint rule in the filter table (INPUT, FORWARD).
        let external = if sp.external_policy_local { has_local.then_some(&svl_chain) } else { has_cluster.then_some(&svc_chain) };
        let short_circuit = sp.external_policy_local && has_cluster;
        let uses_ext_chain = external.is_some() || short_circuit;
        if uses_ext_chain {
            let mut rules = Vec::new();
            if short_circuit {
                rules.push(format!("{comment} -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"));
                rules.push(format!("{comment} -m addrtype --src-type LOCAL -j {svc_chain}"));
            } else if !sp.external_policy_local {
                rules.push(format!("{comment} -j KUBE-MARK-MASQ"));
            }
            if let Some(t) = external {
                rules.push(format!("{comment} -j {t}"));
            }
            r.chains.insert(ext_chain.clone(), rules);
        }
        let vips = sp.external_ips.iter().chain(&sp.load_balancer_ips).filter(in_family);
        for vip in vips {
            let m = format!("{comment} -d {} -p {proto} -m {proto} --dport {}", host_cidr(vip), sp.port);
            if uses_ext_chain {
                r.nat_services.push(format!("{m} -j {ext_chain}"));
            }
            if external.is_none() {
                r.filter_services.push(format!("{m} -j {no_ep_target}"));
            }
        }
        if let Some(np) = sp.node_port {
            let m = format!("{comment} -p {proto} -m {proto} --dport {np}");
            if uses_ext_chain {
                r.nat_nodeports.push(format!("{m} -j {ext_chain}"));
            }
            if external.is_none() {
                r.filter_external.push(format!("{comment} -m addrtype --dst-type LOCAL -p {proto} -m {proto} --dport {np} -j {no_ep_target}"));
            }
        }
    }
    r
}

/// Prefixes of the chains kube-proxy's layout makes per Service port and endpoint.
const SERVICE_CHAIN_PREFIXES: [&str; 6] = ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-SEP-", "KUBE-FW-", "KUBE-XLB-"];

/// The chains `--cleanup` deletes from `table`: the agent's own, and kube-proxy's iptables
/// mode's (the same layout, plus the chains only kube-proxy makes: KUBE-FORWARD,
/// KUBE-PROXY-FIREWALL, KUBE-PROXY-CANARY) — as `kube-proxy --cleanup` does. Never another
/// component's KUBE- chain: the kubelet's KUBE-KUBELET-CANARY, KUBE-FIREWALL, KUBE-MARK-DROP
/// stay (deleting them makes the kubelet believe its rules were flushed; one still jumped to
/// cannot be deleted, and would fail the whole clean-up).
fn ours_to_clean(table: &str, chain: &str) -> bool {
    const PROXY_NAT: [&str; 5] = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ", "KUBE-PROXY-CANARY"];
    const PROXY_FILTER: [&str; 6] = ["KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS", "KUBE-PROXY-FIREWALL", "KUBE-PROXY-CANARY"];
    match table {
        "nat" => PROXY_NAT.contains(&chain) || SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)),
        "filter" => PROXY_FILTER.contains(&chain),
        _ => false,
    }
}

/// The per-Service chains declared in an `iptables-save` output.
fn service_chains(save: &str) -> BTreeSet<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p)))
        .map(str::to_string)
        .collect()
}

fn full_mask(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "255.255.255.255",
        IpFamily::V6 => "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    }
}

fn port_name_text(name: &ServicePortName, family: IpFamily) -> String {
    format!("{}:{}{}{}", name.service, name.port_name, name.protocol, if family == IpFamily::V6 { "6" } else { "" })
}

#[derive(Debug, Default)]
struct FamilyState {
    /// Rendered rules per Service port, as programmed.
    ports: HashMap<ServicePortName, PortRules>,
    by_service: HashMap<NamespacedName, Vec<ServicePortName>>,
}

/// The iptables dataplane.
pub struct IptablesProxier {
    exec: Executor,
    masquerade_all: bool,
    cluster_cidrs: Vec<IpNet>,
    families: [FamilyState; 2],
    /// Write every chain at the next sync (start, failure, drift).
    full_next: bool,
}

impl IptablesProxier {
    pub fn new(exec: Executor, masquerade_all: bool, cluster_cidrs: Vec<IpNet>) -> Self {
        IptablesProxier { exec, masquerade_all, cluster_cidrs, families: Default::default(), full_next: true }
    }

    fn tools(family: IpFamily) -> (&'static str, &'static str, &'static str) {
        match family {
            IpFamily::V4 => ("iptables", "iptables-save", "iptables-restore"),
            IpFamily::V6 => ("ip6tables", "ip6tables-save", "ip6tables-restore"),
        }
    }

    fn ensure_jumps(&self, family: IpFamily) -> Result<(), ExecError> {
        let (ipt, _, _) = Self::tools(family);
        // The chains must exist before a rule can jump to them (-N fails when they do).
        for (table, chains) in [("nat", &NAT_TOP[..]), ("filter", &FILTER_TOP[..])] {
            for c in chains {
                let _ = self.exec.run(ipt, &["-w", "-t", table, "-N", c], None);
            }
        }
        for (table, chain, rule) in JUMPS {
            let args: Vec<&str> = rule.split(' ').collect();
            let mut check = vec!["-w", "-t", table, "-C", chain];
            check.extend(&args);
            if self.exec.run(ipt, &check, None).is_err() {
                let mut insert = vec!["-w", "-t", table, "-I", chain, "1"];
                insert.extend(&args);
                self.exec.run(ipt, &insert, None)?;
            }
        }
        Ok(())
    }

    /// The per-Service chains (`KUBE-SVC-*`, `KUBE-SEP-*`, …) in the kernel's nat table: at
    /// start or after a failure the agent does not know which it made before (a Service
    /// deleted while the agent was down, a sync that failed after forgetting a chain).
    fn existing_service_chains(&self, family: IpFamily) -> Result<BTreeSet<String>, ExecError> {
        let (_, save, _) = Self::tools(family);
        let out = self.exec.run(save, &["-t", "nat"], None)?;
        Ok(service_chains(&out))
    }

    fn sync_family(&mut self, idx: usize, family: IpFamily, batch: &SyncBatch, full: bool) -> Result<(usize, usize), DataplaneError> {
        // Adopt what is there: chains the agent does not want are flushed and deleted in
        // the same restore that rewrites the rest.
        let existing = if self.full_next { self.existing_service_chains(family)? } else { BTreeSet::new() };
        let (masq_all, cidrs) = (self.masquerade_all, self.cluster_cidrs.clone());
        let st = &mut self.families[idx];
        let mut changed_chains: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut gone_chains: BTreeSet<String> = BTreeSet::new();
        let mut seen = BTreeSet::new();
        for (nsn, ports) in &batch.services {
            seen.insert(nsn.clone());
            let old_names = st.by_service.remove(nsn).unwrap_or_default();
            let mut new_names = Vec::new();
            for d in ports {
                let new = render_port(d, family, masq_all, &cidrs);
                if new == PortRules::default() {
                    continue;
                }
                let old = st.ports.remove(&d.port.name).unwrap_or_default();
                for (c, rules) in &new.chains {
                    if full || old.chains.get(c) != Some(rules) {
                        changed_chains.insert(c.clone(), rules.clone());
                    }
                }
                gone_chains.extend(old.chains.keys().filter(|c| !new.chains.contains_key(*c)).cloned());
                st.ports.insert(d.port.name.clone(), new);
                new_names.push(d.port.name.clone());
            }
            for n in old_names.iter().filter(|n| !new_names.contains(n)) {
                if let Some(old) = st.ports.remove(n) {
                    gone_chains.extend(old.chains.into_keys());
                }
            }
            if !new_names.is_empty() {
                st.by_service.insert(nsn.clone(), new_names);
            }
        }
        if full {
            let gone: Vec<NamespacedName> = st.by_service.keys().filter(|k| !seen.contains(*k)).cloned().collect();
            for nsn in gone {
                for n in st.by_service.remove(&nsn).unwrap_or_default() {
                    if let Some(old) = st.ports.remove(&n) {
                        gone_chains.extend(old.chains.into_keys());
                    }
                }
            }
            // Unchanged chains are written too on a full sync.
            for p in st.ports.values() {
                for (c, rules) in &p.chains {
                    changed_chains.entry(c.clone()).or_insert_with(|| rules.clone());
                }
            }
        }
        let live: BTreeSet<&String> = st.ports.values().flat_map(|p| p.chains.keys()).collect();
        gone_chains.extend(existing.into_iter().filter(|c| !changed_chains.contains_key(c)));
        gone_chains.retain(|c| !live.contains(c));

        // Top-level chains are written in full every time (KEP-3453).
        let mut nat = String::from("*nat\n");
        for c in NAT_TOP {
            let _ = writeln!(nat, ":{c} - [0:0]");
        }
        for c in changed_chains.keys().chain(gone_chains.iter()) {
            let _ = writeln!(nat, ":{c} - [0:0]");
        }
        let mut ports: Vec<&PortRules> = st.ports.values().collect();
        ports.sort_by(|a, b| a.nat_services.cmp(&b.nat_services));
        for p in &ports {
            for rule in &p.nat_services {
                let _ = writeln!(nat, "-A KUBE-SERVICES {rule}");
            }
            for rule in &p.nat_nodeports {
                let _ = writeln!(nat, "-A KUBE-NODEPORTS {rule}");
            }
        }
        let _ = writeln!(nat, "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS");
        let _ = writeln!(nat, "-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}");
        let _ = writeln!(nat, "-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN");
        let _ = writeln!(nat, "-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}");
        let _ = writeln!(nat, "-A KUBE-POSTROUTING -j MASQUERADE --random-fully");
        let mut rules = 0;
        for (c, rs) in &changed_chains {
            for r in rs {
                let _ = writeln!(nat, "-A {c} {r}");
                rules += 1;
            }
        }
        for c in &gone_chains {
            let _ = writeln!(nat, "-X {c}");
        }
        nat.push_str("COMMIT\n*filter\n");
        for c in FILTER_TOP {
            let _ = writeln!(nat, ":{c} - [0:0]");
        }
        for p in &ports {
            for rule in &p.filter_services {
                let _ = writeln!(nat, "-A KUBE-SERVICES {rule}");
            }
            for rule in &p.filter_external {
                let _ = writeln!(nat, "-A KUBE-EXTERNAL-SERVICES {rule}");
            }
        }
        nat.push_str("COMMIT\n");
        let (_, _, restore) = Self::tools(family);
        tracing::trace!(family = ?family, input = %nat, "iptables-restore");
        self.exec.run(restore, &["--noflush", "-w"], Some(nat.as_bytes()))?;
        Ok((changed_chains.len() + gone_chains.len(), rules))
    }
}

impl Proxier for IptablesProxier {
    fn sync(&mut self, batch: &SyncBatch) -> Result<SyncReport, DataplaneError> {
        let full = batch.full || self.full_next;
        let mut report = SyncReport { transactions: 0, ..Default::default() };
        let res = (|| {
            for (idx, fam) in IpFamily::ALL.into_iter().enumerate() {
                if full {
                    self.ensure_jumps(fam)?;
                }
                let (ops, _) = self.sync_family(idx, fam, batch, full)?;
                report.transactions += 1;
                report.operations += ops;
            }
            Ok::<(), DataplaneError>(())
        })();
        match res {
            Ok(()) => {
                self.full_next = false;
                for st in &self.families {
                    for p in st.ports.values() {
                        report.chains += p.chains.len();
                        report.rules += p.chains.values().map(Vec::len).sum::<usize>()
                            + p.nat_services.len()
                            + p.nat_nodeports.len()
                            + p.filter_services.len()
                            + p.filter_external.len();
                    }
                }
                Ok(report)
            }
            Err(e) => {
                self.full_next = true;
                Err(e)
            }
        }
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        let mut diffs = Vec::new();
        if self.full_next {
            return Ok(diffs);
        }
        for (idx, fam) in IpFamily::ALL.into_iter().enumerate() {
            let (_, save, _) = Self::tools(fam);
            let out = self.exec.run(save, &["-t", "nat"], None)?;
            let want: usize = self.families[idx].ports.values().map(|p| p.nat_services.len()).sum::<usize>() + 1;
            let have = out.lines().filter(|l| l.starts_with("-A KUBE-SERVICES ")).count();
            if have != want {
                diffs.push(format!("{save}: KUBE-SERVICES has {have} rules, expected {want}"));
            }
            if !out.lines().any(|l| l.starts_with("-A PREROUTING") && l.contains("-j KUBE-SERVICES")) {
                diffs.push(format!("{save}: PREROUTING does not jump to KUBE-SERVICES"));
            }
        }
        if !diffs.is_empty() {
            self.full_next = true;
        }
        Ok(diffs)
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        for fam in IpFamily::ALL {
            let (_, save, restore) = Self::tools(fam);
            // Read-only look first: touching iptables where the agent never ran would create
            // the (empty) tables.
            let mut touched = false;
            for table in ["nat", "filter"] {
                let Ok(out) = self.exec.run(save, &["-t", table], None) else { continue };
                let chains: Vec<&str> = out
                    .lines()
                    .filter_map(|l| l.strip_prefix(':'))
                    .filter_map(|l| l.split_whitespace().next())
                    .filter(|c| ours_to_clean(table, c))
                    .collect();
                if chains.is_empty() {
                    continue;
                }
                touched = true;
                // One transaction: every rule of another chain that jumps to one of ours
                // deleted (ours in PREROUTING, OUTPUT, …, and kube-proxy's), ours flushed
                // and deleted.
                let mut input = format!("*{table}\n");
                for c in &chains {
                    let _ = writeln!(input, ":{c} - [0:0]");
                }
                for rule in out.lines().filter_map(|l| l.strip_prefix("-A ")) {
                    let from = rule.split_whitespace().next().unwrap_or_default();
                    let to = rule.split_whitespace().skip_while(|w| *w != "-j" && *w != "-g").nth(1).unwrap_or_default();
                    if !chains.contains(&from) && chains.contains(&to) {
                        let _ = writeln!(input, "-D {rule}");
                    }
                }
                for c in &chains {
                    let _ = writeln!(input, "-X {c}");
                }
                input.push_str("COMMIT\n");
                self.exec.run(restore, &["--noflush", "-w"], Some(input.as_bytes()))?;
            }
            if touched {
                tracing::info!(family = ?fam, "iptables rules removed");
            }
        }
        self.families = Default::default();
        self.full_next = true;
        Ok(())
    }

    fn mode(&self) -> &'static str {
        "iptables"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::service::ServicePort;
    use crate::model::topology::Categorized;
    use crate::model::Protocol;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn d(n: usize) -> DesiredPort {
        let sp = ServicePort::cluster_ip("ns", "web", "http", Protocol::Tcp, ip("198.19.0.10"), 80);
        let cluster = (0..n).map(|i| Endpoint::ready(ip(&format!("198.18.2.{}", 10 + i)), 8080)).collect::<Vec<_>>();
        let has_any = !cluster.is_empty();
        DesiredPort { port: sp, v4: Categorized { cluster, local: vec![], has_any }, v6: Categorized::default() }
    }

    #[test]
    fn chain_names_are_stable_and_short() {
        let a = chain_name("KUBE-SVC-", "ns/web:httptcp");
        assert_eq!(a, chain_name("KUBE-SVC-", "ns/web:httptcp"));
        assert_eq!(a.len(), "KUBE-SVC-".len() + 16);
        assert_ne!(a, chain_name("KUBE-SVC-", "ns/web:dnsudp"));
        assert_eq!(base32(b"f"), "MY");
    }

    #[test]
    fn probabilities_make_a_uniform_choice() {
        assert_eq!(probability(0, 3), "0.3333333333");
        assert_eq!(probability(1, 3), "0.5000000000");
        assert_eq!(probability(2, 3), "1.0000000000");
    }

    #[test]
    fn service_with_endpoints() {
        let r = render_port(&d(3), IpFamily::V4, false, &[]);
        assert_eq!(r.nat_services.len(), 1);
        assert!(r.nat_services[0].contains("-d 198.19.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-"));
        assert_eq!(r.chains.len(), 4, "one SVC and three SEP chains");
        let svc = r.chains.iter().find(|(k, _)| k.starts_with("KUBE-SVC-")).map(|(_, v)| v).expect("svc chain");
        assert!(svc[0].contains("--probability 0.3333333333 -j KUBE-SEP-"));
        assert!(!svc[2].contains("probability"));
        let sep = r.chains.iter().find(|(k, _)| k.starts_with("KUBE-SEP-")).map(|(_, v)| v).expect("sep chain");
        assert!(sep[0].contains("-j KUBE-MARK-MASQ"));
        assert!(sep[1].contains("-j DNAT --to-destination 198.18.2."));
        assert!(r.filter_services.is_empty());
    }

    #[test]
    fn per_service_chains_are_found_in_a_save() {
        let save = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-AAAA - [0:0]\n:KUBE-SEP-BBBB - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n-A KUBE-SERVICES -j KUBE-SVC-AAAA\nCOMMIT\n";
        assert_eq!(service_chains(save), ["KUBE-SEP-BBBB".to_string(), "KUBE-SVC-AAAA".to_string()].into());
    }

    /// Kubernetes' e2e "should implement NodePort and HealthCheckNodePort correctly when
    /// ExternalTrafficPolicy changes" (found there for the nftables mode): a NodePort with
    /// eTP=Local and endpoints, none on this node. This node's own connections (nat OUTPUT)
    /// are short-circuited to the cluster's endpoints through the ext chain; others fall
    /// through it and are dropped in the filter table.
    #[test]
    fn external_local_without_local_endpoints_short_circuits_this_nodes_own_traffic() {
        let mut p = d(2);
        p.port.node_port = Some(30080);
        p.port.external_policy_local = true;
        let r = render_port(&p, IpFamily::V4, false, &[]);
        let ext = r.chains.iter().find(|(k, _)| k.starts_with("KUBE-EXT-")).map(|(_, v)| v).expect("an ext chain without local endpoints");
        assert_eq!(ext.len(), 2, "{ext:?}");
        assert!(ext[0].ends_with("-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"), "{ext:?}");
        assert!(ext[1].contains("-m addrtype --src-type LOCAL -j KUBE-SVC-"), "{ext:?}");
        assert!(r.nat_nodeports.iter().any(|n| n.contains("--dport 30080 -j KUBE-EXT-")), "{:?}", r.nat_nodeports);
        assert!(r.filter_external.iter().any(|f| f.contains("--dst-type LOCAL -p tcp -m tcp --dport 30080 -j DROP")), "{:?}", r.filter_external);
        // With a local endpoint: no drop, and the ext chain ends in the local one.
        p.v4.local = vec![p.v4.cluster[0].clone()];
        let r = render_port(&p, IpFamily::V4, false, &[]);
        assert!(r.filter_external.is_empty());
        let ext = r.chains.iter().find(|(k, _)| k.starts_with("KUBE-EXT-")).map(|(_, v)| v).expect("ext chain");
        assert!(ext.last().is_some_and(|l| l.contains("-j KUBE-SVL-")), "{ext:?}");
    }

    #[test]
    fn service_without_endpoints_is_rejected() {
        let r = render_port(&d(0), IpFamily::V4, false, &[]);
        assert!(r.nat_services.is_empty());
        assert_eq!(r.filter_services.len(), 1);
        assert!(r.filter_services[0].ends_with("-j REJECT"));
    }
}
