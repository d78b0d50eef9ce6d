//! One nft transaction (one `nft -f -` run, atomic), assembled in the order the kernel
//! needs: chains and sets first, stale elements out, rules, new elements in, sets removed.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::adopt::Existing;
use super::netlink::{ElementOp, Op};
use super::render::{skeleton, Family, SetName, TABLE};
use crate::model::IpFamily;

/// Elements per `add element` / `delete element` command.
const ELEMENTS_PER_COMMAND: usize = 1000;

#[derive(Debug, Default)]
struct FamilyTx {
    pre: String,
    delete_elements: BTreeMap<SetName, Vec<String>>,
    rules: String,
    /// (key, value) per map or set.
    add_elements: BTreeMap<SetName, Vec<(String, Option<String>)>>,
    post: String,
    /// The chain operations of `pre`, for a netlink batch.
    chain_ops: Vec<(ChainOp, String)>,
    /// The rules of `rules` as (chain, rule), for a netlink batch.
    rule_list: Vec<(String, String)>,
}

#[derive(Debug, Clone, Copy)]
enum ChainOp {
    Add,
    Flush,
    Delete,
}

/// A transaction over both families' tables.
#[derive(Debug, Default)]
pub struct Transaction {
    v4: FamilyTx,
    v6: FamilyTx,
    ops: usize,
    /// Operations [`super::netlink`] does not write (tables, maps, sets).
    nft_only: usize,
}

fn table(fam: IpFamily) -> String {
    format!("{} {TABLE}", Family(fam).nft())
}

impl Transaction {
    pub fn new() -> Self {
        Self::default()
    }

    fn fam(&mut self, fam: IpFamily) -> &mut FamilyTx {
        match fam {
            IpFamily::V4 => &mut self.v4,
            IpFamily::V6 => &mut self.v6,
        }
    }

    /// Operations so far.
    pub fn ops(&self) -> usize {
        self.ops
    }

    pub fn is_empty(&self) -> bool {
        self.ops == 0
    }

    /// Keep the family's table and what it holds (`existing`, as read from the kernel):
    /// create whatever of the skeleton is missing, flush every chain and every set and map
    /// but the ClientIP affinity sets (`aff-*`, whose entries are the affinity state), and
    /// write the skeleton's rules again. The rest of the transaction refills the table, so
    /// packets see the old ruleset until the commit and the new one after it.
    pub fn adopt_family(&mut self, fam: IpFamily, existing: &Existing) {
        let t = table(fam);
        let f = self.fam(fam);
        let (rules, definitions): (Vec<String>, Vec<String>) = skeleton(fam).into_iter().partition(|l| l.starts_with("add rule "));
        for line in definitions {
            let _ = writeln!(f.pre, "{line}");
        }
        for (kind, name) in existing.objects().filter(|(kind, name)| *kind != "set" || !name.starts_with("aff-")) {
            let _ = writeln!(f.pre, "flush {kind} {t} {name}");
        }
        for line in rules {
            let _ = writeln!(f.pre, "{line}");
        }
        self.ops += 1;
        self.nft_only += 1;
    }

    /// Delete a map or set that is not the agent's (any more), at the end of the
    /// transaction, after the rules using it were flushed.
    pub fn delete_map(&mut self, fam: IpFamily, name: &str) {
        let t = table(fam);
        let _ = writeln!(self.fam(fam).post, "delete map {t} {name}");
        self.ops += 1;
        self.nft_only += 1;
    }

    /// Drop the family's table (whatever it holds) and create the skeleton.
    pub fn rebuild_family(&mut self, fam: IpFamily) {
        let t = table(fam);
        let f = self.fam(fam);
        let _ = writeln!(f.pre, "add table {t}\ndelete table {t}");
        for line in skeleton(fam) {
            f.pre.push_str(&line);
            f.pre.push('\n');
        }
        self.ops += 1;
        self.nft_only += 1;
    }

    pub fn add_chain(&mut self, fam: IpFamily, name: &str) {
        let t = table(fam);
        let f = self.fam(fam);
        let _ = writeln!(f.pre, "add chain {t} {name}");
        f.chain_ops.push((ChainOp::Add, name.to_string()));
        self.ops += 1;
    }

    pub fn flush_chain(&mut self, fam: IpFamily, name: &str) {
        let t = table(fam);
        let f = self.fam(fam);
        let _ = writeln!(f.pre, "flush chain {t} {name}");
        f.chain_ops.push((ChainOp::Flush, name.to_string()));
        self.ops += 1;
    }

    /// Delete a chain emptied (and unreferenced) in an earlier transaction.
    pub fn delete_chain(&mut self, fam: IpFamily, name: &str) {
        let t = table(fam);
        let f = self.fam(fam);
        let _ = writeln!(f.pre, "delete chain {t} {name}");
        f.chain_ops.push((ChainOp::Delete, name.to_string()));
        self.ops += 1;
    }

