//! Netlink framing shared by the agent's two netlink clients — nf_tables batches
//! (`nftables/netlink.rs`) and ctnetlink conntrack dumps and deletes (`conntrack/ctnetlink.rs`):
//! building messages and attributes, walking the replies, and a `NETLINK_NETFILTER`
//! socket made in the node's network namespace.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;
pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
pub(crate) const NLM_F_DUMP: u16 = 0x300;
pub(crate) const NLM_F_CREATE: u16 = 0x400;
pub(crate) const NLM_F_EXCL: u16 = 0x200;
pub(crate) const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

pub(crate) fn cvt(r: libc::c_int) -> std::io::Result<libc::c_int> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Netlink message building.
#[derive(Default)]
pub(crate) struct Buf {
    pub(crate) b: Vec<u8>,
    /// Offsets of open nests.
    nests: Vec<usize>,
    /// An attribute longer than its 16-bit length field allows was written.
    pub(crate) overflow: bool,
}

impl Buf {
    pub(crate) fn align(&mut self) {
        while !self.b.len().is_multiple_of(4) {
            self.b.push(0);
        }
    }
    pub(crate) fn msg_start(&mut self, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16) -> usize {
        let start = self.b.len();
        self.b.extend_from_slice(&0u32.to_ne_bytes());
        self.b.extend_from_slice(&ty.to_ne_bytes());
        self.b.extend_from_slice(&flags.to_ne_bytes());
        self.b.extend_from_slice(&seq.to_ne_bytes());
        self.b.extend_from_slice(&0u32.to_ne_bytes());
        // struct nfgenmsg
        self.b.push(family);
        self.b.push(0); // NFNETLINK_V0
        self.b.extend_from_slice(&res_id.to_be_bytes());
        start
    }
    pub(crate) fn msg_end(&mut self, start: usize) {
        self.align();
        let len = (self.b.len() - start) as u32;
        self.b[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }
    pub(crate) fn attr(&mut self, ty: u16, data: &[u8]) {
        let len = u16::try_from(4 + data.len()).unwrap_or_else(|_| {
            self.overflow = true;
            0
        });
        self.b.extend_from_slice(&len.to_ne_bytes());
        self.b.extend_from_slice(&ty.to_ne_bytes());
        self.b.extend_from_slice(data);
        self.align();
    }
    pub(crate) fn attr_str(&mut self, ty: u16, s: &str) {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(ty, &v);
    }
    pub(crate) fn nest_start(&mut self, ty: u16) {
        self.nests.push(self.b.len());
        self.b.extend_from_slice(&0u16.to_ne_bytes());
        self.b.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    }
    pub(crate) fn nest_end(&mut self) {
        if let Some(start) = self.nests.pop() {
            let len = u16::try_from(self.b.len() - start).unwrap_or_else(|_| {
                self.overflow = true;
                0
            });
            self.b[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
    }
}


/// One netlink message of a reply: type, flags, and the payload after the header.
pub(crate) struct Message<'a> {
    pub ty: u16,
    #[allow(dead_code)] // read by tests
    pub flags: u16,
    pub payload: &'a [u8],
}

/// The messages of one `recv`'d buffer (a truncated last message is left out).
pub(crate) fn messages(mut buf: &[u8]) -> impl Iterator<Item = Message<'_>> {
    std::iter::from_fn(move || {
        if buf.len() < 16 {
            return None;
        }
        let len = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len < 16 || len > buf.len() {
            return None;
        }
        let m = Message { ty: u16::from_ne_bytes([buf[4], buf[5]]), flags: u16::from_ne_bytes([buf[6], buf[7]]), payload: &buf[16..len] };
        buf = &buf[(len.div_ceil(4) * 4).min(buf.len())..];
        Some(m)
    })
}

/// The error code of an `NLMSG_ERROR` payload (0: an acknowledgement).
pub(crate) fn error_code(payload: &[u8]) -> Option<i32> {
    payload.get(..4).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

/// The attributes in `buf`: (type without the nested/byte-order flags, payload).
pub(crate) fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        if len < 4 || len > buf.len() {
            return None;
        }
        let ty = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        let data = &buf[4..len];
        buf = &buf[(len.div_ceil(4) * 4).min(buf.len())..];
        Some((ty, data))
    })
}

/// A `NETLINK_NETFILTER` socket in the calling thread's network namespace, bound (the
/// kernel picks the port id), asking for acknowledgements without the request echoed.
pub(crate) fn open_netfilter() -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned right away.
    let raw = cvt(unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_NETFILTER) })?;
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: zeroed sockaddr_nl is valid (pid 0: the kernel assigns one).
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: pointer and length of a live sockaddr_nl.
    cvt(unsafe {
        libc::bind(fd.as_raw_fd(), &addr as *const libc::sockaddr_nl as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_nl>() as u32)
    })?;
    // Acknowledgements of a failed request carry the whole request back: ask for the
    // headers only (Linux ≥ 4.3; without it only the replies are bigger).
    let _ = setsockopt(&fd, libc::SOL_NETLINK, libc::NETLINK_CAP_ACK, 1);
    Ok(fd)
}

/// Send and receive buffer sizes (the FORCE variants need CAP_NET_ADMIN, which the agent
/// has; the plain ones are capped by the sysctls).
pub(crate) fn set_buffers(fd: &OwnedFd, send: libc::c_int, recv: libc::c_int) -> std::io::Result<()> {
    if setsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, send).is_err() {
        setsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, send)?;
    }
    if setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, recv).is_err() {
        setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, recv)?;
    }
    Ok(())
}

pub(crate) fn setsockopt(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> std::io::Result<()> {
    // SAFETY: pointer and length of a live c_int.
    cvt(unsafe { libc::setsockopt(fd.as_raw_fd(), level, name, &v as *const libc::c_int as *const libc::c_void, std::mem::size_of::<libc::c_int>() as u32) })
        .map(|_| ())
}

/// Send `bytes` to the kernel.
pub(crate) fn send(fd: &OwnedFd, bytes: &[u8]) -> std::io::Result<()> {
    // SAFETY: zeroed sockaddr_nl is valid (pid 0: the kernel).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: buffer and address pointers/lengths of live values.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            bytes.as_ptr().cast(),
            bytes.len(),
            0,
            &kernel as *const libc::sockaddr_nl as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One `recv` into `buf` (blocking unless `flags` says otherwise): the bytes received.
pub(crate) fn recv(fd: &OwnedFd, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<usize> {
    // SAFETY: buffer pointer and length of a live slice.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), flags) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}
