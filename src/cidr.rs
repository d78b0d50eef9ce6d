//! A service CIDR as Kubernetes' IPAddress allocator sees it: an ordered set of usable
//! addresses, numbered by *offset* from the first usable address, split into a static band
//! (the lowest `offset` addresses, kept for requested addresses) and a dynamic band.
//!
//! - IPv4 excludes the network and the broadcast address: 2^h − 2 usable.
//! - IPv6 excludes only the network address (the all-ones address is usable): 2^h − 1.
//!   The shortest IPv6 prefix is /64, so every size fits a `u64`.
//! - Band split (KEP-3070): `0` when the raw CIDR size 2^h ≤ 16, else
//!   `clamp(2^h / 16, 16, 256)`.
//!
//! Parsing is strict: host bits, IPv4 leading zeros, IPv4-mapped IPv6, zone indexes and
//! out-of-bounds prefixes are errors that say what was wrong and what is allowed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::Serialize;

/// An IP family, spelled as Kubernetes spells it ("IPv4", "IPv6"). The one home of the
/// family and its texts: from an address [`Family::of`], from a range
/// [`ServiceCidr::family`], to and from Kubernetes' `ipFamilies` and `ip-family` texts
/// [`Family::as_str`] / [`Family::parse`] (and `Display`), the number of the snapshot
/// format and the CLI [`Family::version`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Family {
    IPv4,
    IPv6,
}

impl Family {
    /// Both families, in Kubernetes' order (its list of supported `ipFamilies` values).
    pub const ALL: [Family; 2] = [Family::IPv4, Family::IPv6];

    /// The family of an address.
    pub fn of(ip: IpAddr) -> Self {
        if ip.is_ipv4() {
            Family::IPv4
        } else {
            Family::IPv6
        }
    }

