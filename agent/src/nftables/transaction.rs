//! One nft transaction (atomic: one `nft -f -` run or one nfnetlink batch): the typed
//! operations of a sync ([`super::ops`]), kept in the order the kernel needs — chains and
//! sets first, stale elements out, rules, new elements in, sets removed — and serialized
//! once, as nft text ([`Transaction::text`]) or as a netlink batch
//! ([`super::netlink::encode`] of [`Transaction::netlink_ops`]).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use super::adopt::Existing;
use super::ops::{Key, Op, Rule, SetKind, SetName, SetType, TableRef, Value};
use super::render::skeleton;
use crate::model::IpFamily;

/// Elements per `add element` / `delete element` command.
const ELEMENTS_PER_COMMAND: usize = 1000;

#[derive(Debug, Default)]
struct FamilyTx {
    /// Tables, chains, sets and maps (created, flushed or deleted) and the skeleton's rules.
    pre: Vec<Op>,
    /// `DeleteElement`s, by map or set.
    delete_elements: BTreeMap<SetName, Vec<Op>>,
    /// `AddRule`s.
    rules: Vec<Op>,
    /// `AddElement`s, by map or set.
    add_elements: BTreeMap<SetName, Vec<Op>>,
    /// Sets and maps deleted at the end.
    post: Vec<Op>,
}

impl FamilyTx {
    /// The operations in transaction order.
    fn ops(&self) -> impl Iterator<Item = &Op> {
        self.pre.iter().chain(self.delete_elements.values().flatten()).chain(&self.rules).chain(self.add_elements.values().flatten()).chain(&self.post)
    }
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

    /// Operations so far (a rebuild or an adoption of a family's table counts as one).
    pub fn ops(&self) -> usize {
        self.ops
    }

    pub fn is_empty(&self) -> bool {
        self.ops == 0
    }

    fn pre(&mut self, fam: IpFamily, op: Op) {
        self.fam(fam).pre.push(op);
    }

    /// Keep the family's table and what it holds (`existing`, as read from the kernel):
    /// create whatever of the skeleton is missing, flush every chain and every set and map
    /// but the ClientIP affinity sets (`aff-*`, whose entries are the affinity state), and
    /// write the skeleton's rules again. The rest of the transaction refills the table, so
    /// packets see the old ruleset until the commit and the new one after it.
    pub fn adopt_family(&mut self, fam: IpFamily, existing: &Existing) {
        let f = self.fam(fam);
        let (rules, definitions): (Vec<Op>, Vec<Op>) = skeleton(fam).into_iter().partition(|op| matches!(op, Op::AddRule { .. }));
        f.pre.extend(definitions);
        f.pre.extend(existing.chains.iter().map(|c| Op::FlushChain(c.clone())));
        f.pre.extend(existing.sets.iter().filter(|s| !s.starts_with("aff-")).map(|s| Op::FlushSet(SetKind::Set, s.clone())));
        f.pre.extend(existing.maps.iter().map(|m| Op::FlushSet(SetKind::Map, m.clone())));
        f.pre.extend(rules);
        self.ops += 1;
        self.nft_only += 1;
    }

    /// Drop the family's table (whatever it holds) and create the skeleton.
    pub fn rebuild_family(&mut self, fam: IpFamily) {
        let f = self.fam(fam);
        f.pre.push(Op::AddTable { comment: false });
        f.pre.push(Op::DeleteTable);
        f.pre.extend(skeleton(fam));
        self.ops += 1;
        self.nft_only += 1;
    }

    /// Remove the family's table (`add` first so that `delete` cannot fail on a missing one).
    pub fn delete_family(&mut self, fam: IpFamily) {
        self.pre(fam, Op::AddTable { comment: false });
        self.pre(fam, Op::DeleteTable);
        self.ops += 1;
        self.nft_only += 1;
    }

    /// Delete a map or set that is not the agent's (any more), at the end of the
    /// transaction, after the rules using it were flushed.
    pub fn delete_set(&mut self, fam: IpFamily, kind: SetKind, name: &str) {
        self.fam(fam).post.push(Op::DeleteSet(kind, name.to_string()));
        self.ops += 1;
        self.nft_only += 1;
    }

    pub fn add_chain(&mut self, fam: IpFamily, name: &str) {
        self.pre(fam, Op::AddChain { chain: name.to_string(), base: None });
        self.ops += 1;
    }

    pub fn flush_chain(&mut self, fam: IpFamily, name: &str) {
        self.pre(fam, Op::FlushChain(name.to_string()));
        self.ops += 1;
    }

