//! Typed nftables operations: the vocabulary of a [`super::transaction::Transaction`].
//!
//! [`super::render`] builds these (rules as typed expressions, map elements as typed keys
//! and values); the transaction orders them; then they are serialized once, at the edge:
//! as nft text ([`Op::write_text`], for `nft -f`, logs and `CLUSTERIP_AGENT_DUMP_NFT`) or
//! as an nfnetlink batch ([`super::netlink::encode`]). Nothing is parsed back from text.
//! Every type here prints exactly as nft reads it (and as `nft` 1.0.6 lists it back).

#![forbid(unsafe_code)]

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::model::{IpFamily, Protocol};

/// Name of the agent's table in each family (`ip clusterip`, `ip6 clusterip`).
pub const TABLE: &str = "clusterip";
/// Mark bit asking `nat-postrouting` to masquerade (kube-proxy's 0x4000).
pub const MASQ_MARK: &str = "0x00004000";

/// Family-dependent spelling.
#[derive(Debug, Clone, Copy)]
pub struct Family(pub IpFamily);

impl Family {
    /// `ip` / `ip6`.
    pub fn nft(self) -> &'static str {
        match self.0 {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        }
    }
    /// `ipv4_addr` / `ipv6_addr`.
    pub fn addr_type(self) -> &'static str {
        match self.0 {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        }
    }
    fn of(ip: &IpAddr) -> Family {
        Family(IpFamily::of(ip))
    }
}

/// A map or set holding elements: a skeleton one, or a shard of the endpoint maps
/// (see [`super::slots`]), created on first use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SetName {
    Named(&'static str),
    /// `endpoint-dnat-<proto>-<shard>`: slot → endpoint address . port. One per protocol:
    /// nft (1.0.6 at least) rejects a rule using a `typeof … th dport` map read back from the
    /// kernel ("conflicting protocols"), so the data is typed with the protocol's port field.
    EndpointDnat(Protocol, u32),
    /// `endpoint-chains-<shard>`: slot → `goto` endpoint chain (ClientIP affinity).
    EndpointChains(u32),
}

impl fmt::Display for SetName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetName::Named(n) => f.write_str(n),
            SetName::EndpointDnat(p, k) => write!(f, "endpoint-dnat-{p}-{k}"),
            SetName::EndpointChains(k) => write!(f, "endpoint-chains-{k}"),
        }
    }
}

impl SetName {
    /// The definition of a shard map (None for skeleton sets).
    pub fn shard_definition(self, family: IpFamily) -> Option<SetType> {
        match self {
            SetName::Named(_) => None,
            SetName::EndpointDnat(p, _) => Some(SetType::SlotToAddrPort(family, p)),
            SetName::EndpointChains(_) => Some(SetType::SlotToVerdict),
        }
    }
}

/// The type of a map or set, as its definition body (inside `{ }`) spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetType {
    /// Map `type ADDR . inet_proto . inet_service : verdict;`
    AddrProtoPortVerdict(IpFamily),
    /// Map `type inet_proto . inet_service : verdict;`
    ProtoPortVerdict,
    /// Set `type ADDR . ADDR;`
    AddrPair(IpFamily),
    /// Map `typeof numgen random mod 1 : ip daddr . tcp dport;` (endpoint slots).
    SlotToAddrPort(IpFamily, Protocol),
    /// Map `typeof numgen random mod 1 : verdict;` (endpoint chain slots).
    SlotToVerdict,
    /// Set `type ADDR; flags dynamic,timeout; timeout Ns;` (ClientIP affinity).
    Affinity(IpFamily, u32),
}

impl SetType {
    /// `map` or `set`.
    pub fn keyword(self) -> &'static str {
        match self {
            SetType::AddrPair(_) | SetType::Affinity(..) => "set",
            _ => "map",
        }
    }
}

impl fmt::Display for SetType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SetType::AddrProtoPortVerdict(fam) => write!(f, "type {} . inet_proto . inet_service : verdict;", Family(fam).addr_type()),
            SetType::ProtoPortVerdict => f.write_str("type inet_proto . inet_service : verdict;"),
            SetType::AddrPair(fam) => {
                let at = Family(fam).addr_type();
                write!(f, "type {at} . {at};")
            }
            SetType::SlotToAddrPort(fam, p) => write!(f, "typeof numgen random mod 1 : {} daddr . {} dport;", Family(fam).nft(), p.keyword()),
            SetType::SlotToVerdict => f.write_str("typeof numgen random mod 1 : verdict;"),
            SetType::Affinity(fam, timeout) => write!(f, "type {}; flags dynamic,timeout; timeout {timeout}s;", Family(fam).addr_type()),
        }
    }
}

