//! Fuzz harnesses of the agent: one function per target, taking the fuzzer's bytes. The
//! fuzz crate (`tests/fuzz/`, cargo-fuzz) and the corpus replay test
//! (`agent/tests/fuzz_corpora.rs`) call the same functions.
//!
//! A function returns false early on input the code under test refuses, true once the
//! invariants were checked, and panics when an invariant is broken (or the code under test panics). Targets:
//! - [`ruleset`]: Services and EndpointSlices → the desired ruleset (model + render):
//!   never panics, deterministic, and a second sync of the same state does nothing.
//! - [`nft`]: the same input, and `nft`'s own parser (and the kernel, through `nft -c`) must
//!   accept the rendered full sync followed by the delta sync, in a network namespace of
//!   its own.
//! - [`netlink_encode`]: operations written as text, read into typed operations →
//!   [`netlink::encode`] never panics, and whatever it accepts, `nft -c` accepts written as
//!   nft text (so the encoder never sends the kernel something nft would refuse).
//!
//! `nft` runs as `unshare --net -- nft -c -f -` (a new, empty network namespace per run;
//! `-c` commits nothing) — never in the namespace the agent or the test runs in — unless
//! `CLUSTERIP_FUZZ_OWN_NETNS=1` says the whole process already runs in a namespace of its
//! own (`scripts/fuzz.sh` starts the fuzzer under `unshare --net`). `CLUSTERIP_FUZZ_NFT=0`
//! skips the `nft` checks (machines without nft or without the right to unshare).

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::io::Write as _;
use std::process::{Command, Stdio};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::model::state::{NodeInfo, ProxyState};
use crate::model::{IpFamily, NamespacedName, Protocol};
use crate::nftables::mirror::FamilyMirror;
use crate::nftables::netlink;
use crate::nftables::ops::{Expr, Key, Rule, SetName, Value, Verdict};
use crate::nftables::render::{RenderOptions, SERVICE_IPS, SERVICE_NODEPORTS, SHARED_SETS};
use crate::nftables::transaction::Transaction;

/// The targets, by the names `scripts/fuzz.sh` and the corpus folders use.
pub const TARGETS: &[&str] = &["ruleset", "nft", "netlink_encode"];

/// Runs the target `name` on `data`: Some(whether the input got past the code's refusals to
/// the invariant checks), None for an unknown target.
pub fn run(name: &str, data: &[u8]) -> Option<bool> {
    Some(match name {
        "ruleset" => ruleset(data),
        "nft" => nft(data),
        "netlink_encode" => netlink_encode(data),
        _ => return None,
    })
}

const NODE: &str = "node-a";
const ZONE: &str = "zone-a";

fn options() -> RenderOptions {
    let cidrs = ["198.18.0.0/16", "fd00:2::/64"].iter().filter_map(|c| c.parse().ok()).collect();
    RenderOptions { masquerade_all: false, cluster_cidrs: cidrs }
}

/// The input of the ruleset targets: a JSON array of Services and EndpointSlices (by
/// `kind`; other items are ignored). The last object is the "change" of the delta sync.
fn objects(data: &[u8]) -> Option<Vec<Object>> {
    let items: Vec<serde_json::Value> = serde_json::from_slice(data).ok()?;
    let objs = items
        .into_iter()
        .filter_map(|v| match v.get("kind").and_then(|k| k.as_str()) {
            Some("Service") => serde_json::from_value(v).ok().map(Object::Service),
            Some("EndpointSlice") => serde_json::from_value(v).ok().map(Object::Slice),
            _ => None,
        })
        .collect();
    Some(objs)
}

enum Object {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
}

impl Object {
    fn apply(&self, state: &mut ProxyState) {
        match self {
            Object::Service(s) => state.apply_service(s),
            Object::Slice(s) => state.apply_slice(s),
        };
    }
}

fn state_of(objs: &[Object]) -> ProxyState {
    let mut state = ProxyState::new(NodeInfo { name: NODE.into(), zone: Some(ZONE.into()) }, None);
    for o in objs {
        o.apply(&mut state);
    }
    state
}

