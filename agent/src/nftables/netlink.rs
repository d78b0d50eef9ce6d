//! Deltas written straight to the kernel as one nfnetlink batch, on a netlink socket kept
//! open across syncs.
//!
//! Why: a partial sync is usually small (an endpoint changed: slots of an endpoint map get
//! new values; or a Service port chain's one rule is replaced). Through `nft -f`, such a
//! transaction costs nft's cache fetch first
//! (`add element` and `add rule` dump every chain of every table: ~40 ms at 10k Services), and, when it
//! deletes anything, ~10 ms more when `nft` closes its netlink socket (the kernel's
//! `NETLINK_URELEASE` handler waits for the deferred release of the deleted objects, an RCU
//! grace period). A batch of our own needs neither: no cache (the mirror knows the table),
//! and the socket stays open. Measured on a 10k-Service table: see docs/agent.md.
//!
//! The input is the transaction's typed operations ([`super::ops`]): nothing is parsed
//! from text. Encoded here: element operations on the maps and sets whose types are fixed
//! by [`super::render`], `add`/`flush`/`delete chain`, and the rules of a plain Service
//! port chain (`meta l4proto P dnat to numgen random mod N offset B map @M`,
//! `meta l4proto P dnat to ADDR:PORT`, `jump C`, `goto C`) — so an endpoint change, a change
//! of endpoint count, and a Service added or removed without affinity or masquerade rules
//! need no `nft`. A transaction with anything else (tables, maps, sets, other rules) goes
//! through `nft -f` as a whole: a sync stays one atomic transaction either way. The kernel
//! test `netlink_batches_program_what_nft_would` (agent/tests/nftables_apply.rs) checks the
//! result against what `nft` writes for the same changes.

use std::net::IpAddr;
use std::os::fd::OwnedFd;

use crate::netlink::{self, Buf, NLMSG_ERROR, NLM_F_ACK, NLM_F_REQUEST};
use super::ops::{Expr, Key, Op, Rule, SetName, Value, Verdict, TABLE};
use super::render::{FIREWALL_IPS, HAIRPIN, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES, SERVICE_IPS, SERVICE_NODEPORTS};
use crate::model::{IpFamily, Protocol};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_DELRULE: u16 = 8;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;

const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;

const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFT_META_L4PROTO: u32 = 16;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFTA_NG_DREG: u16 = 1;
const NFTA_NG_MODULUS: u16 = 2;
const NFTA_NG_TYPE: u16 = 3;
const NFTA_NG_OFFSET: u16 = 4;
const NFT_NG_RANDOM: u32 = 1;
const NFTA_LOOKUP_SET: u16 = 1;
const NFTA_LOOKUP_SREG: u16 = 2;
const NFTA_LOOKUP_DREG: u16 = 3;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_NAT_TYPE: u16 = 1;
const NFTA_NAT_FAMILY: u16 = 2;
const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
const NFTA_NAT_FLAGS: u16 = 7;
const NFT_NAT_DNAT: u32 = 1;
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
/// Registers as nft numbers them: the verdict, 16-byte register 1 and 2, and the
/// 32-bit registers (`NFT_REG32_00` = 8) for fields inside a concatenation.
const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_REG_2: u32 = 2;
const NFT_REG32_00: u32 = 8;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_JUMP: i32 = -3;
const NFT_GOTO: i32 = -4;
const NFT_RETURN: i32 = -5;

/// Elements per netlink message (one message, one acknowledgement) at most; a message also
/// ends once its element list passes [`ELEMENT_LIST_BYTES`] (attribute lengths are 16-bit).
const ELEMENTS_PER_MESSAGE: usize = 256;
const ELEMENT_LIST_BYTES: usize = 32 << 10;

/// An operation that cannot be encoded (not a chain, rule or element operation; a rule
/// shape or map not encoded here; a name nft would read differently).
#[derive(Debug, thiserror::Error)]
#[error("cannot encode {key:?} of {set}: {why}")]
pub struct Unencodable {
    /// The map, set or chain.
    pub set: String,
    /// The element key or rule.
    pub key: String,
    pub why: &'static str,
}