    /// Kubernetes' spelling, as in `spec.ipFamilies` and the `ip-family` label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Family::IPv4 => "IPv4",
            Family::IPv6 => "IPv6",
        }
    }

    /// Parses "IPv4" / "IPv6" (Kubernetes' spelling, exact case).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "IPv4" => Some(Family::IPv4),
            "IPv6" => Some(Family::IPv6),
            _ => None,
        }
    }

    /// The IP version: 4 or 6.
    pub fn version(&self) -> u8 {
        match self {
            Family::IPv4 => 4,
            Family::IPv6 => 6,
        }
    }

    /// The other family (for dual-stack).
    pub fn other(&self) -> Self {
        match self {
            Family::IPv4 => Family::IPv6,
            Family::IPv6 => Family::IPv4,
        }
    }

    fn bits(&self) -> u8 {
        match self {
            Family::IPv4 => 32,
            Family::IPv6 => 128,
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a CIDR or an address was refused. The text is one line: what was wrong, what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CidrError(String);

impl CidrError {
    fn new(msg: impl Into<String>) -> Self {
        CidrError(msg.into())
    }
}

/// Shortest IPv6 service CIDR prefix Kubernetes accepts.
pub const MIN_IPV6_PREFIX: u8 = 64;

/// Parses one IP address strictly: no IPv4 leading zeros (`010.0.0.1` is ambiguous: octal or
/// decimal), no IPv4-mapped IPv6 (`::ffff:1.2.3.4`), no zone index, no surrounding spaces.
pub fn parse_ip(s: &str) -> Result<IpAddr, CidrError> {
    if s.is_empty() {
        return Err(CidrError::new("invalid IP address \"\": empty; expected an IPv4 (10.96.0.10) or IPv6 (fd00::10) address"));
    }
    if s.trim() != s {
        return Err(CidrError::new(format!("invalid IP address {s:?}: surrounding whitespace is not allowed")));
    }
    if s.contains('%') {
        return Err(CidrError::new(format!("invalid IP address {s:?}: a zone index (%...) is not allowed")));
    }
    if s.contains(':') {
        let ip: Ipv6Addr = s
            .parse()
            .map_err(|_| CidrError::new(format!("invalid IP address {s:?}: not a valid IPv6 address")))?;
        if let Some(v4) = ip.to_ipv4_mapped() {
            return Err(CidrError::new(format!(
                "invalid IP address {s:?}: IPv4-mapped IPv6 addresses are not allowed; use the IPv4 form {v4}"
            )));
        }
        return Ok(IpAddr::V6(ip));
    }
    check_ipv4_octets(s)?;
    let ip: Ipv4Addr = s
        .parse()
        .map_err(|_| CidrError::new(format!("invalid IP address {s:?}: not a valid IPv4 or IPv6 address")))?;
    Ok(IpAddr::V4(ip))
}

/// Reads an address as Kubernetes reads addresses already stored (`netutils.ParseIPSloppy`,
/// the pre-1.17 Go parser its repair loops use): IPv4 octets may carry leading zeros, read
/// as decimal (`010.0.0.1` is 10.0.0.1); an IPv4-mapped IPv6 address is that IPv4 address.
/// For Services stored before the apiserver validated strictly, never for new input (that is
/// [`parse_ip`]). No zone index, no surrounding spaces.
pub fn parse_ip_sloppy(s: &str) -> Result<IpAddr, CidrError> {
    if s.contains(':') || s.trim() != s {
        return parse_ip(s).or_else(|e| match s.parse::<Ipv6Addr>() {
            Ok(ip) if !s.contains('%') => Ok(ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4)),
            _ => Err(e),
        });
    }
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for o in octets.iter_mut() {
        let part = parts.next().filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        let value = part.map(|p| p.trim_start_matches('0')).filter(|d| d.len() <= 3).and_then(|d| if d.is_empty() { Some(0) } else { d.parse::<u16>().ok() });
        match value.and_then(|v| u8::try_from(v).ok()) {
            Some(v) => *o = v,
            None => return Err(CidrError::new(format!("invalid IP address {s:?}: not a valid IPv4 or IPv6 address"))),
        }
    }
    if parts.next().is_some() {
        return Err(CidrError::new(format!("invalid IP address {s:?}: not a valid IPv4 or IPv6 address")));
    }
    Ok(IpAddr::V4(Ipv4Addr::from(octets)))
}

/// Refuses IPv4 octets written with a leading zero, naming the canonical spelling.
fn check_ipv4_octets(s: &str) -> Result<(), CidrError> {
    let octets: Vec<&str> = s.split('.').collect();
    let leading_zero = octets.iter().any(|o| o.len() > 1 && o.starts_with('0') && o.bytes().all(|b| b.is_ascii_digit()));
    if leading_zero {
        let canonical: Vec<String> = octets.iter().map(|o| o.trim_start_matches('0')).map(|o| if o.is_empty() { "0".to_string() } else { o.to_string() }).collect();
        return Err(CidrError::new(format!(
            "invalid IP address {s:?}: an octet has a leading zero (ambiguous: octal or decimal); write {}",
            canonical.join(".")
        )));
    }
    Ok(())
}

/// A first..last run of addresses with its size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Band {
    pub first: IpAddr,
    pub last: IpAddr,
    pub size: u64,
}

/// A service CIDR: canonical (no host bits), with the usable-address and band facts computed
/// once.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceCidr {
    family: Family,
    /// Network address as an integer (IPv4 in the low 32 bits).
    network: u128,
    prefix: u8,
    /// Usable addresses (IPv4: 2^h − 2, IPv6: 2^h − 1, never negative).
    size: u64,
    /// Size of the static band (KEP-3070), ≤ size.
    band_offset: u64,
}

impl ServiceCidr {
    /// Parses a service CIDR strictly (see the module docs).
    pub fn parse(s: &str) -> Result<Self, CidrError> {
        let (addr, prefix) = s.split_once('/').ok_or_else(|| {
            CidrError::new(format!(
                "invalid service CIDR {s:?}: expected ADDRESS/PREFIX, for example 10.96.0.0/12 or fd00:10:96::/112"
            ))
        })?;
        let ip = parse_ip(addr).map_err(|e| CidrError::new(format!("invalid service CIDR {s:?}: {e}")))?;
        let family = Family::of(ip);
        let max = family.bits();
        let canonical_digits = !prefix.is_empty() && prefix.bytes().all(|b| b.is_ascii_digit()) && (prefix == "0" || !prefix.starts_with('0'));
        let prefix: u8 = match prefix.parse::<u8>() {
            Ok(p) if canonical_digits && p <= max => p,
            _ => {
                return Err(CidrError::new(format!(
                    "invalid service CIDR {s:?}: prefix length {prefix:?} is not a number from 0 to {max} ({family})"
                )))
            }
        };
        if family == Family::IPv6 && prefix < MIN_IPV6_PREFIX {
            return Err(CidrError::new(format!(
                "invalid service CIDR {s:?}: shortest allowed prefix length for service CIDR is {MIN_IPV6_PREFIX}, got {prefix}"
            )));
        }
        let value = ip_to_u128(ip);
        let host_bits = u32::from(max - prefix);
        let mask = if host_bits >= 128 { 0 } else { !((1u128 << host_bits) - 1) };
        let mask = if family == Family::IPv4 { mask & 0xffff_ffff } else { mask };
        let network = value & mask;
        if network != value {
            let canonical = format!("{}/{prefix}", u128_to_ip(family, network));
            return Err(CidrError::new(format!(
                "invalid service CIDR {s:?}: host bits are set; the canonical form is {canonical}"
            )));
        }
        Ok(Self::from_parts(family, network, prefix))
    }