fn new_mirrors() -> [FamilyMirror; 2] {
    [FamilyMirror::new(IpFamily::V4), FamilyMirror::new(IpFamily::V6)]
}

/// Sync `names` (sorted) from `state` into `mirrors`; `rebuild` starts from an empty table,
/// as the agent's first sync does. None when the endpoint slots ran out (a clean error).
fn sync(state: &ProxyState, names: &BTreeSet<NamespacedName>, mirrors: &mut [FamilyMirror; 2], rebuild: bool) -> Option<Transaction> {
    let opts = options();
    let mut tx = Transaction::new();
    for m in mirrors.iter_mut() {
        if rebuild {
            m.reset();
            tx.rebuild_family(m.family);
        } else {
            m.take_stale_chains(&mut tx);
        }
    }
    for nsn in names {
        let ports = state.desired(nsn);
        for m in mirrors.iter_mut() {
            m.sync_service(nsn, &ports, &opts, &mut tx).ok()?;
        }
    }
    Some(tx)
}

fn all_names(state: &ProxyState) -> BTreeSet<NamespacedName> {
    state.service_names().into_iter().collect()
}

/// The rendered transactions of an input: the full sync of every object but the last, then
/// the delta sync that the last object causes.
struct Rendered {
    full: Transaction,
    delta: Transaction,
    mirrors: [FamilyMirror; 2],
    state: ProxyState,
}

fn render(objs: &[Object]) -> Option<Rendered> {
    let (last, before) = objs.split_last()?;
    let mut state = state_of(before);
    let mut mirrors = new_mirrors();
    let full = sync(&state, &all_names(&state), &mut mirrors, true)?;
    let _ = state.take_changes();
    last.apply(&mut state);
    let changed: BTreeSet<NamespacedName> = state.take_changes().services.into_iter().collect();
    let delta = sync(&state, &changed, &mut mirrors, false)?;
    Some(Rendered { full, delta, mirrors, state })
}

/// Services and EndpointSlices → desired ruleset. Checks: nothing panics; the same input
/// renders the same text (twice, from fresh state); syncing the same state again adds no
/// operation; the delta's netlink encoding (when it has one) does not panic.
pub fn ruleset(data: &[u8]) -> bool {
    let Some(objs) = objects(data) else { return false };
    let Some(mut a) = render(&objs) else { return false };
    let Some(b) = render(&objs) else { panic!("the same input rendered once and failed the second time") };
    assert_eq!(a.full.text(), b.full.text(), "full sync text is not deterministic");
    assert_eq!(a.delta.text(), b.delta.text(), "delta sync text is not deterministic");
    if let Some(ops) = a.delta.netlink_ops() {
        let _ = netlink::encode(&ops);
    }
    // Nothing changed since: the next sync only deletes the chains the last one emptied
    // (by design one sync later: see FamilyMirror::replace), the one after does nothing.
    let names = all_names(&a.state);
    if let Some(next) = sync(&a.state, &names, &mut a.mirrors, false) {
        let text = next.text();
        assert!(text.lines().all(|l| l.starts_with("delete chain ")), "a sync with nothing changed wrote:\n{text}");
    }
    if let Some(again) = sync(&a.state, &names, &mut a.mirrors, false) {
        assert!(again.is_empty(), "a second sync with nothing changed wrote:\n{}", again.text());
    }
    true
}

/// The rendered full and delta sync through `nft -c`: the kernel's and nft's parse must
/// accept what the agent writes; and the delta, when the netlink encoder takes it, too.
pub fn nft(data: &[u8]) -> bool {
    let Some(objs) = objects(data) else { return false };
    let Some(r) = render(&objs) else { return false };
    let mut text = r.full.text();
    text.push_str(&r.delta.text());
    if let Err(e) = nft_check(&text) {
        panic!("nft refuses the rendered ruleset: {e}\n--- ruleset ---\n{text}");
    }
    true
}