/// Errors talking to the kernel.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("cannot enter the network namespace: {0}")]
    Netns(std::io::Error),
    #[error("nfnetlink batch rejected: {0}")]
    Rejected(std::io::Error),
    #[error("nfnetlink batch: {got} of {want} acknowledgements")]
    MissingAcks { got: usize, want: usize },
}

/// What a map or set holds, as typed in [`super::render`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Holds {
    /// `ADDR . PROTO . PORT : verdict`
    AddrProtoPortVerdict,
    /// `PROTO . PORT : verdict`
    ProtoPortVerdict,
    /// `ADDR . ADDR`
    AddrPair,
    /// slot `: ADDR . PORT`
    SlotAddrPort,
    /// slot `: verdict`
    SlotVerdict,
}

fn holds(set: SetName) -> Option<Holds> {
    Some(match set {
        SetName::Named(SERVICE_IPS | NO_ENDPOINT_SERVICES | FIREWALL_IPS) => Holds::AddrProtoPortVerdict,
        SetName::Named(SERVICE_NODEPORTS | NO_ENDPOINT_NODEPORTS) => Holds::ProtoPortVerdict,
        SetName::Named(HAIRPIN) => Holds::AddrPair,
        SetName::Named(_) => return None,
        SetName::EndpointDnat(..) => Holds::SlotAddrPort,
        SetName::EndpointChains(_) => Holds::SlotVerdict,
    })
}

fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

// Fields of a key or value, each padded to 4 bytes (nft's register layout for
// concatenations; a single field is its own size rounded up the same way).
fn put_addr(out: &mut Vec<u8>, a: &IpAddr, family: IpFamily) -> Result<(), &'static str> {
    match a {
        IpAddr::V4(a) if family == IpFamily::V4 => out.extend_from_slice(&a.octets()),
        IpAddr::V6(a) if family == IpFamily::V6 => out.extend_from_slice(&a.octets()),
        _ => return Err("address of the other family"),
    }
    Ok(())
}

fn put_proto(out: &mut Vec<u8>, p: Protocol) {
    out.extend_from_slice(&[proto_number(p), 0, 0, 0]);
}

fn put_port(out: &mut Vec<u8>, n: u16) {
    out.extend_from_slice(&n.to_be_bytes());
    out.extend_from_slice(&[0, 0]);
}

/// A key as the map of type `holds` stores it.
fn encode_key(holds: Holds, key: &Key, family: IpFamily) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::with_capacity(40);
    match (holds, key) {
        (Holds::AddrProtoPortVerdict, Key::AddrProtoPort(a, p, n)) => {
            put_addr(&mut out, a, family)?;
            put_proto(&mut out, *p);
            put_port(&mut out, *n);
        }
        (Holds::ProtoPortVerdict, Key::ProtoPort(p, n)) => {
            put_proto(&mut out, *p);
            put_port(&mut out, *n);
        }
        (Holds::AddrPair, Key::AddrPair(a, b)) => {
            put_addr(&mut out, a, family)?;
            put_addr(&mut out, b, family)?;
        }
        // `numgen random mod …` result: a 32-bit integer in host byte order.
        (Holds::SlotAddrPort | Holds::SlotVerdict, Key::Slot(n)) => out.extend_from_slice(&n.to_ne_bytes()),
        _ => return Err("key does not match the map type"),
    }
    Ok(out)
}

/// A verdict as the kernel's (code, chain).
fn verdict_code(v: &Verdict) -> Result<(i32, Option<&str>), &'static str> {
    let (code, chain) = match v {
        Verdict::Drop => (NF_DROP, None),
        Verdict::Accept => (NF_ACCEPT, None),
        Verdict::Return => (NFT_RETURN, None),
        Verdict::Goto(c) => (NFT_GOTO, Some(c.as_str())),
        Verdict::Jump(c) => (NFT_JUMP, Some(c.as_str())),
    };
    if chain.is_some_and(|c| !nft_identifier(c)) {
        return Err("not a chain name nft reads as one");
    }
    Ok((code, chain))
}