    fn from_parts(family: Family, network: u128, prefix: u8) -> Self {
        let host_bits = u32::from(family.bits() - prefix);
        // host_bits ≤ 64 for IPv6 (prefix ≥ 64) and ≤ 32 for IPv4.
        let raw: u128 = 1u128 << host_bits;
        let size = match family {
            Family::IPv4 => raw.saturating_sub(2) as u64,
            Family::IPv6 => (raw - 1) as u64,
        };
        let band_offset = if raw <= 16 { 0 } else { (raw / 16).clamp(16, 256) as u64 };
        Self { family, network, prefix, size, band_offset }
    }

    pub fn family(&self) -> Family {
        self.family
    }

    pub fn prefix_len(&self) -> u8 {
        self.prefix
    }

    /// The network address.
    pub fn network(&self) -> IpAddr {
        u128_to_ip(self.family, self.network)
    }

    /// Usable addresses.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Size of the static band (Kubernetes' `calculateRangeOffset`).
    pub fn band_offset(&self) -> u64 {
        self.band_offset
    }

    /// The number of addresses the CIDR spans, network and broadcast included (2^h).
    pub fn raw_size(&self) -> u128 {
        1u128 << u32::from(self.family.bits() - self.prefix)
    }

    /// Whether `ip` is one of the usable addresses (not the network address, not the IPv4
    /// broadcast address, not another family).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.offset_of(ip).is_some()
    }

    /// Whether `ip` lies anywhere inside the CIDR, network and broadcast included.
    pub fn covers(&self, ip: IpAddr) -> bool {
        Family::of(ip) == self.family && {
            let v = ip_to_u128(ip);
            v >= self.network && v - self.network < self.raw_size()
        }
    }

    /// Offset of a usable address (0 = the first usable address), or None.
    pub fn offset_of(&self, ip: IpAddr) -> Option<u64> {
        if Family::of(ip) != self.family {
            return None;
        }
        let v = ip_to_u128(ip);
        if v <= self.network {
            return None;
        }
        let off = v - self.network - 1;
        if off < u128::from(self.size) {
            Some(off as u64)
        } else {
            None
        }
    }

    /// The usable address at `offset`, or None past the end.
    pub fn ip_at(&self, offset: u64) -> Option<IpAddr> {
        if offset >= self.size {
            return None;
        }
        Some(u128_to_ip(self.family, self.network + 1 + u128::from(offset)))
    }

    /// First and last usable address, or None for a CIDR with none (/31, /32, /128).
    pub fn usable(&self) -> Option<Band> {
        self.band(0, self.size)
    }

    /// The static band: the lowest `band_offset` usable addresses (None when empty).
    pub fn static_band(&self) -> Option<Band> {
        self.band(0, self.band_offset)
    }

    /// The dynamic band: every usable address above the static band (None when empty).
    pub fn dynamic_band(&self) -> Option<Band> {
        self.band(self.band_offset, self.size)
    }

    fn band(&self, from: u64, to: u64) -> Option<Band> {
        if from >= to {
            return None;
        }
        Some(Band { first: self.ip_at(from)?, last: self.ip_at(to - 1)?, size: to - from })
    }

    /// Whether two CIDRs share any address.
    pub fn overlaps(&self, other: &ServiceCidr) -> bool {
        self.covers(other.network()) || other.covers(self.network())
    }

    /// Whether every address of `other` is inside `self`.
    pub fn contains_cidr(&self, other: &ServiceCidr) -> bool {
        self.family == other.family && self.prefix <= other.prefix && self.covers(other.network())
    }

    /// The facts `clusterip range` prints.
    pub fn facts(&self) -> RangeFacts {
        let usable = self.usable();
        RangeFacts {
            cidr: self.to_string(),
            family: self.family,
            size: self.size,
            first: usable.as_ref().map(|b| b.first),
            last: usable.as_ref().map(|b| b.last),
            offset: self.band_offset,
            static_band: self.static_band(),
            dynamic: self.dynamic_band(),
        }
    }
}