/// A verdict (a rule's last word, or a verdict map's value).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verdict {
    Drop,
    Accept,
    Return,
    Jump(String),
    Goto(String),
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Drop => f.write_str("drop"),
            Verdict::Accept => f.write_str("accept"),
            Verdict::Return => f.write_str("return"),
            Verdict::Jump(c) => write!(f, "jump {c}"),
            Verdict::Goto(c) => write!(f, "goto {c}"),
        }
    }
}

/// A map or set element key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// `ADDR . PROTO . PORT` (`service-ips`, `no-endpoint-services`, `firewall-ips`).
    AddrProtoPort(IpAddr, Protocol, u16),
    /// `PROTO . PORT` (`service-nodeports`, `no-endpoint-nodeports`).
    ProtoPort(Protocol, u16),
    /// `ADDR . ADDR` (`hairpin`).
    AddrPair(IpAddr, IpAddr),
    /// An endpoint slot (the shard maps).
    Slot(u32),
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::AddrProtoPort(a, p, n) => write!(f, "{a} . {p} . {n}"),
            Key::ProtoPort(p, n) => write!(f, "{p} . {n}"),
            Key::AddrPair(a, b) => write!(f, "{a} . {b}"),
            Key::Slot(n) => write!(f, "{n}"),
        }
    }
}

/// A map element value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Value {
    Verdict(Verdict),
    /// `ADDR . PORT` (the endpoint DNAT maps).
    AddrPort(IpAddr, u16),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Verdict(v) => write!(f, "{v}"),
            Value::AddrPort(a, p) => write!(f, "{a} . {p}"),
        }
    }
}