/// Whether nft reads `s` as one identifier (a chain or map name) the way the encoder would
/// send it: a letter or '_' first, then letters, digits and `-_./`, under 256 bytes. A name
/// outside that (a space, a ';') means something else in nft text, so the encoder refuses
/// it and the transaction goes through `nft -f`, where the difference shows as an error
/// (found by fuzzing: tests/fuzz/corpus/netlink_encode/crash-chain-name-with-a-space).
/// The name must also hold a '-' or a '/': a bare word may be one of nft's keywords (`xt`,
/// `tcp`), which nft does not read as a name (crash-chain-named-like-a-keyword); every chain
/// the agent writes rules or verdict elements for has one (`svc-…`, `ep-…`, `ext-…`).
fn nft_identifier(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() < 256
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b'/'))
        && b.iter().any(|c| matches!(c, b'-' | b'/'))
}

/// The rule shapes encoded here.
#[derive(Debug, PartialEq)]
enum Shape<'a> {
    /// `meta l4proto P dnat to numgen random mod N offset B map @M`
    DnatMap { proto: u8, modulus: u32, offset: u32, map: SetName },
    /// `meta l4proto P dnat to ADDR:PORT` (`[ADDR]:PORT` for IPv6)
    DnatTo { proto: u8, addr: IpAddr, port: u16 },
    /// `jump C` / `goto C`
    Verdict { code: i32, chain: &'a str },
}

fn shape(rule: &Rule) -> Option<Shape<'_>> {
    match rule.0.as_slice() {
        [Expr::Verdict(Verdict::Jump(c))] if nft_identifier(c) => Some(Shape::Verdict { code: NFT_JUMP, chain: c }),
        [Expr::Verdict(Verdict::Goto(c))] if nft_identifier(c) => Some(Shape::Verdict { code: NFT_GOTO, chain: c }),
        [Expr::L4Proto(p), Expr::DnatNumgenMap { modulus, offset, map }] if *modulus > 0 => {
            Some(Shape::DnatMap { proto: proto_number(*p), modulus: *modulus, offset: *offset, map: *map })
        }
        [Expr::L4Proto(p), Expr::DnatTo(addr, port)] => Some(Shape::DnatTo { proto: proto_number(*p), addr: *addr, port: *port }),
        _ => None,
    }
}

fn be32(v: u32) -> [u8; 4] {
    v.to_be_bytes()
}

impl Buf {
    fn expr(&mut self, name: &str, body: impl FnOnce(&mut Buf)) {
        self.nest_start(NFTA_LIST_ELEM);
        self.attr_str(NFTA_EXPR_NAME, name);
        self.nest_start(NFTA_EXPR_DATA);
        body(self);
        self.nest_end();
        self.nest_end();
    }

    fn verdict(&mut self, code: i32, chain: Option<&str>) {
        self.nest_start(NFTA_DATA_VERDICT);
        self.attr(NFTA_VERDICT_CODE, &code.to_be_bytes());
        if let Some(c) = chain {
            self.attr_str(NFTA_VERDICT_CHAIN, c);
        }
        self.nest_end();
    }

    /// `meta l4proto P` (meta load into reg 1, cmp eq).
    fn l4proto(&mut self, proto: u8) {
        self.expr("meta", |b| {
            b.attr(NFTA_META_DREG, &be32(NFT_REG_1));
            b.attr(NFTA_META_KEY, &be32(NFT_META_L4PROTO));
        });
        self.expr("cmp", |b| {
            b.attr(NFTA_CMP_SREG, &be32(NFT_REG_1));
            b.attr(NFTA_CMP_OP, &be32(NFT_CMP_EQ));
            b.nest_start(NFTA_CMP_DATA);
            b.attr(NFTA_DATA_VALUE, &[proto]);
            b.nest_end();
        });
    }