impl std::fmt::Display for ServiceCidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix)
    }
}

impl std::str::FromStr for ServiceCidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ServiceCidr::parse(s)
    }
}

/// The facts of a range, as `clusterip range -o json` prints them (exactly these keys).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RangeFacts {
    pub cidr: String,
    pub family: Family,
    pub size: u64,
    pub first: Option<IpAddr>,
    pub last: Option<IpAddr>,
    pub offset: u64,
    #[serde(rename = "static")]
    pub static_band: Option<Band>,
    pub dynamic: Option<Band>,
}

impl std::fmt::Display for RangeFacts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let opt = |ip: &Option<IpAddr>| ip.map(|i| i.to_string()).unwrap_or_else(|| "-".into());
        let band = |b: &Option<Band>| match b {
            Some(b) => format!("{} - {} ({} addresses)", b.first, b.last, b.size),
            None => "none".into(),
        };
        writeln!(f, "cidr:     {}", self.cidr)?;
        writeln!(f, "family:   {}", self.family)?;
        writeln!(f, "size:     {} usable addresses", self.size)?;
        writeln!(f, "first:    {}", opt(&self.first))?;
        writeln!(f, "last:     {}", opt(&self.last))?;
        writeln!(f, "offset:   {} (static band size)", self.offset)?;
        writeln!(f, "static:   {}", band(&self.static_band))?;
        write!(f, "dynamic:  {}", band(&self.dynamic))
    }
}

fn ip_to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn u128_to_ip(family: Family, v: u128) -> IpAddr {
    match family {
        Family::IPv4 => IpAddr::V4(Ipv4Addr::from(v as u32)),
        Family::IPv6 => IpAddr::V6(Ipv6Addr::from(v)),
    }
}