/// Whether the `nft` checks run (see the module docs).
pub fn nft_enabled() -> bool {
    std::env::var("CLUSTERIP_FUZZ_NFT").map_or(true, |v| v != "0")
}

/// `nft -c -f -` on `text`, in a network namespace of its own. Ok when nft accepts it (or
/// the checks are off); Err with nft's words when it refuses.
pub fn nft_check(text: &str) -> Result<(), String> {
    if !nft_enabled() {
        return Ok(());
    }
    let own = std::env::var("CLUSTERIP_FUZZ_OWN_NETNS").is_ok_and(|v| v == "1");
    let mut cmd = if own {
        Command::new("nft")
    } else {
        let mut c = Command::new("unshare");
        c.args(["--net", "--", "nft"]);
        c
    };
    cmd.args(["-c", "-f", "-"]).stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("cannot start nft: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A write error shows as nft's failure below.
        let _ = stdin.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| format!("nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// One operation of the [`netlink_encode`] input, typed.
enum TextOp {
    Chain { family: IpFamily, kind: u8, chain: String },
    Rule { family: IpFamily, chain: String, rule: Rule },
    Element { family: IpFamily, set: SetName, key: Key, value: Option<Value>, delete: bool },
}

fn set_name(s: &str) -> Option<SetName> {
    if let Some(n) = SHARED_SETS.iter().find(|n| **n == s) {
        return Some(SetName::Named(n));
    }
    if let Some(k) = s.strip_prefix("endpoint-chains-") {
        return k.parse().ok().map(SetName::EndpointChains);
    }
    let rest = s.strip_prefix("endpoint-dnat-")?;
    let (p, k) = rest.split_once('-')?;
    Some(SetName::EndpointDnat(protocol(p)?, k.parse().ok()?))
}

fn protocol(p: &str) -> Option<Protocol> {
    match p {
        "tcp" => Some(Protocol::Tcp),
        "udp" => Some(Protocol::Udp),
        "sctp" => Some(Protocol::Sctp),
        _ => None,
    }
}

/// `drop`, `accept`, `return`, `jump C`, `goto C`.
fn verdict(text: &str) -> Option<Verdict> {
    let mut it = text.split_whitespace();
    let v = match (it.next(), it.next()) {
        (Some("drop"), None) => Verdict::Drop,
        (Some("accept"), None) => Verdict::Accept,
        (Some("return"), None) => Verdict::Return,
        (Some("goto"), Some(c)) => Verdict::Goto(c.to_string()),
        (Some("jump"), Some(c)) => Verdict::Jump(c.to_string()),
        _ => return None,
    };
    it.next().is_none().then_some(v)
}

/// A key of `set` written `a . b . c` (the fields its type has).
fn key(set: SetName, text: &str) -> Option<Key> {
    use crate::nftables::render::{FIREWALL_IPS, HAIRPIN, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES};
    let f: Vec<&str> = text.split(" . ").map(str::trim).collect();
    Some(match (set, f.as_slice()) {
        (SetName::Named(SERVICE_IPS | NO_ENDPOINT_SERVICES | FIREWALL_IPS), [a, p, n]) => {
            Key::AddrProtoPort(a.parse().ok()?, protocol(p)?, n.parse().ok()?)
        }
        (SetName::Named(SERVICE_NODEPORTS | NO_ENDPOINT_NODEPORTS), [p, n]) => Key::ProtoPort(protocol(p)?, n.parse().ok()?),
        (SetName::Named(HAIRPIN), [a, b]) => Key::AddrPair(a.parse().ok()?, b.parse().ok()?),
        (SetName::EndpointDnat(..) | SetName::EndpointChains(_), [slot]) => Key::Slot(slot.parse().ok()?),
        _ => return None,
    })
}

/// A map value: `ADDR . PORT` for the endpoint DNAT maps, else a verdict.
fn value(set: SetName, text: &str) -> Option<Value> {
    match set {
        SetName::EndpointDnat(..) => {
            let (a, p) = text.split_once(" . ")?;
            Some(Value::AddrPort(a.trim().parse().ok()?, p.trim().parse().ok()?))
        }
        _ => verdict(text).map(Value::Verdict),
    }
}

/// The rule shapes of a plain Service port chain (the ones the encoder writes):
/// `jump C`, `goto C`, `meta l4proto P dnat to numgen random mod N offset B map @M`,
/// `meta l4proto P dnat to ADDR:PORT`.
fn rule(text: &str) -> Option<Rule> {
    let w: Vec<&str> = text.split(' ').collect();
    Some(match w.as_slice() {
        ["jump", c] => Rule::verdict(Verdict::Jump(c.to_string())),
        ["goto", c] => Rule::verdict(Verdict::Goto(c.to_string())),
        ["meta", "l4proto", p, "dnat", "to", "numgen", "random", "mod", n, "offset", b, "map", m] => Rule::new([
            Expr::L4Proto(protocol(p)?),
            Expr::DnatNumgenMap { modulus: n.parse().ok()?, offset: b.parse().ok()?, map: set_name(m.strip_prefix('@')?)? },
        ]),
        ["meta", "l4proto", p, "dnat", "to", target] => {
            let sa: std::net::SocketAddr = target.parse().ok()?;
            Rule::new([Expr::L4Proto(protocol(p)?), Expr::DnatTo(sa.ip(), sa.port())])
        }
        _ => return None,
    })
}

/// Lines `FAMILY VERB ...`: `4 add-chain C`, `6 flush-chain C`, `4 delete-chain C`,
/// `4 rule C <rule text>`, `4 add SET KEY[ => VALUE]`, `6 delete SET KEY`. Other lines are
/// skipped; None when a rule, key or value does not read as a typed one (the encoder
/// cannot be given it).
fn text_ops(s: &str) -> Option<Vec<TextOp>> {
    let mut out = Vec::new();
    for line in s.lines() {
        let mut w = line.splitn(3, ' ');
        let family = match w.next() {
            Some("4") => IpFamily::V4,
            Some("6") => IpFamily::V6,
            _ => continue,
        };
        let (Some(verb), Some(rest)) = (w.next(), w.next()) else { continue };
        let op = match verb {
            "add-chain" => TextOp::Chain { family, kind: 0, chain: rest.into() },
            "flush-chain" => TextOp::Chain { family, kind: 1, chain: rest.into() },
            "delete-chain" => TextOp::Chain { family, kind: 2, chain: rest.into() },
            "rule" => match rest.split_once(' ') {
                Some((chain, r)) => TextOp::Rule { family, chain: chain.into(), rule: rule(r)? },
                None => continue,
            },
            "add" | "delete" => {
                let Some((set, elem)) = rest.split_once(' ') else { continue };
                let Some(set) = set_name(set) else { continue };
                let (k, v) = match elem.split_once(" => ") {
                    Some((k, v)) => (k, Some(v)),
                    None => (elem, None),
                };
                let key = key(set, k)?;
                let value = match v {
                    Some(v) => Some(value(set, v)?),
                    None => None,
                };
                TextOp::Element { family, set, key, value, delete: verb == "delete" }
            }
            _ => continue,
        };
        out.push(op);
    }
    Some(out)
}

/// The chain a verdict refers to.
fn verdict_chain(v: &Verdict) -> Option<&str> {
    match v {
        Verdict::Jump(c) | Verdict::Goto(c) => Some(c),
        _ => None,
    }
}

/// Operations as text → typed operations in a [`Transaction`] →
/// [`Transaction::netlink_ops`] → [`netlink::encode`], the path a sync takes. Checks:
/// nothing panics; whatever the encoder accepts, nft's parser accepts as the same
/// transaction written as nft text ([`Transaction::text`]), on a table holding the
/// skeleton, every chain named and every endpoint map used (what the mirror guarantees
/// before it writes such operations). A refusal by the kernel ("Could not process rule": a
/// missing element, a chain in use) is about the table's state, not about how the
/// operation was written, and is not counted against the encoder. Neither is a transaction
/// that names a chain it deleted before (deleted twice, flushed or referred to after its
/// delete): nft refuses that from its cache, and the mirror never writes one.
pub fn netlink_encode(data: &[u8]) -> bool {
    let Ok(s) = std::str::from_utf8(data) else { return false };
    let Some(ops) = text_ops(s) else { return false };
    if ops.is_empty() {
        return false;
    }
    let mut tx = Transaction::new();
    let mut chains: BTreeSet<(IpFamily, String)> = BTreeSet::new();
    let mut maps: BTreeSet<(IpFamily, SetName)> = BTreeSet::new();
    // Chains deleted so far in this transaction (and not added again).
    let mut deleted: BTreeSet<(IpFamily, String)> = BTreeSet::new();
    for o in ops {
        let named_after_delete = match &o {
            TextOp::Chain { family, kind: 0, chain } => {
                deleted.remove(&(*family, chain.clone()));
                false
            }
            TextOp::Chain { family, chain, .. } => deleted.contains(&(*family, chain.clone())),
            TextOp::Rule { family, chain, rule } => {
                deleted.contains(&(*family, chain.clone()))
                    || rule.0.iter().any(|e| matches!(e, Expr::Verdict(v) if verdict_chain(v).is_some_and(|c| deleted.contains(&(*family, c.to_string())))))
            }
            TextOp::Element { family, value: Some(Value::Verdict(v)), delete: false, .. } => verdict_chain(v).is_some_and(|c| deleted.contains(&(*family, c.to_string()))),
            TextOp::Element { .. } => false,
        };
        if named_after_delete {
            return false;
        }
        if let TextOp::Chain { family, kind: 2, chain } = &o {
            deleted.insert((*family, chain.clone()));
        }
        match o {
            TextOp::Chain { family, kind, chain } => match kind {
                0 => tx.add_chain(family, &chain),
                1 => {
                    tx.flush_chain(family, &chain);
                    chains.insert((family, chain));
                }
                _ => {
                    tx.delete_chain(family, &chain);
                    chains.insert((family, chain));
                }
            },
            TextOp::Rule { family, chain, rule } => {
                for e in &rule.0 {
                    match e {
                        Expr::Verdict(v) => chains.extend(verdict_chain(v).map(|c| (family, c.to_string()))),
                        Expr::DnatNumgenMap { map, .. } => {
                            maps.insert((family, *map));
                        }
                        _ => {}
                    }
                }
                tx.add_rule(family, &chain, rule);
                chains.insert((family, chain));
            }
            TextOp::Element { family, set, key, value, delete } => {
                maps.insert((family, set));
                // A delete names its element by key alone: a value written after it is not
                // part of the operation (nor a chain the table needs).
                if let (Some(Value::Verdict(v)), false) = (&value, delete) {
                    chains.extend(verdict_chain(v).map(|c| (family, c.to_string())));
                }
                if delete {
                    tx.delete_element(family, set, key);
                } else {
                    tx.add_element(family, set, key, value);
                }
            }
        }
    }
    let Some(nl_ops) = tx.netlink_ops() else { return false };
    let Ok(batch) = netlink::encode(&nl_ops) else { return false };
    assert!(!batch.is_empty(), "operations encoded as an empty batch");
    if !nft_enabled() {
        return true;
    }
    let mut pre = Transaction::new();
    for fam in IpFamily::ALL {
        pre.rebuild_family(fam);
    }
    for (fam, set) in &maps {
        if let Some(ty) = set.shard_definition(*fam) {
            pre.add_set(*fam, &set.to_string(), ty);
        }
    }
    for (fam, chain) in &chains {
        pre.add_chain(*fam, chain);
    }
    let mut text = pre.text();
    text.push_str(&tx.text());
    match nft_check(&text) {
        Ok(()) => {}
        Err(e) if e.contains("Could not process rule") => {}
        Err(e) => panic!("the netlink encoder took operations nft's parser refuses: {e}\n--- as nft text ---\n{text}"),
    }
    true
}