    /// The expressions of a rule, as nft 1.0.6 encodes the same text.
    fn rule_exprs(&mut self, rule: &Shape<'_>, family: IpFamily) {
        let nfproto = match family {
            IpFamily::V4 => libc::NFPROTO_IPV4 as u32,
            IpFamily::V6 => libc::NFPROTO_IPV6 as u32,
        };
        match *rule {
            Shape::Verdict { code, chain } => self.expr("immediate", |b| {
                b.attr(NFTA_IMMEDIATE_DREG, &be32(NFT_REG_VERDICT));
                b.nest_start(NFTA_IMMEDIATE_DATA);
                b.verdict(code, Some(chain));
                b.nest_end();
            }),
            Shape::DnatMap { proto, modulus, offset, map } => {
                self.l4proto(proto);
                self.expr("numgen", |b| {
                    b.attr(NFTA_NG_DREG, &be32(NFT_REG_1));
                    b.attr(NFTA_NG_MODULUS, &be32(modulus));
                    b.attr(NFTA_NG_TYPE, &be32(NFT_NG_RANDOM));
                    b.attr(NFTA_NG_OFFSET, &be32(offset));
                });
                self.expr("lookup", |b| {
                    b.attr_str(NFTA_LOOKUP_SET, &map.to_string());
                    b.attr(NFTA_LOOKUP_SREG, &be32(NFT_REG_1));
                    b.attr(NFTA_LOOKUP_DREG, &be32(NFT_REG_1));
                });
                // The map's value is `address . port`: the port is the 32-bit register
                // right after the address.
                let addr_words = match family {
                    IpFamily::V4 => 1,
                    IpFamily::V6 => 4,
                };
                self.expr("nat", |b| {
                    b.attr(NFTA_NAT_TYPE, &be32(NFT_NAT_DNAT));
                    b.attr(NFTA_NAT_FAMILY, &be32(nfproto));
                    b.attr(NFTA_NAT_REG_ADDR_MIN, &be32(NFT_REG_1));
                    b.attr(NFTA_NAT_REG_PROTO_MIN, &be32(NFT_REG32_00 + addr_words));
                });
            }
            Shape::DnatTo { proto, addr, port } => {
                self.l4proto(proto);
                let octets: Vec<u8> = match addr {
                    IpAddr::V4(a) => a.octets().to_vec(),
                    IpAddr::V6(a) => a.octets().to_vec(),
                };
                self.expr("immediate", |b| {
                    b.attr(NFTA_IMMEDIATE_DREG, &be32(NFT_REG_1));
                    b.nest_start(NFTA_IMMEDIATE_DATA);
                    b.attr(NFTA_DATA_VALUE, &octets);
                    b.nest_end();
                });
                self.expr("immediate", |b| {
                    b.attr(NFTA_IMMEDIATE_DREG, &be32(NFT_REG_2));
                    b.nest_start(NFTA_IMMEDIATE_DATA);
                    b.attr(NFTA_DATA_VALUE, &port.to_be_bytes());
                    b.nest_end();
                });
                self.expr("nat", |b| {
                    b.attr(NFTA_NAT_TYPE, &be32(NFT_NAT_DNAT));
                    b.attr(NFTA_NAT_FAMILY, &be32(nfproto));
                    b.attr(NFTA_NAT_REG_ADDR_MIN, &be32(NFT_REG_1));
                    b.attr(NFTA_NAT_REG_PROTO_MIN, &be32(NFT_REG_2));
                    b.attr(NFTA_NAT_FLAGS, &be32(NF_NAT_RANGE_PROTO_SPECIFIED));
                });
            }
        }
    }
}

fn nfproto_family(f: IpFamily) -> u8 {
    match f {
        IpFamily::V4 => libc::AF_INET as u8,
        IpFamily::V6 => libc::AF_INET6 as u8,
    }
}

/// An encoded batch and the number of acknowledgements it asks for.
#[derive(Debug)]
pub struct Batch {
    bytes: Vec<u8>,
    messages: usize,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.messages == 0
    }
}

