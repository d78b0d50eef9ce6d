//! The in-memory mirror of one family's table: what each Service port owns, who owns each
//! shared map/set element, chains waiting for deletion. Diffs against it produce the
//! operations of a sync; the table is never listed for that.

#![forbid(unsafe_code)]

use std::collections::{BTreeSet, HashMap, HashSet};

use super::adopt::Existing;
use super::ops::{Key, SetKind, SetName, Value};
use super::render::{render_port, skeleton_rules, Fragment, RenderOptions, BASE_CHAINS, SHARED_SETS, SKELETON_CHAINS};
use super::slots::{SlotAllocator, SlotsExhausted};
use super::transaction::Transaction;
use crate::model::state::DesiredPort;
use crate::model::{IpFamily, NamespacedName, ServicePortName};

#[derive(Debug)]
struct Entry {
    id: u32,
    frag: Fragment,
}

/// Owners of one shared element, first one wins (two Services claiming the same
/// VIP:port is a user error; the first keeps it, the next takes over when it goes).
type Owners = Vec<(u32, Option<Value>)>;

/// Mirror of `<family> clusterip`.
#[derive(Debug)]
pub struct FamilyMirror {
    pub family: IpFamily,
    fragments: HashMap<ServicePortName, Entry>,
    by_service: HashMap<NamespacedName, Vec<ServicePortName>>,
    next_id: u32,
    elements: HashMap<(SetName, Key), Owners>,
    stale_chains: BTreeSet<String>,
    slots: SlotAllocator,
    /// Shard maps created so far (never deleted: there are few of them).
    shard_maps: BTreeSet<SetName>,
    /// Chains and rules of all fragments, kept up to date by `replace` (a partial sync must
    /// not walk every fragment to report them).
    fragment_chains: usize,
    fragment_rules: usize,
}

impl FamilyMirror {
    pub fn new(family: IpFamily) -> Self {
        FamilyMirror {
            family,
            fragments: HashMap::new(),
            by_service: HashMap::new(),
            next_id: 0,
            elements: HashMap::new(),
            stale_chains: BTreeSet::new(),
            slots: SlotAllocator::default(),
            shard_maps: BTreeSet::new(),
            fragment_chains: 0,
            fragment_rules: 0,
        }
    }

    /// Forget everything (the table is being re-created).
    pub fn reset(&mut self) {
        *self = FamilyMirror::new(self.family);
    }

    /// Start from a table adopted from the kernel (the mirror was just reset): its shard
    /// maps exist already and are kept (flushed, refilled as needed).
    pub fn adopt_shard_maps(&mut self, existing: &Existing) {
        self.shard_maps.extend(existing.shard_maps());
    }

    /// After every Service was rendered into an adopting rebuild: what the adopted table
    /// holds that nothing wants any more goes. Chains (flushed by the rebuild) are deleted
    /// at the next sync, as any emptied chain; affinity sets and unknown sets and maps are
    /// deleted at the end of this transaction (their rules are flushed before).
    pub fn finish_adoption(&mut self, existing: &Existing, tx: &mut Transaction) {
        let mut wanted_chains: HashSet<&str> = BASE_CHAINS.iter().chain(SKELETON_CHAINS.iter()).copied().collect();
        let mut wanted_sets: HashSet<String> = SHARED_SETS.iter().map(|s| s.to_string()).collect();
        wanted_sets.extend(self.shard_maps.iter().map(|m| m.to_string()));
        for e in self.fragments.values() {
            wanted_chains.extend(e.frag.chains.keys().map(String::as_str));
            wanted_sets.extend(e.frag.sets.keys().cloned());
        }
        let stale: Vec<String> = existing.chains.iter().filter(|c| !wanted_chains.contains(c.as_str())).cloned().collect();
        for s in existing.sets.iter().filter(|s| !wanted_sets.contains(*s)) {
            tx.delete_set(self.family, SetKind::Set, s);
        }
        for m in existing.maps.iter().filter(|m| !wanted_sets.contains(*m)) {
            tx.delete_set(self.family, SetKind::Map, m);
        }
        self.stale_chains.extend(stale);
    }