#[cfg(test)]
mod sloppy_tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stored_legacy_forms_read_as_kubernetes_reads_them() {
        let ok = |s: &str| parse_ip_sloppy(s).unwrap_or_else(|e| panic!("{s}: {e}")).to_string();
        assert_eq!(ok("198.19.010.5"), "198.19.10.5");
        assert_eq!(ok("010.096.000.001"), "10.96.0.1");
        assert_eq!(ok("0000198.19.0.5"), "198.19.0.5");
        assert_eq!(ok("::ffff:198.19.1.5"), "198.19.1.5");
        assert_eq!(ok("fd00:10:96:0::5"), "fd00:10:96::5");
        assert_eq!(ok("10.96.0.1"), "10.96.0.1");
        for bad in ["", " 10.96.0.1", "10.96.0", "10.96.0.1.2", "10.96.0.256", "10.96.0.1000", "10..0.1", "10.96.0.x", "fd00::1%eth0", "not-an-ip", "+1.2.3.4"] {
            assert!(parse_ip_sloppy(bad).is_err(), "{bad:?} accepted");
        }
    }

    proptest! {
        /// Any padding of any address reads as the address; a strict read of the canonical
        /// text agrees.
        #[test]
        fn zero_padded_octets_read_as_decimal(a in any::<[u8; 4]>(), pad in proptest::collection::vec(0usize..4, 4)) {
            let text: Vec<String> = a.iter().zip(&pad).map(|(o, p)| format!("{}{o}", "0".repeat(*p))).collect();
            let ip = IpAddr::V4(Ipv4Addr::from(a));
            prop_assert_eq!(parse_ip_sloppy(&text.join(".")).ok(), Some(ip));
            prop_assert_eq!(parse_ip_sloppy(&ip.to_string()).ok(), parse_ip(&ip.to_string()).ok());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> ServiceCidr {
        ServiceCidr::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn a_family_from_an_address_a_range_and_kubernetes_texts() {
        assert_eq!(Family::of("198.19.0.1".parse().expect("ip")), Family::IPv4);
        assert_eq!(Family::of("fd00::1".parse().expect("ip")), Family::IPv6);
        assert_eq!(cidr("fd00:10:96::/112").family(), Family::IPv6);
        for f in Family::ALL {
            assert_eq!(Family::parse(f.as_str()), Some(f));
            assert_eq!(f.to_string(), f.as_str());
            assert_eq!(f.other().other(), f);
        }
        assert_eq!(Family::ALL.map(|f| f.as_str()), ["IPv4", "IPv6"]);
        assert_eq!(Family::ALL.map(|f| f.version()), [4, 6]);
        // Exact case, as Kubernetes validates spec.ipFamilies.
        assert_eq!(Family::parse("ipv4"), None);
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test ip")
    }

    #[test]
    fn band_offset_matches_kubernetes_table() {
        // Kubernetes' Test_calculateRangeOffset.
        for (c, want) in [
            ("192.168.1.1/32", 0),
            ("fd00::1/128", 0),
            ("192.168.1.0/30", 0),
            ("fd00::/126", 0),
            ("192.168.1.0/28", 0),
            ("192.168.1.0/27", 16),
            ("fd00::/124", 0),
            ("fd00::/122", 16),
            ("192.168.0.0/22", 64),
            ("fd00::/118", 64),
            ("10.0.0.0/8", 256),
            ("fd00::/64", 256),
        ] {
            assert_eq!(cidr(c).band_offset(), want, "{c}");
        }
    }

    #[test]
    fn usable_sizes_per_family() {
        for (c, size) in [
            ("198.18.0.0/30", 2u64),
            ("198.18.0.0/28", 14),
            ("198.18.0.0/27", 30),
            ("198.18.0.0/24", 254),
            ("198.18.0.0/22", 1022),
            ("10.96.0.0/12", 1_048_574),
            ("10.0.0.0/8", 16_777_214),
            ("198.18.0.1/32", 0),
            ("198.18.0.0/31", 0),
            ("fd00::/127", 1),
            ("fd00::/124", 15),
            ("fd00::/122", 63),
            ("fd00::/120", 255),
            ("fd00::/118", 1023),
            ("fd00::/112", 65535),
            ("fd00::/108", 1_048_575),
            ("fd00::/64", u64::MAX),
            ("fd00::1/128", 0),
        ] {
            assert_eq!(cidr(c).size(), size, "{c}");
        }
    }

    #[test]
    fn membership_excludes_network_and_ipv4_broadcast() {
        let v4 = cidr("198.18.1.0/24");
        assert!(!v4.contains(ip("198.18.1.0")), "network");
        assert!(!v4.contains(ip("198.18.1.255")), "broadcast");
        assert!(v4.contains(ip("198.18.1.1")));
        assert!(v4.contains(ip("198.18.1.254")));
        assert!(!v4.contains(ip("198.18.2.1")));
        assert!(!v4.contains(ip("fd00::1")));
        assert!(v4.covers(ip("198.18.1.255")));

        let v6 = cidr("fd00::/120");
        assert!(!v6.contains(ip("fd00::")), "network");
        assert!(v6.contains(ip("fd00::ff")), "the IPv6 all-ones address is usable");
        assert!(v6.contains(ip("fd00::1")));
        assert!(!v6.contains(ip("fd00::100")));

        let v6_64 = cidr("fd00:1:2:3::/64");
        assert_eq!(v6_64.ip_at(u64::MAX - 1), Some(ip("fd00:1:2:3:ffff:ffff:ffff:ffff")));
        assert_eq!(v6_64.offset_of(ip("fd00:1:2:3:ffff:ffff:ffff:ffff")), Some(u64::MAX - 1));
        assert_eq!(v6_64.ip_at(u64::MAX), None);
    }

    #[test]
    fn bands_split_the_usable_addresses() {
        let c = cidr("198.18.0.0/27");
        assert_eq!(c.static_band(), Some(Band { first: ip("198.18.0.1"), last: ip("198.18.0.16"), size: 16 }));
        assert_eq!(c.dynamic_band(), Some(Band { first: ip("198.18.0.17"), last: ip("198.18.0.30"), size: 14 }));
        let small = cidr("198.18.0.0/28");
        assert_eq!(small.static_band(), None);
        assert_eq!(small.dynamic_band().map(|b| b.size), Some(14));
        let twelve = cidr("10.96.0.0/12");
        assert_eq!(twelve.static_band().map(|b| (b.first, b.last)), Some((ip("10.96.0.1"), ip("10.96.1.0"))));
        assert_eq!(twelve.dynamic_band().map(|b| (b.first, b.last, b.size)), Some((ip("10.96.1.1"), ip("10.111.255.254"), 1_048_318)));
        let none = cidr("198.18.0.7/32");
        assert_eq!((none.usable(), none.static_band(), none.dynamic_band()), (None, None, None));
    }

    #[test]
    fn offsets_round_trip_at_the_edges() {
        for c in ["198.18.0.0/30", "198.18.0.0/22", "10.0.0.0/8", "fd00::/127", "fd00::/108", "fd00::/64"] {
            let c = cidr(c);
            for off in [0, 1, c.size() / 2, c.size() - 1].into_iter().filter(|&o| o < c.size()) {
                let at = c.ip_at(off).expect("in range");
                assert_eq!(c.offset_of(at), Some(off), "{c} offset {off}");
            }
        }
    }

    #[test]
    fn strict_parse_errors_say_what_is_wrong() {
        let err = |s: &str| ServiceCidr::parse(s).expect_err(s).to_string();
        assert!(err("10.96.0.1/12").contains("host bits are set; the canonical form is 10.96.0.0/12"));
        assert!(err("010.96.0.0/12").contains("leading zero"));
        assert!(err("010.96.0.0/12").contains("write 10.96.0.0"));
        assert!(err("::ffff:10.96.0.0/108").contains("IPv4-mapped"));
        assert!(err("10.96.0.0/33").contains("0 to 32"));
        assert!(err("fd00::/129").contains("0 to 128"));
        assert!(err("10.96.0.0/012").contains("prefix length"));
        assert!(err("10.96.0.0/-1").contains("prefix length"));
        assert_eq!(
            err("fd00::/48"),
            "invalid service CIDR \"fd00::/48\": shortest allowed prefix length for service CIDR is 64, got 48"
        );
        assert!(err("10.96.0.0").contains("expected ADDRESS/PREFIX"));
        assert!(err("").contains("expected ADDRESS/PREFIX"));
        assert!(err(" 10.96.0.0/12").contains("whitespace"));
        assert!(err("fe80::%eth0/64").contains("zone"));
        assert!(err("10.96.0/12").contains("not a valid"));
    }

    #[test]
    fn parse_ip_is_strict() {
        assert!(parse_ip("10.0.0.1").is_ok());
        assert!(parse_ip("fd00::1").is_ok());
        assert!(parse_ip("10.0.0.01").unwrap_err().to_string().contains("write 10.0.0.1"));
        assert!(parse_ip("::ffff:10.0.0.1").unwrap_err().to_string().contains("use the IPv4 form 10.0.0.1"));
        assert!(parse_ip("None").is_err());
        assert!(parse_ip("").is_err());
        assert!(parse_ip("1.2.3.4.5").is_err());
    }

    #[test]
    fn canonical_text_and_overlap() {
        assert_eq!(cidr("FD00:0:0:0::/112").to_string(), "fd00::/112");
        let a = cidr("198.19.0.0/16");
        let b = cidr("198.19.0.0/17");
        let c = cidr("198.20.0.0/16");
        assert!(a.overlaps(&b) && b.overlaps(&a));
        assert!(!a.overlaps(&c));
        assert!(a.contains_cidr(&b) && !b.contains_cidr(&a));
        assert!(!a.overlaps(&cidr("fd00::/64")));
    }

    #[test]
    fn facts_json_has_exactly_the_documented_keys() {
        let v = serde_json::to_value(cidr("198.18.0.0/24").facts()).expect("json");
        let mut keys: Vec<&String> = v.as_object().expect("object").keys().collect();
        keys.sort();
        assert_eq!(keys, ["cidr", "dynamic", "family", "first", "last", "offset", "size", "static"]);
        assert_eq!(v["family"], "IPv4");
        assert_eq!(v["size"], 254);
        assert_eq!(v["offset"], 16);
        assert_eq!(v["static"]["first"], "198.18.0.1");
        assert_eq!(v["dynamic"]["last"], "198.18.0.254");
        let v = serde_json::to_value(cidr("198.18.0.0/28").facts()).expect("json");
        assert!(v["static"].is_null());
    }
}