/// Encode operations (each with its table's family) as one batch, in order; consecutive
/// element operations of the same kind on the same set share a message. Fails on anything
/// it cannot encode exactly.
pub fn encode(ops: &[(IpFamily, &Op)]) -> Result<Batch, Unencodable> {
    let mut buf = Buf::default();
    let mut seq = 1u32;
    let begin = buf.msg_start(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, libc::AF_UNSPEC as u8, NFNL_SUBSYS_NFTABLES);
    buf.msg_end(begin);
    let mut messages = 0;
    let mut i = 0;
    let msg_type = |t: u16| (NFNL_SUBSYS_NFTABLES << 8) | t;
    while i < ops.len() {
        seq += 1;
        messages += 1;
        let (family, op) = ops[i];
        let (set, delete) = match op {
            Op::AddElement { set, .. } => (*set, false),
            Op::DeleteElement { set, .. } => (*set, true),
            Op::AddChain { chain, base: None } | Op::FlushChain(chain) | Op::DeleteChain(chain) => {
                if !nft_identifier(chain) {
                    return Err(Unencodable { set: chain.to_string(), key: String::new(), why: "not a chain name nft reads as one" });
                }
                let (ty, flags, name_attr) = match op {
                    Op::AddChain { .. } => (NFT_MSG_NEWCHAIN, NLM_F_CREATE, NFTA_CHAIN_NAME),
                    Op::DeleteChain(_) => (NFT_MSG_DELCHAIN, 0, NFTA_CHAIN_NAME),
                    _ => (NFT_MSG_DELRULE, 0, NFTA_RULE_CHAIN),
                };
                let m = buf.msg_start(msg_type(ty), NLM_F_REQUEST | NLM_F_ACK | flags, seq, nfproto_family(family), 0);
                buf.attr_str(NFTA_CHAIN_TABLE, TABLE);
                buf.attr_str(name_attr, chain);
                buf.msg_end(m);
                i += 1;
                continue;
            }
            Op::AddRule { chain, rule } => {
                let bad = |why| Unencodable { set: chain.to_string(), key: rule.to_string(), why };
                if !nft_identifier(chain) {
                    return Err(bad("not a chain name nft reads as one"));
                }
                let shape = shape(rule).ok_or_else(|| bad("rule shape not encoded"))?;
                if let Shape::DnatTo { addr, .. } = &shape {
                    // nft refuses `dnat to` an address of the other family than the table's.
                    put_addr(&mut Vec::new(), addr, family).map_err(bad)?;
                }
                let m = buf.msg_start(msg_type(NFT_MSG_NEWRULE), NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_APPEND, seq, nfproto_family(family), 0);
                buf.attr_str(NFTA_RULE_TABLE, TABLE);
                buf.attr_str(NFTA_RULE_CHAIN, chain);
                buf.nest_start(NFTA_RULE_EXPRESSIONS);
                buf.rule_exprs(&shape, family);
                buf.nest_end();
                buf.msg_end(m);
                i += 1;
                continue;
            }
            other => {
                let mut text = String::new();
                other.write_text(family, &mut text);
                return Err(Unencodable { set: String::new(), key: text.trim_end().to_string(), why: "tables, base chains, maps and sets go through nft" });
            }
        };
        let same_message = |(f, o): &(IpFamily, &Op)| {
            *f == family
                && match o {
                    Op::AddElement { set: s, .. } => !delete && *s == set,
                    Op::DeleteElement { set: s, .. } => delete && *s == set,
                    _ => false,
                }
        };
        let holds = holds(set).ok_or_else(|| Unencodable { set: set.to_string(), key: String::new(), why: "not a known map" })?;
        let (msg_ty, flags) = if delete {
            (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK)
        } else {
            (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE)
        };
        let m = buf.msg_start(msg_type(msg_ty), flags, seq, nfproto_family(family), 0);
        buf.attr_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
        buf.attr_str(NFTA_SET_ELEM_LIST_SET, &set.to_string());
        buf.nest_start(NFTA_SET_ELEM_LIST_ELEMENTS);
        let list_start = buf.b.len();
        let mut j = i;
        while j < ops.len() && j - i < ELEMENTS_PER_MESSAGE && buf.b.len() - list_start < ELEMENT_LIST_BYTES && same_message(&ops[j]) {
            let (key, value) = match ops[j].1 {
                Op::AddElement { key, value, .. } => (key, value.as_ref()),
                Op::DeleteElement { key, .. } => (key, None),
                _ => break,
            };
            j += 1;
            let bad = |why| Unencodable { set: set.to_string(), key: key.to_string(), why };
            buf.nest_start(NFTA_LIST_ELEM);
            let k = encode_key(holds, key, family).map_err(bad)?;
            buf.nest_start(NFTA_SET_ELEM_KEY);
            buf.attr(NFTA_DATA_VALUE, &k);
            buf.nest_end();
            if !delete {
                match (value, holds) {
                    (None, Holds::AddrPair) => {}
                    (Some(Value::Verdict(v)), Holds::AddrProtoPortVerdict | Holds::ProtoPortVerdict | Holds::SlotVerdict) => {
                        let (code, chain) = verdict_code(v).map_err(bad)?;
                        buf.nest_start(NFTA_SET_ELEM_DATA);
                        buf.verdict(code, chain);
                        buf.nest_end();
                    }
                    (Some(Value::AddrPort(a, p)), Holds::SlotAddrPort) => {
                        let mut data = Vec::with_capacity(20);
                        put_addr(&mut data, a, family).map_err(bad)?;
                        put_port(&mut data, *p);
                        buf.nest_start(NFTA_SET_ELEM_DATA);
                        buf.attr(NFTA_DATA_VALUE, &data);
                        buf.nest_end();
                    }
                    _ => return Err(bad("value does not match the map type")),
                }
            }
            buf.nest_end();
        }
        buf.nest_end();
        buf.msg_end(m);
        i = j;
    }
    if buf.overflow {
        return Err(Unencodable { set: String::new(), key: String::new(), why: "an attribute is longer than netlink allows" });
    }
    seq += 1;
    let end = buf.msg_start(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq, libc::AF_UNSPEC as u8, NFNL_SUBSYS_NFTABLES);
    buf.msg_end(end);
    Ok(Batch { bytes: buf.b, messages })
}