    /// Whether emptied chains wait for deletion (by the next sync).
    pub fn has_stale_chains(&self) -> bool {
        !self.stale_chains.is_empty()
    }

    /// Delete the chains emptied by earlier syncs.
    pub fn take_stale_chains(&mut self, tx: &mut Transaction) {
        for c in std::mem::take(&mut self.stale_chains) {
            tx.delete_chain(self.family, &c);
        }
    }

    /// Services programmed that are not in `keep`.
    pub fn services_not_in(&self, keep: &HashSet<&NamespacedName>) -> Vec<NamespacedName> {
        self.by_service.keys().filter(|k| !keep.contains(k)).cloned().collect()
    }

    /// (chains, rules, shared elements) the agent owns in this table.
    pub fn counts(&self) -> (usize, usize, usize) {
        let chains = BASE_CHAINS.len() + SKELETON_CHAINS.len() + self.stale_chains.len() + self.fragment_chains;
        let rules = skeleton_rules(self.family).len() + self.fragment_rules;
        (chains, rules, self.elements.len())
    }

    /// Bring one Service's ports to `ports` (empty: the Service is gone).
    pub fn sync_service(
        &mut self,
        nsn: &NamespacedName,
        ports: &[DesiredPort],
        opts: &RenderOptions,
        tx: &mut Transaction,
    ) -> Result<(), SlotsExhausted> {
        let old_names = self.by_service.remove(nsn).unwrap_or_default();
        let mut new_names = Vec::new();
        for d in ports {
            let prev = self.fragments.get(&d.port.name).map(|e| &e.frag);
            let frag = render_port(d, self.family, opts, prev, &mut self.slots)?;
            if frag.is_empty() {
                continue;
            }
            self.replace(&d.port.name, frag, tx);
            new_names.push(d.port.name.clone());
        }
        for name in old_names.iter().filter(|n| !new_names.contains(n)) {
            self.replace(name, Fragment::default(), tx);
        }
        if !new_names.is_empty() {
            self.by_service.insert(nsn.clone(), new_names);
        }
        Ok(())
    }

    fn effective(&self, key: &(SetName, Key)) -> Option<Option<Value>> {
        self.elements.get(key).and_then(|o| o.first()).map(|(_, v)| v.clone())
    }

