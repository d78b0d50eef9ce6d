//! A fake kernel for unit tests: the two `clusterip` tables as an in-memory model that
//! [`Transaction`]s are applied to, op by op, with the kernel's refusals that matter to the
//! sync logic (a missing object, a chain or set still in use, a chain deleted while it has
//! rules, an element added over a different value). A transaction is atomic, as in the
//! kernel: a refused one changes nothing. What it applied is kept, typed, for the test to
//! look at. No root, no namespace, no `nft`.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use super::adopt::Existing;
use super::ops::{Expr, Key, Op, Rule, SetKind, SetName, SetType, Value, Verdict};
use super::transaction::Transaction;
use crate::model::IpFamily;

/// One map or set.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeSet {
    pub kind: SetKind,
    /// None for a set adopted from a listing (the type is not read back).
    pub ty: Option<SetType>,
    pub elements: BTreeMap<Key, Option<Value>>,
}

/// One family's table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FakeTable {
    pub chains: BTreeMap<String, Vec<Rule>>,
    pub sets: BTreeMap<String, FakeSet>,
}

impl FakeTable {
    /// Chains a verdict or a rule refers to.
    fn references_chain(&self, chain: &str) -> bool {
        let is = |v: &Verdict| matches!(v, Verdict::Jump(c) | Verdict::Goto(c) if c == chain);
        self.chains.values().flatten().any(|r| r.0.iter().any(|e| matches!(e, Expr::Verdict(v) if is(v))))
            || self.sets.values().flat_map(|s| s.elements.values()).any(|v| matches!(v, Some(Value::Verdict(v)) if is(v)))
    }

    /// Whether a rule uses the set or map `name`.
    fn references_set(&self, name: &str) -> bool {
        self.chains.values().flatten().any(|r| rule_sets(r).iter().any(|s| s == name))
    }

    /// The element of `set` at `key`, if any.
    pub fn element(&self, set: SetName, key: &Key) -> Option<&Option<Value>> {
        self.sets.get(&set.to_string()).and_then(|s| s.elements.get(key))
    }
}

/// Sets and maps a rule refers to.
fn rule_sets(r: &Rule) -> Vec<String> {
    r.0.iter()
        .filter_map(|e| match e {
            Expr::SaddrInSet(_, s) | Expr::UpdateSaddr(_, s) => Some(s.clone()),
            Expr::SaddrDaddrInSet(_, m) | Expr::VmapDaddrProtoPort(_, m) | Expr::VmapProtoPort(m) => Some(m.to_string()),
            Expr::NumgenVmap { map, .. } | Expr::DnatNumgenMap { map, .. } => Some(map.to_string()),
            _ => None,
        })
        .collect()
}

/// Chains a rule jumps or goes to.
fn rule_chains(r: &Rule) -> Vec<&str> {
    r.0.iter()
        .filter_map(|e| match e {
            Expr::Verdict(Verdict::Jump(c) | Verdict::Goto(c)) => Some(c.as_str()),
            _ => None,
        })
        .collect()
}

/// The fake kernel.
#[derive(Debug, Default)]
pub struct FakeKernel {
    v4: Option<FakeTable>,
    v6: Option<FakeTable>,
    /// Every transaction applied (the refused ones too), as typed operations.
    pub applied: Vec<Vec<(IpFamily, Op)>>,
}

/// A refused transaction: the operation and why.
#[derive(Debug, thiserror::Error)]
#[error("fake kernel refuses `{op}`: {why}")]
pub struct Refused {
    pub op: String,
    pub why: &'static str,
}

impl FakeKernel {
    pub fn new() -> Self {
        Self::default()
    }

    /// The family's table, if there is one.
    pub fn table(&self, fam: IpFamily) -> Option<&FakeTable> {
        match fam {
            IpFamily::V4 => self.v4.as_ref(),
            IpFamily::V6 => self.v6.as_ref(),
        }
    }

    /// What [`Existing::read`] would read from the kernel.
    pub fn existing(&self, fam: IpFamily) -> Existing {
        let mut e = Existing::default();
        if let Some(t) = self.table(fam) {
            e.chains = t.chains.keys().cloned().collect();
            for (name, s) in &t.sets {
                match s.kind {
                    SetKind::Set => e.sets.insert(name.clone()),
                    SetKind::Map => e.maps.insert(name.clone()),
                };
            }
        }
        e
    }