/// A `NETLINK_NETFILTER` socket in the node's network namespace.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
}

impl Socket {
    /// Open a socket in the namespace of `netns` (None: the agent's own). The socket stays
    /// in that namespace whatever thread later uses it.
    pub fn open(netns: Option<&std::fs::File>) -> Result<Socket, NetlinkError> {
        match netns {
            None => Self::open_here(),
            Some(f) => crate::netns::on_thread_in(f, Self::open_here).map_err(NetlinkError::Netns)?,
        }
    }

    fn open_here() -> Result<Socket, NetlinkError> {
        let s = Socket { fd: netlink::open_netfilter()? };
        // Room for a whole batch and its acknowledgements.
        netlink::set_buffers(&s.fd, 4 << 20, 1 << 20)?;
        Ok(s)
    }

    /// Drop anything left in the receive queue (from an earlier, failed exchange).
    fn drain(&self) {
        let mut buf = [0u8; 8192];
        while netlink::recv(&self.fd, &mut buf, libc::MSG_DONTWAIT).is_ok_and(|n| n > 0) {}
    }

    /// Send the batch and check every message's acknowledgement. The kernel processes a
    /// batch synchronously in `sendmsg`, so every reply is queued when it returns.
    pub fn apply(&self, batch: &Batch) -> Result<(), NetlinkError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.drain();
        netlink::send(&self.fd, &batch.bytes)?;
        let mut acks = 0;
        let mut buf = vec![0u8; 65536];
        loop {
            let n = match netlink::recv(&self.fd, &mut buf, libc::MSG_DONTWAIT) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            };
            for m in netlink::messages(&buf[..n]).filter(|m| m.ty == NLMSG_ERROR) {
                match netlink::error_code(m.payload) {
                    Some(0) => acks += 1,
                    Some(code) => return Err(NetlinkError::Rejected(std::io::Error::from_raw_os_error(-code))),
                    None => {}
                }
            }
        }
        if acks != batch.messages {
            return Err(NetlinkError::MissingAcks { got: acks, want: batch.messages });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn concatenated_fields_are_padded_to_registers() {
        let k = encode_key(Holds::AddrProtoPortVerdict, &Key::AddrProtoPort(ip("198.19.0.10"), Protocol::Tcp, 80), IpFamily::V4).expect("key");
        assert_eq!(k, vec![198, 19, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0]);
        let mut v = Vec::new();
        put_addr(&mut v, &ip("fd00::1"), IpFamily::V6).expect("value");
        put_port(&mut v, 8080);
        assert_eq!(v.len(), 20);
        assert_eq!(&v[16..], &[0x1f, 0x90, 0, 0]);
        assert_eq!(encode_key(Holds::SlotAddrPort, &Key::Slot(7), IpFamily::V4).expect("slot"), 7u32.to_ne_bytes().to_vec());
        assert!(encode_key(Holds::AddrPair, &Key::AddrPair(ip("fd00::1"), ip("fd00::1")), IpFamily::V4).is_err(), "family checked");
        assert!(encode_key(Holds::ProtoPortVerdict, &Key::Slot(1), IpFamily::V4).is_err(), "key shape checked");
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict_code(&Verdict::Goto("svc-a".into())), Ok((NFT_GOTO, Some("svc-a"))));
        assert_eq!(verdict_code(&Verdict::Drop), Ok((NF_DROP, None)));
        assert!(verdict_code(&Verdict::Goto(String::new())).is_err());
        assert!(verdict_code(&Verdict::Goto("svc a".into())).is_err());
    }

    fn add(set: SetName, key: Key, value: Option<Value>) -> Op {
        Op::AddElement { set, key, value }
    }

    fn with(family: IpFamily, ops: &[Op]) -> Vec<(IpFamily, &Op)> {
        ops.iter().map(|o| (family, o)).collect()
    }

    #[test]
    fn batch_has_begin_messages_end_and_counts_acks() {
        let dnat = SetName::EndpointDnat(Protocol::Tcp, 0);
        let v4 = [
            Op::DeleteElement { set: dnat, key: Key::Slot(1) },
            add(dnat, Key::Slot(1), Some(Value::AddrPort(ip("198.18.2.3"), 8080))),
            add(dnat, Key::Slot(2), Some(Value::AddrPort(ip("198.18.2.4"), 8080))),
        ];
        let v6 = [add(SetName::Named(SERVICE_IPS), Key::AddrProtoPort(ip("fd00::a"), Protocol::Udp, 53), Some(Value::Verdict(Verdict::Goto("svc-x".into()))))];
        let mut ops = with(IpFamily::V4, &v4);
        ops.extend(with(IpFamily::V6, &v6));
        let b = encode(&ops).expect("encode");
        assert_eq!(b.messages, 3, "delete, add (two elements), add in the other family");
        assert!(b.len().is_multiple_of(4));
        let ty = |off: usize| u16::from_ne_bytes([b.bytes[off + 4], b.bytes[off + 5]]);
        assert_eq!(ty(0), NFNL_MSG_BATCH_BEGIN);
        assert_eq!(ty(20), (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELSETELEM);
        // Long verdicts: messages end before their element list outgrows 16-bit lengths.
        let chain = format!("svc-{}", "x".repeat(240));
        let many: Vec<Op> = (0..600u32)
            .map(|i| {
                let key = Key::AddrProtoPort(ip(&format!("198.19.{}.{}", i / 250, i % 250)), Protocol::Tcp, 80);
                add(SetName::Named(SERVICE_IPS), key, Some(Value::Verdict(Verdict::Goto(chain.clone()))))
            })
            .collect();
        let b = encode(&with(IpFamily::V4, &many)).expect("encode");
        assert!(b.messages > 600 / ELEMENTS_PER_MESSAGE + 1, "{} messages", b.messages);
        let long = "y".repeat(70_000);
        let huge = [Op::AddChain { chain: long, base: None }];
        assert!(encode(&with(IpFamily::V4, &huge)).is_err(), "a 16-bit length overflow is refused, not wrapped");
        let bad = [add(SetName::Named("other"), Key::Slot(1), None)];
        assert!(encode(&with(IpFamily::V4, &bad)).is_err());
        let bad = [add(SetName::Named(HAIRPIN), Key::AddrPair(ip("1.2.3.4"), ip("1.2.3.4")), Some(Value::Verdict(Verdict::Drop)))];
        assert!(encode(&with(IpFamily::V4, &bad)).is_err(), "a set element has no value");
        let rule = [Op::AddRule {
            chain: "svc-a".into(),
            rule: Rule::new([
                Expr::SaddrNotIn(IpFamily::V4, vec!["198.18.0.0/16".parse().expect("net")]),
                Expr::Verdict(Verdict::Jump("mark-for-masquerade".into())),
            ]),
        }];
        assert!(encode(&with(IpFamily::V4, &rule)).is_err(), "other rules go through nft");
        let table = [Op::AddTable { comment: true }];
        assert!(encode(&with(IpFamily::V4, &table)).is_err(), "tables go through nft");
    }

    #[test]
    fn a_bare_word_is_no_chain_name_for_the_encoder() {
        // Found by fuzzing (tests/fuzz/corpus/netlink_encode/crash-chain-named-like-a-keyword):
        // `goto xt` — nft reads `xt` as a keyword, not as a chain's name.
        for word in ["xt", "tcp", "services"] {
            assert!(!nft_identifier(word), "{word}");
            let op = [add(SetName::Named("service-nodeports"), Key::ProtoPort(Protocol::Tcp, 30080), Some(Value::Verdict(Verdict::Goto(word.into()))))];
            assert!(encode(&with(IpFamily::V4, &op)).is_err(), "goto {word}");
        }
        assert!(nft_identifier("svc-ns/a/tcp/80") && nft_identifier("ep-x") && nft_identifier("mark-for-masquerade"));
    }

    #[test]
    fn a_dnat_to_the_other_family_is_unencodable() {
        // Found by fuzzing (tests/fuzz/corpus/netlink_encode/crash-dnat-to-the-other-family):
        // nft refuses `dnat to` an IPv6 address in an `ip` table, so the encoder must too.
        let chain = "svc-ns/b/udp/53".to_string();
        let dnat = |addr| [Op::AddRule { chain: chain.clone(), rule: Rule::new([Expr::L4Proto(Protocol::Udp), Expr::DnatTo(ip(addr), 5353)]) }];
        assert!(encode(&with(IpFamily::V4, &dnat("fd00:2::5"))).is_err(), "an IPv6 dnat in an ip table");
        assert!(encode(&with(IpFamily::V6, &dnat("198.18.2.5"))).is_err(), "an IPv4 dnat in an ip6 table");
        assert!(encode(&with(IpFamily::V4, &dnat("198.18.2.5"))).is_ok());
        assert!(encode(&with(IpFamily::V6, &dnat("fd00:2::5"))).is_ok());
    }

    #[test]
    fn rule_shapes_of_plain_service_chains_are_encoded() {
        let dnat_map = SetName::EndpointDnat(Protocol::Tcp, 4);
        assert_eq!(
            shape(&Rule::new([Expr::L4Proto(Protocol::Tcp), Expr::DnatNumgenMap { modulus: 3, offset: 96, map: dnat_map }])),
            Some(Shape::DnatMap { proto: 6, modulus: 3, offset: 96, map: dnat_map })
        );
        assert_eq!(
            shape(&Rule::new([Expr::L4Proto(Protocol::Udp), Expr::DnatTo(ip("fd00:2::1"), 5353)])),
            Some(Shape::DnatTo { proto: 17, addr: ip("fd00:2::1"), port: 5353 })
        );
        assert_eq!(
            shape(&Rule::new([Expr::L4Proto(Protocol::Sctp), Expr::DnatTo(ip("198.18.2.1"), 80)])),
            Some(Shape::DnatTo { proto: 132, addr: ip("198.18.2.1"), port: 80 })
        );
        assert_eq!(shape(&Rule::verdict(Verdict::Goto("svc-ns/a/tcp/80".into()))), Some(Shape::Verdict { code: NFT_GOTO, chain: "svc-ns/a/tcp/80" }));
        assert_eq!(
            shape(&Rule::verdict(Verdict::Jump("mark-for-masquerade".into()))),
            Some(Shape::Verdict { code: NFT_JUMP, chain: "mark-for-masquerade" })
        );
        for other in [
            Rule::new([Expr::FibSaddrLocal, Expr::Verdict(Verdict::Goto("svc-a".into()))]),
            Rule::new([Expr::L4Proto(Protocol::Tcp), Expr::DnatNumgenMap { modulus: 0, offset: 0, map: dnat_map }]),
            Rule::new([Expr::SaddrInSet(IpFamily::V4, "aff-30-x".into()), Expr::Verdict(Verdict::Goto("ep-x".into()))]),
            Rule::new([Expr::NumgenVmap { modulus: 2, offset: 0, map: SetName::EndpointChains(0) }]),
            Rule::verdict(Verdict::Goto("svc a".into())),
        ] {
            assert_eq!(shape(&other), None, "{other}");
        }
    }
}