    /// Delete a chain emptied (and unreferenced) in an earlier transaction.
    pub fn delete_chain(&mut self, fam: IpFamily, name: &str) {
        self.pre(fam, Op::DeleteChain(name.to_string()));
        self.ops += 1;
    }

    /// Create a map or set (a shard of the endpoint maps, an affinity set).
    pub fn add_set(&mut self, fam: IpFamily, name: &str, ty: SetType) {
        self.pre(fam, Op::AddSet { name: name.to_string(), ty });
        self.ops += 1;
        self.nft_only += 1;
    }

    pub fn add_rule(&mut self, fam: IpFamily, chain: &str, rule: Rule) {
        self.fam(fam).rules.push(Op::AddRule { chain: chain.to_string(), rule });
        self.ops += 1;
    }

    pub fn add_element(&mut self, fam: IpFamily, set: SetName, key: Key, value: Option<Value>) {
        self.fam(fam).add_elements.entry(set).or_default().push(Op::AddElement { set, key, value });
        self.ops += 1;
    }

    pub fn delete_element(&mut self, fam: IpFamily, set: SetName, key: Key) {
        self.fam(fam).delete_elements.entry(set).or_default().push(Op::DeleteElement { set, key });
        self.ops += 1;
    }

    /// Every operation, with its family, in transaction order.
    pub fn all_ops(&self) -> impl Iterator<Item = (IpFamily, &Op)> {
        let v4 = self.v4.ops().map(|op| (IpFamily::V4, op));
        v4.chain(self.v6.ops().map(|op| (IpFamily::V6, op)))
    }

    /// The operations for a batch of our own ([`super::netlink`]), in transaction order,
    /// when it holds only chain, rule and element operations (no table, map or set
    /// created, flushed or deleted). Whether each rule can be encoded is up to the encoder.
    pub fn netlink_ops(&self) -> Option<Vec<(IpFamily, &Op)>> {
        if self.nft_only > 0 {
            return None;
        }
        let mut v = Vec::with_capacity(self.ops);
        v.extend(self.all_ops());
        Some(v)
    }

    /// The `nft -f` input: one command per operation, but consecutive element operations
    /// on one map or set share a command (up to [`ELEMENTS_PER_COMMAND`]).
    pub fn text(&self) -> String {
        let mut s = String::new();
        for (fam, f) in [(IpFamily::V4, &self.v4), (IpFamily::V6, &self.v6)] {
            let t = TableRef(fam);
            for op in &f.pre {
                op.write_text(fam, &mut s);
            }
            write_element_commands(&mut s, t, &f.delete_elements);
            for op in &f.rules {
                op.write_text(fam, &mut s);
            }
            write_element_commands(&mut s, t, &f.add_elements);
            for op in &f.post {
                op.write_text(fam, &mut s);
            }
        }
        s
    }
}

