//! A conntrack client on ctnetlink (`NFNL_SUBSYS_CTNETLINK`), written like the agent's
//! nf_tables batches: one dump of the table (`IPCTNL_MSG_CT_GET` with `NLM_F_DUMP`, UDP
//! only when the kernel filters by protocol), then `IPCTNL_MSG_CT_DELETE` by tuple and id
//! for the entries the caller picked, many deletes per `sendto`.
//!
//! Why our own encoder, and neither the `conntrack` tool nor a crate: `conntrack -D` is a
//! process per filter, and each one dumps the whole table to filter it (a UDP Service with
//! 5,000 externalIPs and a removed endpoint was 5,000 processes, each reading 100k entries,
//! inline in the sync loop). One dump filtered in memory against every planned flush costs
//! one pass whatever the number of flushes. libnetfilter_conntrack would mean linking C
//! and a new system library in the image; the netlink crates (`netlink-packet-netfilter`)
//! carry no conntrack messages today. The agent already frames nfnetlink messages for
//! nf_tables (`crate::netlink`); ctnetlink needs a dozen more attributes of that framing.
//! The socket is opened in the node's network namespace (as the nf_tables one) and kept
//! open.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::OwnedFd;

use crate::model::IpFamily;
use crate::netlink::{self, Buf, NLMSG_DONE, NLMSG_ERROR, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TIMEOUT: u16 = 7;
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const CTA_FILTER: u16 = 25;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
const CTA_FILTER_FLAG_CTA_PROTO_NUM: u32 = 1 << 3;

pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_TCP: u8 = 6;

/// Deletes (or creates) per `sendto`: their acknowledgements must fit the receive buffer.
const MESSAGES_PER_SEND: usize = 256;

/// Errors talking to ctnetlink.
#[derive(Debug, thiserror::Error)]
pub enum CtError {
    #[error("ctnetlink socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("cannot enter the network namespace: {0}")]
    Netns(std::io::Error),
    #[error("ctnetlink {what} refused: {source}")]
    Refused { what: &'static str, source: std::io::Error },
    #[error("ctnetlink {what}: {got} of {want} answers")]
    MissingAnswers { what: &'static str, got: usize, want: usize },
}

/// One direction of a connection: addresses and ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
}

impl Tuple {
    /// The other direction of the same connection, without NAT.
    pub fn reversed(&self) -> Tuple {
        Tuple { src: self.dst, dst: self.src, sport: self.dport, dport: self.sport }
    }
}

/// A conntrack entry as dumped: protocol, both tuples, zone and the kernel's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Entry {
    pub proto: u8,
    pub orig: Tuple,
    pub reply: Tuple,
    pub zone: u16,
    pub id: Option<u32>,
}

/// What a delete round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    /// Entries the kernel deleted.
    pub deleted: usize,
    /// Entries already gone (expired, or deleted by someone else, since the dump).
    pub gone: usize,
}

fn family_byte(f: IpFamily) -> u8 {
    match f {
        IpFamily::V4 => libc::AF_INET as u8,
        IpFamily::V6 => libc::AF_INET6 as u8,
    }
}

fn msg_type(t: u16) -> u16 {
    (NFNL_SUBSYS_CTNETLINK << 8) | t
}

impl Buf {
    fn ct_tuple(&mut self, ty: u16, proto: u8, t: &Tuple) {
        self.nest_start(ty);
        self.nest_start(CTA_TUPLE_IP);
        match (t.src, t.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                self.attr(CTA_IP_V4_SRC, &s.octets());
                self.attr(CTA_IP_V4_DST, &d.octets());
            }
            (s, d) => {
                self.attr(CTA_IP_V6_SRC, &v6(s).octets());
                self.attr(CTA_IP_V6_DST, &v6(d).octets());
            }
        }
        self.nest_end();
        self.nest_start(CTA_TUPLE_PROTO);
        self.attr(CTA_PROTO_NUM, &[proto]);
        self.attr(CTA_PROTO_SRC_PORT, &t.sport.to_be_bytes());
        self.attr(CTA_PROTO_DST_PORT, &t.dport.to_be_bytes());
        self.nest_end();
        self.nest_end();
    }
}

fn v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => a.to_ipv6_mapped(),
    }
}