/// One expression of a rule, as the agent writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    /// `meta l4proto P`
    L4Proto(Protocol),
    /// `ip daddr A` (`ip6` for an IPv6 address)
    Daddr(IpAddr),
    /// `ip saddr A`
    Saddr(IpAddr),
    /// `P dport N`
    Dport(Protocol, u16),
    /// `ip saddr != { N, … }`
    SaddrNotIn(IpFamily, Vec<IpNet>),
    /// `ip saddr @S`
    SaddrInSet(IpFamily, String),
    /// `ip saddr . ip daddr @S`
    SaddrDaddrInSet(IpFamily, SetName),
    /// `ip daddr != 127.0.0.0/8` / `ip6 daddr != ::1`
    NotLoopback(IpFamily),
    /// `fib saddr type local`
    FibSaddrLocal,
    /// `fib daddr type local`
    FibDaddrLocal,
    /// `ct state new`
    CtStateNew,
    /// `ct status dnat`
    CtStatusDnat,
    /// `meta mark & MASQ == 0`
    MasqMarkUnset,
    /// `meta mark set meta mark | MASQ`
    MasqMarkSet,
    /// `meta mark set meta mark ^ MASQ`
    MasqMarkToggle,
    /// `update @S { ip saddr }`
    UpdateSaddr(IpFamily, String),
    /// `ip daddr . meta l4proto . th dport vmap @M`
    VmapDaddrProtoPort(IpFamily, SetName),
    /// `meta l4proto . th dport vmap @M`
    VmapProtoPort(SetName),
    /// `numgen random mod N offset B vmap @M`
    NumgenVmap { modulus: u32, offset: u32, map: SetName },
    /// `dnat to A:P` (`[A]:P` for IPv6)
    DnatTo(IpAddr, u16),
    /// `dnat to numgen random mod N offset B map @M`
    DnatNumgenMap { modulus: u32, offset: u32, map: SetName },
    /// `masquerade` / `masquerade fully-random`
    Masquerade { fully_random: bool },
    /// `reject` / `reject with tcp reset`
    Reject { tcp_reset: bool },
    Verdict(Verdict),
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::L4Proto(p) => write!(f, "meta l4proto {p}"),
            Expr::Daddr(a) => write!(f, "{} daddr {a}", Family::of(a).nft()),
            Expr::Saddr(a) => write!(f, "{} saddr {a}", Family::of(a).nft()),
            Expr::Dport(p, n) => write!(f, "{p} dport {n}"),
            Expr::SaddrNotIn(fam, nets) => {
                write!(f, "{} saddr != {{ ", Family(*fam).nft())?;
                for (i, n) in nets.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{n}")?;
                }
                f.write_str(" }")
            }
            Expr::SaddrInSet(fam, s) => write!(f, "{} saddr @{s}", Family(*fam).nft()),
            Expr::SaddrDaddrInSet(fam, s) => {
                let ip = Family(*fam).nft();
                write!(f, "{ip} saddr . {ip} daddr @{s}")
            }
            Expr::NotLoopback(IpFamily::V4) => f.write_str("ip daddr != 127.0.0.0/8"),
            Expr::NotLoopback(IpFamily::V6) => f.write_str("ip6 daddr != ::1"),
            Expr::FibSaddrLocal => f.write_str("fib saddr type local"),
            Expr::FibDaddrLocal => f.write_str("fib daddr type local"),
            Expr::CtStateNew => f.write_str("ct state new"),
            Expr::CtStatusDnat => f.write_str("ct status dnat"),
            Expr::MasqMarkUnset => write!(f, "meta mark & {MASQ_MARK} == 0"),
            Expr::MasqMarkSet => write!(f, "meta mark set meta mark | {MASQ_MARK}"),
            Expr::MasqMarkToggle => write!(f, "meta mark set meta mark ^ {MASQ_MARK}"),
            Expr::UpdateSaddr(fam, s) => write!(f, "update @{s} {{ {} saddr }}", Family(*fam).nft()),
            Expr::VmapDaddrProtoPort(fam, m) => write!(f, "{} daddr . meta l4proto . th dport vmap @{m}", Family(*fam).nft()),
            Expr::VmapProtoPort(m) => write!(f, "meta l4proto . th dport vmap @{m}"),
            Expr::NumgenVmap { modulus, offset, map } => write!(f, "numgen random mod {modulus} offset {offset} vmap @{map}"),
            Expr::DnatTo(IpAddr::V4(a), p) => write!(f, "dnat to {a}:{p}"),
            Expr::DnatTo(IpAddr::V6(a), p) => write!(f, "dnat to [{a}]:{p}"),
            Expr::DnatNumgenMap { modulus, offset, map } => write!(f, "dnat to numgen random mod {modulus} offset {offset} map @{map}"),
            Expr::Masquerade { fully_random: false } => f.write_str("masquerade"),
            Expr::Masquerade { fully_random: true } => f.write_str("masquerade fully-random"),
            Expr::Reject { tcp_reset: false } => f.write_str("reject"),
            Expr::Reject { tcp_reset: true } => f.write_str("reject with tcp reset"),
            Expr::Verdict(v) => write!(f, "{v}"),
        }
    }
}

/// A rule: its expressions in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule(pub Vec<Expr>);

impl Rule {
    pub fn new(exprs: impl Into<Vec<Expr>>) -> Self {
        Rule(exprs.into())
    }
    /// A rule that is only a verdict (`goto C`, `drop`).
    pub fn verdict(v: Verdict) -> Self {
        Rule(vec![Expr::Verdict(v)])
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// The definition of a base chain (hooked into the stack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseChain {
    /// `filter` or `nat`.
    pub kind: &'static str,
    pub hook: &'static str,
    pub priority: i32,
}

/// A set or a map, by keyword.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetKind {
    Set,
    Map,
}

impl SetKind {
    pub fn keyword(self) -> &'static str {
        match self {
            SetKind::Set => "set",
            SetKind::Map => "map",
        }
    }
}

/// One operation on a family's `clusterip` table (the family is the transaction's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `add table` (with the agent's comment, or plain).
    AddTable { comment: bool },
    DeleteTable,
    /// `add chain` (a base chain with its hook).
    AddChain { chain: String, base: Option<BaseChain> },
    FlushChain(String),
    DeleteChain(String),
    /// `add map` / `add set` with its definition.
    AddSet { name: String, ty: SetType },
    /// `flush set` / `flush map`.
    FlushSet(SetKind, String),
    /// `delete set` / `delete map`.
    DeleteSet(SetKind, String),
    AddRule { chain: String, rule: Rule },
    AddElement { set: SetName, key: Key, value: Option<Value> },
    DeleteElement { set: SetName, key: Key },
}