/// `add element` / `delete element` commands for the element operations of each map or set,
/// up to [`ELEMENTS_PER_COMMAND`] per command.
fn write_element_commands(s: &mut String, t: TableRef, by_set: &BTreeMap<SetName, Vec<Op>>) {
    use std::fmt::Write as _;
    for (set, ops) in by_set {
        for chunk in ops.chunks(ELEMENTS_PER_COMMAND) {
            let verb = if matches!(chunk[0], Op::DeleteElement { .. }) { "delete" } else { "add" };
            let _ = write!(s, "{verb} element {t} {set} {{ ");
            for (i, op) in chunk.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                let _ = match op {
                    Op::AddElement { key, value: Some(v), .. } => write!(s, "{key} : {v}"),
                    Op::AddElement { key, value: None, .. } | Op::DeleteElement { key, .. } => write!(s, "{key}"),
                    _ => Ok(()),
                };
            }
            s.push_str(" }\n");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;
    use crate::nftables::ops::{Expr, Verdict};
    use std::net::IpAddr;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn vip_key(a: &str) -> Key {
        Key::AddrProtoPort(ip(a), Protocol::Tcp, 80)
    }

    fn goto(c: &str) -> Option<Value> {
        Some(Value::Verdict(Verdict::Goto(c.into())))
    }

    fn dnat_rule() -> Rule {
        Rule::new([Expr::L4Proto(Protocol::Tcp), Expr::DnatTo(ip("198.18.2.1"), 80)])
    }

    #[test]
    fn order_is_chains_deletes_rules_adds_sets() {
        let mut tx = Transaction::new();
        tx.add_element(IpFamily::V4, SetName::Named("service-ips"), vip_key("198.19.0.1"), goto("svc-a"));
        tx.add_rule(IpFamily::V4, "svc-a", dnat_rule());
        tx.delete_set(IpFamily::V4, SetKind::Set, "aff-x");
        tx.delete_element(IpFamily::V4, SetName::Named("service-ips"), vip_key("198.19.0.2"));
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
        tx.add_element(IpFamily::V4, SetName::Named("service-ips"), vip_key("198.19.0.1"), goto("svc-a"));
        tx.add_rule(IpFamily::V4, "svc-a", dnat_rule());
        tx.delete_element(IpFamily::V4, SetName::Named("service-ips"), vip_key("198.19.0.2"));
        tx.add_chain(IpFamily::V4, "svc-a");
        let ops = tx.netlink_ops().expect("chains, rules and elements only");
        let kinds: Vec<&str> = ops
            .iter()
            .map(|(_, o)| match o {
                Op::AddChain { .. } => "add chain",
                Op::FlushChain(_) => "flush chain",
                Op::DeleteChain(_) => "delete chain",
                Op::AddRule { .. } => "add rule",
                Op::DeleteElement { .. } => "delete element",
                Op::AddElement { .. } => "add element",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, vec!["add chain", "delete element", "add rule", "add element"], "same order as the text");
        tx.add_set(IpFamily::V4, &SetName::EndpointChains(0).to_string(), SetType::SlotToVerdict);
        assert!(tx.netlink_ops().is_none(), "creating a map needs nft");
    }

    #[test]
    fn element_only_transactions_list_their_operations_deletes_first() {
        let mut tx = Transaction::new();
        tx.add_element(IpFamily::V6, SetName::Named("service-ips"), vip_key("fd00::1"), goto("svc-a"));
        tx.add_element(IpFamily::V4, SetName::Named("hairpin"), Key::AddrPair(ip("198.18.2.1"), ip("198.18.2.1")), None);
        tx.delete_element(IpFamily::V4, SetName::Named("hairpin"), Key::AddrPair(ip("198.18.2.2"), ip("198.18.2.2")));
        let ops = tx.netlink_ops().expect("element-only");
        let summary: Vec<(IpFamily, bool, String)> = ops
            .iter()
            .filter_map(|(family, o)| match o {
                Op::DeleteElement { key, .. } => Some((*family, true, key.to_string())),
                Op::AddElement { key, .. } => Some((*family, false, key.to_string())),
                _ => None,
            })
            .collect();
        let e = |f, d, k: &str| (f, d, k.to_string());
        assert_eq!(
            summary,
            vec![
                e(IpFamily::V4, true, "198.18.2.2 . 198.18.2.2"),
                e(IpFamily::V4, false, "198.18.2.1 . 198.18.2.1"),
                e(IpFamily::V6, false, "fd00::1 . tcp . 80"),
            ]
        );
        assert!(matches!(ops[2].1, Op::AddElement { value: Some(v), .. } if v.to_string() == "goto svc-a"));
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
        for i in 0..2500u16 {
            let a: IpAddr = std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i).into();
            tx.add_element(IpFamily::V6, SetName::Named("hairpin"), Key::AddrPair(a, a), None);
        }
        let text = tx.text();
        assert_eq!(text.lines().filter(|l| l.starts_with("add element ip6 clusterip hairpin")).count(), 3);
    }

    #[test]
    fn text_is_one_command_per_operation_elements_grouped() {
        let mut tx = Transaction::new();
        tx.delete_element(IpFamily::V4, SetName::EndpointDnat(Protocol::Tcp, 0), Key::Slot(1));
        tx.delete_element(IpFamily::V4, SetName::EndpointDnat(Protocol::Tcp, 0), Key::Slot(2));
        tx.add_element(IpFamily::V4, SetName::EndpointDnat(Protocol::Tcp, 0), Key::Slot(1), Some(Value::AddrPort(ip("198.18.2.3"), 8080)));
        tx.add_element(IpFamily::V4, SetName::EndpointDnat(Protocol::Tcp, 0), Key::Slot(2), Some(Value::AddrPort(ip("198.18.2.4"), 8080)));
        tx.flush_chain(IpFamily::V4, "svc-a");
        tx.add_rule(IpFamily::V4, "svc-a", Rule::verdict(Verdict::Goto("svc-b".into())));
        assert_eq!(
            tx.text(),
            "flush chain ip clusterip svc-a\n\
             delete element ip clusterip endpoint-dnat-tcp-0 { 1, 2 }\n\
             add rule ip clusterip svc-a goto svc-b\n\
             add element ip clusterip endpoint-dnat-tcp-0 { 1 : 198.18.2.3 . 8080, 2 : 198.18.2.4 . 8080 }\n"
        );
    }
}