/// The delete message of `e` (by tuple, zone and id: an entry made anew with the same
/// tuple since the dump is not touched).
fn encode_delete(buf: &mut Buf, seq: u32, e: &Entry) {
    let m = buf.msg_start(msg_type(IPCTNL_MSG_CT_DELETE), NLM_F_REQUEST | NLM_F_ACK, seq, family_byte(IpFamily::of(&e.orig.src)), 0);
    buf.ct_tuple(CTA_TUPLE_ORIG, e.proto, &e.orig);
    if e.zone != 0 {
        buf.attr(CTA_ZONE, &e.zone.to_be_bytes());
    }
    if let Some(id) = e.id {
        buf.attr(CTA_ID, &id.to_be_bytes());
    }
    buf.msg_end(m);
}

/// The dump request of one family: UDP entries only when `udp_only` (CTA_FILTER,
/// Linux ≥ 5.8; older kernels refuse the attribute).
fn encode_dump(seq: u32, family: IpFamily, udp_only: bool) -> Vec<u8> {
    let mut buf = Buf::default();
    let m = buf.msg_start(msg_type(IPCTNL_MSG_CT_GET), NLM_F_REQUEST | NLM_F_DUMP, seq, family_byte(family), 0);
    if udp_only {
        buf.nest_start(CTA_TUPLE_ORIG);
        buf.nest_start(CTA_TUPLE_PROTO);
        buf.attr(CTA_PROTO_NUM, &[IPPROTO_UDP]);
        buf.nest_end();
        buf.nest_end();
        buf.nest_start(CTA_FILTER);
        buf.attr(CTA_FILTER_ORIG_FLAGS, &CTA_FILTER_FLAG_CTA_PROTO_NUM.to_ne_bytes());
        buf.nest_end();
    }
    buf.msg_end(m);
    buf.b
}