    fn replace(&mut self, name: &ServicePortName, new: Fragment, tx: &mut Transaction) {
        let fam = self.family;
        let (id, old) = match self.fragments.remove(name) {
            Some(e) => (e.id, e.frag),
            None => {
                self.next_id = self.next_id.wrapping_add(1);
                (self.next_id, Fragment::default())
            }
        };
        if old == new {
            if !new.is_empty() {
                self.fragments.insert(name.clone(), Entry { id, frag: new });
            }
            return;
        }
        let rule_count = |f: &Fragment| f.chains.values().map(Vec::len).sum::<usize>();
        self.fragment_chains = self.fragment_chains + new.chains.len() - old.chains.len();
        self.fragment_rules = self.fragment_rules + rule_count(&new) - rule_count(&old);
        for e in &new.elements {
            if let Some(ty) = e.set.shard_definition(fam) {
                if self.shard_maps.insert(e.set) {
                    tx.add_set(fam, &e.set.to_string(), ty);
                }
            }
        }
        for (set, ty) in &new.sets {
            if old.sets.get(set) != Some(ty) {
                tx.add_set(fam, set, *ty);
            }
        }
        for (chain, rules) in &new.chains {
            match old.chains.get(chain) {
                None => {
                    self.stale_chains.remove(chain);
                    tx.add_chain(fam, chain);
                }
                Some(r) if r != rules => tx.flush_chain(fam, chain),
                Some(_) => continue,
            }
            for r in rules {
                tx.add_rule(fam, chain, r.clone());
            }
        }
        for chain in old.chains.keys().filter(|c| !new.chains.contains_key(*c)) {
            // Deleted at the next sync: before kernel 6.2 a chain still referenced by a
            // map element deleted in the same transaction cannot be deleted.
            tx.flush_chain(fam, chain);
            self.stale_chains.insert(chain.clone());
        }
        // Shared elements, through their owners.
        let touched: BTreeSet<(SetName, Key)> = old.elements.iter().chain(&new.elements).map(|e| (e.set, e.key.clone())).collect();
        let before: Vec<Option<Option<Value>>> = touched.iter().map(|k| self.effective(k)).collect();
        for e in &old.elements {
            let k = (e.set, e.key.clone());
            if let Some(owners) = self.elements.get_mut(&k) {
                owners.retain(|(o, _)| *o != id);
                if owners.is_empty() {
                    self.elements.remove(&k);
                }
            }
        }
        for e in &new.elements {
            self.elements.entry((e.set, e.key.clone())).or_default().push((id, e.value.clone()));
        }
        for ((set, key), b) in touched.into_iter().zip(before) {
            let after = self.effective(&(set, key.clone()));
            if after == b {
                continue;
            }
            if b.is_some() {
                tx.delete_element(fam, set, key.clone());
            }
            if let Some(v) = after {
                tx.add_element(fam, set, key, v);
            }
        }
        for set in old.sets.keys().filter(|s| !new.sets.contains_key(*s)) {
            tx.delete_set(fam, SetKind::Set, set);
        }
        for (chain, r) in &old.slots {
            if new.slots.get(chain) != Some(r) {
                self.slots.release(*r);
            }
        }
        if !new.is_empty() {
            self.fragments.insert(name.clone(), Entry { id, frag: new });
        }
    }