    /// Create a map (a shard of the endpoint maps).
    pub fn add_map(&mut self, fam: IpFamily, name: SetName, body: &str) {
        let t = table(fam);
        let _ = writeln!(self.fam(fam).pre, "add map {t} {name} {{ {body} }}");
        self.ops += 1;
        self.nft_only += 1;
    }

    pub fn add_set(&mut self, fam: IpFamily, name: &str, body: &str) {
        let t = table(fam);
        let _ = writeln!(self.fam(fam).pre, "add set {t} {name} {{ {body} }}");
        self.ops += 1;
        self.nft_only += 1;
    }

    /// Delete a set at the end (after the rules using it were flushed).
    pub fn delete_set(&mut self, fam: IpFamily, name: &str) {
        let t = table(fam);
        let _ = writeln!(self.fam(fam).post, "delete set {t} {name}");
        self.ops += 1;
        self.nft_only += 1;
    }

    pub fn add_rule(&mut self, fam: IpFamily, chain: &str, rule: &str) {
        let t = table(fam);
        let f = self.fam(fam);
        let _ = writeln!(f.rules, "add rule {t} {chain} {rule}");
        f.rule_list.push((chain.to_string(), rule.to_string()));
        self.ops += 1;
    }

    pub fn add_element(&mut self, fam: IpFamily, set: SetName, key: &str, value: Option<&str>) {
        self.fam(fam).add_elements.entry(set).or_default().push((key.to_string(), value.map(str::to_string)));
        self.ops += 1;
    }

    pub fn delete_element(&mut self, fam: IpFamily, set: SetName, key: &str) {
        self.fam(fam).delete_elements.entry(set).or_default().push(key.to_string());
        self.ops += 1;
    }