impl Op {
    /// Write the op as one nft command line (elements: one element per command; see
    /// [`super::transaction::Transaction::text`] for the batched form).
    pub fn write_text(&self, family: IpFamily, out: &mut String) {
        use std::fmt::Write as _;
        let t = TableRef(family);
        let _ = match self {
            Op::AddTable { comment: true } => writeln!(out, "add table {t} {{ comment \"rules for clusterip-agent\"; }}"),
            Op::AddTable { comment: false } => writeln!(out, "add table {t}"),
            Op::DeleteTable => writeln!(out, "delete table {t}"),
            Op::AddChain { chain, base: None } => writeln!(out, "add chain {t} {chain}"),
            Op::AddChain { chain, base: Some(b) } => {
                writeln!(out, "add chain {t} {chain} {{ type {} hook {} priority {}; policy accept; }}", b.kind, b.hook, b.priority)
            }
            Op::FlushChain(c) => writeln!(out, "flush chain {t} {c}"),
            Op::DeleteChain(c) => writeln!(out, "delete chain {t} {c}"),
            Op::AddSet { name, ty } => writeln!(out, "add {} {t} {name} {{ {ty} }}", ty.keyword()),
            Op::FlushSet(k, name) => writeln!(out, "flush {} {t} {name}", k.keyword()),
            Op::DeleteSet(k, name) => writeln!(out, "delete {} {t} {name}", k.keyword()),
            Op::AddRule { chain, rule } => writeln!(out, "add rule {t} {chain} {rule}"),
            Op::AddElement { set, key, value: Some(v) } => writeln!(out, "add element {t} {set} {{ {key} : {v} }}"),
            Op::AddElement { set, key, value: None } => writeln!(out, "add element {t} {set} {{ {key} }}"),
            Op::DeleteElement { set, key } => writeln!(out, "delete element {t} {set} {{ {key} }}"),
        };
    }
}

/// `ip clusterip` / `ip6 clusterip`.
#[derive(Debug, Clone, Copy)]
pub struct TableRef(pub IpFamily);

impl fmt::Display for TableRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {TABLE}", Family(self.0).nft())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn rules_print_as_nft_reads_them() {
        let r = Rule::new([
            Expr::Daddr(ip("198.19.0.10")),
            Expr::Dport(Protocol::Tcp, 80),
            Expr::SaddrNotIn(IpFamily::V4, vec!["198.18.2.0/24".parse().expect("net"), "198.18.3.0/24".parse().expect("net")]),
            Expr::Verdict(Verdict::Jump("mark-for-masquerade".into())),
        ]);
        assert_eq!(r.to_string(), "ip daddr 198.19.0.10 tcp dport 80 ip saddr != { 198.18.2.0/24, 198.18.3.0/24 } jump mark-for-masquerade");
        let r = Rule::new([Expr::L4Proto(Protocol::Udp), Expr::DnatTo(ip("fd00:2::1"), 5353)]);
        assert_eq!(r.to_string(), "meta l4proto udp dnat to [fd00:2::1]:5353");
        assert_eq!(Rule::new([Expr::UpdateSaddr(IpFamily::V6, "aff-x".into())]).to_string(), "update @aff-x { ip6 saddr }");
        assert_eq!(Rule::new([Expr::MasqMarkUnset, Expr::Verdict(Verdict::Return)]).to_string(), "meta mark & 0x00004000 == 0 return");
    }

    #[test]
    fn ops_print_one_command_each() {
        let mut s = String::new();
        Op::AddSet { name: "aff-x".into(), ty: SetType::Affinity(IpFamily::V4, 30) }.write_text(IpFamily::V4, &mut s);
        Op::AddChain { chain: "nat-output".into(), base: Some(BaseChain { kind: "nat", hook: "output", priority: -100 }) }.write_text(IpFamily::V6, &mut s);
        Op::AddElement { set: SetName::EndpointDnat(Protocol::Tcp, 2), key: Key::Slot(7), value: Some(Value::AddrPort(ip("198.18.2.1"), 8080)) }
            .write_text(IpFamily::V4, &mut s);
        Op::DeleteSet(SetKind::Map, "old".into()).write_text(IpFamily::V4, &mut s);
        assert_eq!(
            s,
            "add set ip clusterip aff-x { type ipv4_addr; flags dynamic,timeout; timeout 30s; }\n\
             add chain ip6 clusterip nat-output { type nat hook output priority -100; policy accept; }\n\
             add element ip clusterip endpoint-dnat-tcp-2 { 7 : 198.18.2.1 . 8080 }\n\
             delete map ip clusterip old\n"
        );
    }
}