    /// Compare `nft -j list table` output with the mirror; the differences, if any.
    pub fn compare_listing(&self, json: &str) -> Result<Vec<String>, String> {
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("nft -j output: {e}"))?;
        let items = v.get("nftables").and_then(|x| x.as_array()).ok_or("nft -j output without \"nftables\"")?;
        let mut chains: HashMap<String, usize> = HashMap::new();
        let mut sets: HashMap<String, usize> = HashMap::new();
        for item in items {
            if let Some(c) = item.get("chain") {
                if let Some(n) = c.get("name").and_then(|n| n.as_str()) {
                    chains.entry(n.to_string()).or_insert(0);
                }
            } else if let Some(r) = item.get("rule") {
                if let Some(n) = r.get("chain").and_then(|n| n.as_str()) {
                    *chains.entry(n.to_string()).or_insert(0) += 1;
                }
            } else if let Some(s) = item.get("map").or_else(|| item.get("set")) {
                if let Some(n) = s.get("name").and_then(|n| n.as_str()) {
                    let count = s.get("elem").and_then(|e| e.as_array()).map_or(0, Vec::len);
                    sets.insert(n.to_string(), count);
                }
            }
        }
        let mut want: HashMap<&str, usize> = HashMap::new();
        for c in BASE_CHAINS.iter().chain(SKELETON_CHAINS.iter()) {
            want.insert(c, 0);
        }
        for (c, _) in skeleton_rules(self.family) {
            *want.entry(c).or_insert(0) += 1;
        }
        for c in &self.stale_chains {
            want.insert(c, 0);
        }
        for e in self.fragments.values() {
            for (c, rules) in &e.frag.chains {
                want.insert(c, rules.len());
            }
        }
        let mut diffs = Vec::new();
        for (c, n) in &want {
            match chains.get(*c) {
                None => diffs.push(format!("chain {c} missing")),
                Some(have) if have != n => diffs.push(format!("chain {c} has {have} rules, expected {n}")),
                _ => {}
            }
        }
        for c in chains.keys().filter(|c| !want.contains_key(c.as_str())) {
            diffs.push(format!("unexpected chain {c}"));
        }
        let mut want_elems: HashMap<String, usize> = SHARED_SETS.iter().map(|s| (s.to_string(), 0)).collect();
        for m in &self.shard_maps {
            want_elems.insert(m.to_string(), 0);
        }
        for (set, _) in self.elements.keys() {
            *want_elems.entry(set.to_string()).or_insert(0) += 1;
        }
        for (s, n) in &want_elems {
            match sets.get(s) {
                None => diffs.push(format!("map/set {s} missing")),
                Some(have) if have != n => diffs.push(format!("map/set {s} has {have} elements, expected {n}")),
                _ => {}
            }
        }
        for e in self.fragments.values() {
            for s in e.frag.sets.keys() {
                if !sets.contains_key(s) {
                    diffs.push(format!("affinity set {s} missing"));
                }
            }
        }
        diffs.sort();
        Ok(diffs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::service::ServicePort;
    use crate::model::topology::Categorized;
    use crate::model::{Endpoint, Protocol};
    use std::net::IpAddr;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn desired(name: &str, vip: &str, eps: &[&str]) -> DesiredPort {
        let sp = ServicePort::cluster_ip("ns", name, "", Protocol::Tcp, ip(vip), 80);
        let cluster: Vec<Endpoint> = eps
            .iter()
            .map(|e| Endpoint { is_local: true, ..Endpoint::ready(ip(e), 8080) })
            .collect();
        let has_any = !cluster.is_empty();
        DesiredPort { port: sp, v4: Categorized { cluster, local: vec![], has_any }, v6: Categorized::default() }
    }

    fn sync(m: &mut FamilyMirror, name: &str, ports: &[DesiredPort]) -> String {
        let mut tx = Transaction::new();
        m.sync_service(&NamespacedName::new("ns", name), ports, &RenderOptions::default(), &mut tx).expect("sync");
        tx.text()
    }

    #[test]
    fn unchanged_service_sends_nothing() {
        let mut m = FamilyMirror::new(IpFamily::V4);
        let d = desired("a", "198.19.0.1", &["198.18.2.1", "198.18.2.2"]);
        let first = sync(&mut m, "a", std::slice::from_ref(&d));
        assert!(first.contains("add chain ip clusterip svc-ns/a/tcp/80"));
        assert_eq!(sync(&mut m, "a", &[d]), "");
    }

    #[test]
    fn endpoint_removal_is_a_delta() {
        let mut m = FamilyMirror::new(IpFamily::V4);
        sync(&mut m, "a", &[desired("a", "198.19.0.1", &["198.18.2.1", "198.18.2.2", "198.18.2.3"])]);
        let t = sync(&mut m, "a", &[desired("a", "198.19.0.1", &["198.18.2.1", "198.18.2.3"])]);
        assert!(t.contains("flush chain ip clusterip svc-ns/a/tcp/80"));
        assert!(t.contains("add rule ip clusterip svc-ns/a/tcp/80 meta l4proto tcp dnat to numgen random mod 2 offset 0 map @endpoint-dnat-tcp-0"));
        // Slot 1 now points at .3, slot 2 is gone, the hairpin of .2 is gone.
        assert!(t.contains("delete element ip clusterip endpoint-dnat-tcp-0 { 1, 2 }"), "{t}");
        assert!(t.contains("add element ip clusterip endpoint-dnat-tcp-0 { 1 : 198.18.2.3 . 8080 }"), "{t}");
        assert!(t.contains("delete element ip clusterip hairpin { 198.18.2.2 . 198.18.2.2 }"), "{t}");
        assert!(!t.contains("service-ips"), "the VIP element is unchanged: {t}");
    }

    #[test]
    fn deleted_service_flushes_then_deletes_chain_next_time() {
        let mut m = FamilyMirror::new(IpFamily::V4);
        sync(&mut m, "a", &[desired("a", "198.19.0.1", &["198.18.2.1"])]);
        let t = sync(&mut m, "a", &[]);
        assert!(t.contains("flush chain ip clusterip svc-ns/a/tcp/80"));
        assert!(t.contains("delete element ip clusterip service-ips { 198.19.0.1 . tcp . 80 }"));
        assert!(!t.contains("delete chain"));
        let mut tx = Transaction::new();
        m.take_stale_chains(&mut tx);
        assert!(tx.text().contains("delete chain ip clusterip svc-ns/a/tcp/80"));
        assert_eq!(m.counts().2, 0, "no elements left");
    }

    #[test]
    fn counts_follow_changes() {
        let mut m = FamilyMirror::new(IpFamily::V4);
        let (c0, r0, _) = m.counts();
        sync(&mut m, "a", &[desired("a", "198.19.0.1", &["198.18.2.1", "198.18.2.2"])]);
        sync(&mut m, "b", &[desired("b", "198.19.0.2", &["198.18.2.1"])]);
        assert_eq!(m.counts(), (c0 + 2, r0 + 2, 2 + 2 + 2), "two chains of one rule; 2 VIPs, 2 slots, 2 hairpins");
        sync(&mut m, "a", &[]);
        let mut tx = Transaction::new();
        m.take_stale_chains(&mut tx);
        assert_eq!(m.counts(), (c0 + 1, r0 + 1, 2));
    }

    #[test]
    fn shared_hairpin_elements_are_refcounted() {
        let mut m = FamilyMirror::new(IpFamily::V4);
        sync(&mut m, "a", &[desired("a", "198.19.0.1", &["198.18.2.1"])]);
        let t = sync(&mut m, "b", &[desired("b", "198.19.0.2", &["198.18.2.1"])]);
        assert!(!t.contains("hairpin"), "already present: {t}");
        let t = sync(&mut m, "a", &[]);
        assert!(!t.contains("hairpin"), "still used by b: {t}");
        let t = sync(&mut m, "b", &[]);
        assert!(t.contains("delete element ip clusterip hairpin { 198.18.2.1 . 198.18.2.1 }"));
    }

    #[test]
    fn conflicting_vip_goes_to_first_owner_then_next() {
        let mut m = FamilyMirror::new(IpFamily::V4);
        sync(&mut m, "a", &[desired("a", "198.19.0.1", &["198.18.2.1"])]);
        let t = sync(&mut m, "b", &[desired("b", "198.19.0.1", &["198.18.2.2"])]);
        assert!(!t.contains("service-ips"), "a keeps the VIP: {t}");
        let t = sync(&mut m, "a", &[]);
        assert!(t.contains("delete element ip clusterip service-ips { 198.19.0.1 . tcp . 80 }"));
        assert!(t.contains("add element ip clusterip service-ips { 198.19.0.1 . tcp . 80 : goto svc-ns/b/tcp/80 }"), "{t}");
    }

    #[test]
    fn listing_comparison_detects_drift() {
        let mut m = FamilyMirror::new(IpFamily::V4);
        sync(&mut m, "a", &[desired("a", "198.19.0.1", &["198.18.2.1"])]);
        let listing = serde_json::json!({"nftables": [
            {"chain": {"name": "svc-ns/a/tcp/80"}},
            {"rule": {"chain": "svc-ns/a/tcp/80"}},
            {"chain": {"name": "extra"}},
            {"map": {"name": "service-ips", "elem": []}}
        ]});
        let diffs = m.compare_listing(&listing.to_string()).expect("compare");
        assert!(diffs.iter().any(|d| d == "unexpected chain extra"), "{diffs:?}");
        assert!(diffs.iter().any(|d| d == "map/set service-ips has 0 elements, expected 1"), "{diffs:?}");
        assert!(diffs.iter().any(|d| d == "chain services missing"), "{diffs:?}");
        assert!(!diffs.iter().any(|d| d.contains("svc-ns/a")), "{diffs:?}");
    }
}