    /// The transaction as operations for a batch of our own ([`super::netlink`]), in the
    /// order of [`Transaction::text`], when it holds only chain, rule and element
    /// operations (no table, map or set created or deleted). Whether each rule can be
    /// encoded is up to the encoder.
    pub fn netlink_ops(&self) -> Option<Vec<Op<'_>>> {
        if self.nft_only > 0 {
            return None;
        }
        let mut v = Vec::with_capacity(self.ops);
        for (family, f) in [(IpFamily::V4, &self.v4), (IpFamily::V6, &self.v6)] {
            for (op, chain) in &f.chain_ops {
                v.push(match op {
                    ChainOp::Add => Op::AddChain { family, chain },
                    ChainOp::Flush => Op::FlushChain { family, chain },
                    ChainOp::Delete => Op::DeleteChain { family, chain },
                });
            }
            for (set, keys) in &f.delete_elements {
                v.extend(keys.iter().map(|k| Op::Element(ElementOp { family, set: *set, key: k, value: None, delete: true })));
            }
            v.extend(f.rule_list.iter().map(|(chain, rule)| Op::AddRule { family, chain, rule }));
            for (set, elems) in &f.add_elements {
                v.extend(elems.iter().map(|(k, val)| Op::Element(ElementOp { family, set: *set, key: k, value: val.as_deref(), delete: false })));
            }
        }
        Some(v)
    }

    /// The `nft -f` input.
    pub fn text(&self) -> String {
        let mut s = String::new();
        for (fam, f) in [(IpFamily::V4, &self.v4), (IpFamily::V6, &self.v6)] {
            let t = table(fam);
            s.push_str(&f.pre);
            for (set, keys) in &f.delete_elements {
                for chunk in keys.chunks(ELEMENTS_PER_COMMAND) {
                    let _ = writeln!(s, "delete element {t} {set} {{ {} }}", chunk.join(", "));
                }
            }
            s.push_str(&f.rules);
            for (set, elems) in &f.add_elements {
                for chunk in elems.chunks(ELEMENTS_PER_COMMAND) {
                    let items: Vec<String> = chunk
                        .iter()
                        .map(|(k, v)| match v {
                            Some(v) => format!("{k} : {v}"),
                            None => k.clone(),
                        })
                        .collect();
                    let _ = writeln!(s, "add element {t} {set} {{ {} }}", items.join(", "));
                }
            }
            s.push_str(&f.post);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_chains_deletes_rules_adds_sets() {
        let mut tx = Transaction::new();
        tx.add_element(IpFamily::V4, SetName::Named("service-ips"), "198.19.0.1 . tcp . 80", Some("goto svc-a"));
        tx.add_rule(IpFamily::V4, "svc-a", "meta l4proto tcp dnat to 198.18.2.1:80");
        tx.delete_set(IpFamily::V4, "aff-x");
        tx.delete_element(IpFamily::V4, SetName::Named("service-ips"), "198.19.0.2 . tcp . 80");
        tx.add_chain(IpFamily::V4, "svc-a");
        let text = tx.text();
        let pos = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("{needle} missing from {text}"));
        assert!(pos("add chain") < pos("delete element"));
        assert!(pos("delete element") < pos("add rule"));
        assert!(pos("add rule") < pos("add element"));
        assert!(pos("add element") < pos("delete set"));
        assert_eq!(tx.ops(), 5);
        assert!(tx.netlink_ops().is_none(), "deleting a set needs nft");
    }

    #[test]
    fn chain_rule_and_element_transactions_can_be_netlink_batches_in_text_order() {
        let mut tx = Transaction::new();
        tx.add_element(IpFamily::V4, SetName::Named("service-ips"), "198.19.0.1 . tcp . 80", Some("goto svc-a"));
        tx.add_rule(IpFamily::V4, "svc-a", "meta l4proto tcp dnat to 198.18.2.1:80");
        tx.delete_element(IpFamily::V4, SetName::Named("service-ips"), "198.19.0.2 . tcp . 80");
        tx.add_chain(IpFamily::V4, "svc-a");
        let ops = tx.netlink_ops().expect("chains, rules and elements only");
        let kinds: Vec<&str> = ops
            .iter()
            .map(|o| match o {
                Op::AddChain { .. } => "add chain",
                Op::FlushChain { .. } => "flush chain",
                Op::DeleteChain { .. } => "delete chain",
                Op::AddRule { .. } => "add rule",
                Op::Element(e) if e.delete => "delete element",
                Op::Element(_) => "add element",
            })
            .collect();
        assert_eq!(kinds, vec!["add chain", "delete element", "add rule", "add element"], "same order as the text");
        tx.add_map(IpFamily::V4, SetName::EndpointChains(0), "typeof numgen random mod 1 : verdict;");
        assert!(tx.netlink_ops().is_none(), "creating a map needs nft");
    }

    #[test]
    fn element_only_transactions_list_their_operations_deletes_first() {
        let mut tx = Transaction::new();
        tx.add_element(IpFamily::V6, SetName::Named("service-ips"), "fd00::1 . tcp . 80", Some("goto svc-a"));
        tx.add_element(IpFamily::V4, SetName::Named("hairpin"), "198.18.2.1 . 198.18.2.1", None);
        tx.delete_element(IpFamily::V4, SetName::Named("hairpin"), "198.18.2.2 . 198.18.2.2");
        let ops = tx.netlink_ops().expect("element-only");
        let summary: Vec<(IpFamily, bool, &str)> = ops
            .iter()
            .filter_map(|o| match o {
                Op::Element(e) => Some((e.family, e.delete, e.key)),
                _ => None,
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (IpFamily::V4, true, "198.18.2.2 . 198.18.2.2"),
                (IpFamily::V4, false, "198.18.2.1 . 198.18.2.1"),
                (IpFamily::V6, false, "fd00::1 . tcp . 80"),
            ]
        );
        assert!(matches!(&ops[2], Op::Element(e) if e.value == Some("goto svc-a")));
    }

    #[test]
    fn adopting_keeps_the_table_flushes_all_but_affinity_sets_then_writes_the_skeleton_rules() {
        let existing = Existing {
            chains: ["nat-output".to_string(), "svc-ns/a/tcp/80".to_string()].into(),
            sets: ["hairpin".to_string(), "aff-30-ns/a/tcp/80__198.18.2.1/80".to_string()].into(),
            maps: ["service-ips".to_string(), "endpoint-dnat-tcp-0".to_string()].into(),
        };
        let mut tx = Transaction::new();
        tx.adopt_family(IpFamily::V4, &existing);
        let text = tx.text();
        assert!(!text.contains("delete table"), "the table stays: {text}");
        let pos = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("{needle} missing from {text}"));
        for flushed in ["flush chain ip clusterip svc-ns/a/tcp/80", "flush chain ip clusterip nat-output", "flush set ip clusterip hairpin", "flush map ip clusterip service-ips", "flush map ip clusterip endpoint-dnat-tcp-0"] {
            assert!(pos("add chain ip clusterip services") < pos(flushed), "definitions first: {text}");
            assert!(pos(flushed) < pos("add rule ip clusterip nat-output jump services"), "skeleton rules after the flushes: {text}");
        }
        assert!(!text.contains("flush set ip clusterip aff-"), "affinity entries are kept: {text}");
        assert!(tx.netlink_ops().is_none(), "an adopting rebuild goes through nft");
    }

    #[test]
    fn elements_are_batched_per_command() {
        let mut tx = Transaction::new();
        for i in 0..2500 {
            tx.add_element(IpFamily::V6, SetName::Named("hairpin"), &format!("fd00::{i:x} . fd00::{i:x}"), None);
        }
        let text = tx.text();
        assert_eq!(text.lines().filter(|l| l.starts_with("add element ip6 clusterip hairpin")).count(), 3);
    }
}