    /// The family's table as `nft -j list table` prints it (names, rules per chain, elements
    /// per map or set: what [`super::mirror::FamilyMirror::compare_listing`] reads).
    pub fn listing(&self, fam: IpFamily) -> Option<String> {
        let t = self.table(fam)?;
        let mut items = Vec::new();
        for (name, rules) in &t.chains {
            items.push(serde_json::json!({"chain": {"name": name}}));
            items.extend(rules.iter().map(|r| serde_json::json!({"rule": {"chain": name, "expr": r.to_string()}})));
        }
        for (name, s) in &t.sets {
            let elem: Vec<String> = s.elements.keys().map(Key::to_string).collect();
            items.push(serde_json::json!({s.kind.keyword(): {"name": name, "elem": elem}}));
        }
        Some(serde_json::json!({ "nftables": items }).to_string())
    }

    /// Change the table behind the agent's back (drift), for a test.
    pub fn tamper(&mut self, fam: IpFamily, f: impl FnOnce(&mut FakeTable)) {
        let t = match fam {
            IpFamily::V4 => &mut self.v4,
            IpFamily::V6 => &mut self.v6,
        };
        f(t.get_or_insert_with(FakeTable::default));
    }

    /// Apply the transaction, all or nothing.
    pub fn apply(&mut self, tx: &Transaction) -> Result<(), Refused> {
        self.applied.push(tx.all_ops().map(|(f, op)| (f, op.clone())).collect());
        let (mut v4, mut v6) = (self.v4.clone(), self.v6.clone());
        for (fam, op) in tx.all_ops() {
            let table = match fam {
                IpFamily::V4 => &mut v4,
                IpFamily::V6 => &mut v6,
            };
            apply_op(table, op).map_err(|why| {
                let mut text = String::new();
                op.write_text(fam, &mut text);
                Refused { op: text.trim_end().to_string(), why }
            })?;
        }
        (self.v4, self.v6) = (v4, v6);
        Ok(())
    }
}

fn apply_op(table: &mut Option<FakeTable>, op: &Op) -> Result<(), &'static str> {
    match op {
        Op::AddTable { .. } => {
            table.get_or_insert_with(FakeTable::default);
            return Ok(());
        }
        Op::DeleteTable => return table.take().map(|_| ()).ok_or("no such table"),
        _ => {}
    }
    let t = table.as_mut().ok_or("no such table")?;
    match op {
        Op::AddTable { .. } | Op::DeleteTable => unreachable!("handled above"),
        Op::AddChain { chain, .. } => {
            t.chains.entry(chain.clone()).or_default();
        }
        Op::FlushChain(c) => t.chains.get_mut(c).ok_or("no such chain")?.clear(),
        Op::DeleteChain(c) => {
            if !t.chains.get(c).ok_or("no such chain")?.is_empty() {
                return Err("chain has rules");
            }
            if t.references_chain(c) {
                return Err("chain is in use");
            }
            t.chains.remove(c);
        }
        Op::AddSet { name, ty } => {
            let kind = if ty.keyword() == "map" { SetKind::Map } else { SetKind::Set };
            match t.sets.get(name) {
                Some(s) if s.kind != kind || s.ty.is_some_and(|have| have != *ty) => return Err("exists with another type"),
                Some(_) => {}
                None => {
                    t.sets.insert(name.clone(), FakeSet { kind, ty: Some(*ty), elements: BTreeMap::new() });
                }
            }
        }
        Op::FlushSet(kind, name) => match t.sets.get_mut(name) {
            Some(s) if s.kind == *kind => s.elements.clear(),
            _ => return Err("no such set or map"),
        },
        Op::DeleteSet(kind, name) => {
            if !t.sets.get(name).is_some_and(|s| s.kind == *kind) {
                return Err("no such set or map");
            }
            if t.references_set(name) {
                return Err("set is in use");
            }
            t.sets.remove(name);
        }
        Op::AddRule { chain, rule } => {
            if !t.chains.contains_key(chain) {
                return Err("no such chain");
            }
            if rule_chains(rule).iter().any(|c| !t.chains.contains_key(*c)) {
                return Err("jump to a missing chain");
            }
            if rule_sets(rule).iter().any(|s| !t.sets.contains_key(s)) {
                return Err("lookup in a missing set");
            }
            t.chains.get_mut(chain).ok_or("no such chain")?.push(rule.clone());
        }
        Op::AddElement { set, key, value } => {
            if let Some(Value::Verdict(Verdict::Jump(c) | Verdict::Goto(c))) = value {
                if !t.chains.contains_key(c) {
                    return Err("verdict to a missing chain");
                }
            }
            let s = t.sets.get_mut(&set.to_string()).ok_or("no such set or map")?;
            match s.elements.get(key) {
                Some(v) if v != value => return Err("element exists with another value"),
                Some(_) => {}
                None => {
                    s.elements.insert(key.clone(), value.clone());
                }
            }
        }
        Op::DeleteElement { set, key } => {
            let s = t.sets.get_mut(&set.to_string()).ok_or("no such set or map")?;
            s.elements.remove(key).ok_or("no such element")?;
        }
    }
    Ok(())
}