fn parse_tuple(data: &[u8]) -> Option<(u8, Tuple)> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, 0, 0);
    for (ty, d) in netlink::attrs(data) {
        match ty {
            CTA_TUPLE_IP => {
                for (ty, a) in netlink::attrs(d) {
                    let ip = match (ty, a.len()) {
                        (CTA_IP_V4_SRC | CTA_IP_V4_DST, 4) => IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3])),
                        (CTA_IP_V6_SRC | CTA_IP_V6_DST, 16) => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(a).ok()?)),
                        _ => continue,
                    };
                    if ty == CTA_IP_V4_SRC || ty == CTA_IP_V6_SRC {
                        src = Some(ip);
                    } else {
                        dst = Some(ip);
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (ty, a) in netlink::attrs(d) {
                    match (ty, a) {
                        (CTA_PROTO_NUM, [p, ..]) => proto = Some(*p),
                        (CTA_PROTO_SRC_PORT, [a, b, ..]) => sport = u16::from_be_bytes([*a, *b]),
                        (CTA_PROTO_DST_PORT, [a, b, ..]) => dport = u16::from_be_bytes([*a, *b]),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((proto?, Tuple { src: src?, dst: dst?, sport, dport }))
}

/// An entry from the payload of a dumped `IPCTNL_MSG_CT_NEW` (after the nfgenmsg header).
fn parse_entry(attrs: &[u8]) -> Option<Entry> {
    let (mut orig, mut reply, mut zone, mut id) = (None, None, 0, None);
    for (ty, d) in netlink::attrs(attrs) {
        match (ty, d) {
            (CTA_TUPLE_ORIG, _) => orig = parse_tuple(d),
            (CTA_TUPLE_REPLY, _) => reply = parse_tuple(d),
            (CTA_ZONE, [a, b, ..]) => zone = u16::from_be_bytes([*a, *b]),
            (CTA_ID, [a, b, c, e, ..]) => id = Some(u32::from_be_bytes([*a, *b, *c, *e])),
            _ => {}
        }
    }
    let (proto, orig) = orig?;
    let (_, reply) = reply?;
    Some(Entry { proto, orig, reply, zone, id })
}

/// A ctnetlink socket in the node's network namespace.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
    seq: u32,
    /// The kernel refused the protocol filter once: dump everything from then on.
    no_kernel_filter: bool,
}

impl Socket {
    /// Open a socket in the namespace of `netns` (None: the agent's own).
    pub fn open(netns: Option<&File>) -> Result<Socket, CtError> {
        let open = || -> std::io::Result<OwnedFd> {
            let fd = netlink::open_netfilter()?;
            // A dump is read one buffer at a time; acknowledgements of a send of deletes
            // (MESSAGES_PER_SEND) wait in the receive queue until read.
            netlink::set_buffers(&fd, 1 << 20, 4 << 20)?;
            Ok(fd)
        };
        let fd = match netns {
            None => open()?,
            Some(f) => crate::netns::on_thread_in(f, open).map_err(CtError::Netns)??,
        };
        Ok(Socket { fd, seq: 0, no_kernel_filter: false })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Dump the UDP entries of `family` (the kernel may also send others: callers check
    /// the protocol), calling `f` on each. Returns the number of entries read.
    pub fn dump_udp(&mut self, family: IpFamily, mut f: impl FnMut(&Entry)) -> Result<usize, CtError> {
        if !self.no_kernel_filter {
            match self.dump(family, true, &mut f) {
                Err(CtError::Refused { source, .. }) if matches!(source.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP)) => {
                    tracing::info!("the kernel does not filter conntrack dumps by protocol; dumping every entry");
                    self.no_kernel_filter = true;
                }
                other => return other,
            }
        }
        self.dump(family, false, &mut f)
    }

    /// Dump every entry of `family` (for tests and benchmarks).
    #[doc(hidden)]
    pub fn dump_all(&mut self, family: IpFamily, mut f: impl FnMut(&Entry)) -> Result<usize, CtError> {
        self.dump(family, false, &mut f)
    }

    fn dump(&mut self, family: IpFamily, udp_only: bool, f: &mut impl FnMut(&Entry)) -> Result<usize, CtError> {
        let seq = self.next_seq();
        netlink::send(&self.fd, &encode_dump(seq, family, udp_only))?;
        let mut buf = vec![0u8; 256 << 10];
        let mut n = 0;
        loop {
            let len = netlink::recv(&self.fd, &mut buf, 0)?;
            if len == 0 {
                return Err(CtError::Io(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)));
            }
            for m in netlink::messages(&buf[..len]) {
                match m.ty {
                    NLMSG_DONE => return Ok(n),
                    NLMSG_ERROR => match netlink::error_code(m.payload) {
                        Some(0) | None => {}
                        Some(code) => {
                            // The rest of this dump (if any) is not read: start clean.
                            self.drain();
                            return Err(CtError::Refused { what: "dump", source: std::io::Error::from_raw_os_error(-code) });
                        }
                    },
                    _ => {
                        // nfgenmsg (4 bytes), then the attributes.
                        if let Some(e) = m.payload.get(4..).and_then(parse_entry) {
                            n += 1;
                            f(&e);
                        }
                    }
                }
            }
        }
    }

    /// Delete `entries` (by tuple, zone and id). Entries already gone are counted apart.
    pub fn delete(&mut self, entries: &[Entry]) -> Result<Deleted, CtError> {
        let mut out = Deleted::default();
        for chunk in entries.chunks(MESSAGES_PER_SEND) {
            let mut buf = Buf::default();
            for e in chunk {
                let seq = self.next_seq();
                encode_delete(&mut buf, seq, e);
            }
            let (ok, gone) = self.exchange("delete", &buf.b, chunk.len(), &[libc::ENOENT])?;
            out.deleted += ok;
            out.gone += gone;
        }
        Ok(out)
    }

    /// Create UDP or TCP entries (for tests and benchmarks: a node's conntrack table filled
    /// without traffic), each with `orig` and `reply` as given and a timeout in seconds.
    /// Entries that exist already are left as they are.
    #[doc(hidden)]
    pub fn create(&mut self, entries: &[(u8, Tuple, Tuple)], timeout_s: u32) -> Result<usize, CtError> {
        let mut created = 0;
        for chunk in entries.chunks(MESSAGES_PER_SEND) {
            let mut buf = Buf::default();
            for (proto, orig, reply) in chunk {
                let seq = self.next_seq();
                let flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
                let m = buf.msg_start(msg_type(IPCTNL_MSG_CT_NEW), flags, seq, family_byte(IpFamily::of(&orig.src)), 0);
                buf.ct_tuple(CTA_TUPLE_ORIG, *proto, orig);
                buf.ct_tuple(CTA_TUPLE_REPLY, *proto, reply);
                buf.attr(CTA_TIMEOUT, &timeout_s.to_be_bytes());
                buf.msg_end(m);
            }
            created += self.exchange("create", &buf.b, chunk.len(), &[libc::EEXIST])?.0;
        }
        Ok(created)
    }

    /// Send `bytes` (`want` messages, each asking for an acknowledgement) and read the
    /// answers: (acknowledged, refused with one of `tolerated`); another refusal fails.
    fn exchange(&mut self, what: &'static str, bytes: &[u8], want: usize, tolerated: &[i32]) -> Result<(usize, usize), CtError> {
        self.drain();
        netlink::send(&self.fd, bytes)?;
        let (mut ok, mut tolerated_n, mut first_error) = (0, 0, None);
        let mut buf = vec![0u8; 64 << 10];
        while ok + tolerated_n < want && first_error.is_none() {
            let len = match netlink::recv(&self.fd, &mut buf, libc::MSG_DONTWAIT) {
                Ok(n) => n,
                // ctnetlink handles the messages synchronously in sendto: all answers are queued.
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            };
            for m in netlink::messages(&buf[..len]).filter(|m| m.ty == NLMSG_ERROR) {
                match netlink::error_code(m.payload) {
                    Some(0) => ok += 1,
                    Some(code) if tolerated.contains(&-code) => tolerated_n += 1,
                    Some(code) => {
                        first_error.get_or_insert(code);
                    }
                    None => {}
                }
            }
        }
        if let Some(code) = first_error {
            return Err(CtError::Refused { what, source: std::io::Error::from_raw_os_error(-code) });
        }
        if ok + tolerated_n != want {
            return Err(CtError::MissingAnswers { what, got: ok + tolerated_n, want });
        }
        Ok((ok, tolerated_n))
    }

    /// Drop anything left in the receive queue (from an earlier, failed exchange).
    fn drain(&self) {
        let mut buf = [0u8; 8192];
        while netlink::recv(&self.fd, &mut buf, libc::MSG_DONTWAIT).is_ok_and(|n| n > 0) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn entry_attrs(e: &Entry) -> Vec<u8> {
        let mut buf = Buf::default();
        buf.ct_tuple(CTA_TUPLE_ORIG, e.proto, &e.orig);
        buf.ct_tuple(CTA_TUPLE_REPLY, e.proto, &e.reply);
        buf.attr(CTA_ID, &e.id.unwrap_or(0).to_be_bytes());
        buf.attr(CTA_ZONE, &e.zone.to_be_bytes());
        buf.b
    }

    #[test]
    fn tuples_encode_and_parse_back_in_both_families() {
        for (c, vip, ep) in [("198.18.1.2", "198.19.0.53", "198.18.2.10"), ("fd00:1::2", "fd00:10:96::35", "fd00:2::10")] {
            let orig = Tuple { src: ip(c), dst: ip(vip), sport: 40000, dport: 53 };
            let reply = Tuple { src: ip(ep), dst: ip(c), sport: 5353, dport: 40000 };
            let e = Entry { proto: IPPROTO_UDP, orig, reply, zone: 7, id: Some(0xdead_beef) };
            assert_eq!(parse_entry(&entry_attrs(&e)), Some(e));
        }
    }

    #[test]
    fn delete_names_the_tuple_zone_and_id() {
        let orig = Tuple { src: ip("198.18.1.2"), dst: ip("198.19.0.53"), sport: 40000, dport: 53 };
        let e = Entry { proto: IPPROTO_UDP, orig, reply: orig.reversed(), zone: 0, id: Some(42) };
        let mut buf = Buf::default();
        encode_delete(&mut buf, 1, &e);
        let msgs: Vec<_> = netlink::messages(&buf.b).map(|m| (m.ty, m.flags, m.payload.to_vec())).collect();
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].0, (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE);
        assert_eq!(msgs[0].1, NLM_F_REQUEST | NLM_F_ACK);
        let attrs: Vec<u16> = netlink::attrs(&msgs[0].2[4..]).map(|(t, _)| t).collect();
        assert_eq!(attrs, vec![CTA_TUPLE_ORIG, CTA_ID], "zone 0 is the default and not sent");
        let (proto, t) = netlink::attrs(&msgs[0].2[4..]).find(|(t, _)| *t == CTA_TUPLE_ORIG).and_then(|(_, d)| parse_tuple(d)).expect("tuple");
        assert_eq!((proto, t), (IPPROTO_UDP, orig));
    }

    #[test]
    fn the_dump_asks_the_kernel_for_udp_only_or_everything() {
        let filtered = encode_dump(1, IpFamily::V4, true);
        let m = netlink::messages(&filtered).next().expect("message");
        assert_eq!(m.flags, NLM_F_REQUEST | NLM_F_DUMP);
        assert_eq!(m.payload[0], libc::AF_INET as u8);
        let attrs: Vec<u16> = netlink::attrs(&m.payload[4..]).map(|(t, _)| t).collect();
        assert_eq!(attrs, vec![CTA_TUPLE_ORIG, CTA_FILTER]);
        let plain = encode_dump(1, IpFamily::V6, false);
        let m = netlink::messages(&plain).next().expect("message");
        assert_eq!((m.payload[0], m.payload.len()), (libc::AF_INET6 as u8, 4), "no attributes");
    }
}
