//! Capacity you can plan with: per range and per band (static, dynamic) the addresses used
//! and free, the allocations and releases of the recent past (from the address history,
//! [`crate::history`]), and when the range runs full at that pace. Pure: the ranges, the
//! allocated addresses, the history and the time in; the report out (`clusterip capacity`
//! prints it).

use std::net::IpAddr;

use serde::Serialize;

use crate::cidr::ServiceCidr;
use crate::history::{Entry, Transition};

/// The windows rates are counted over, longest last: the forecast uses the longest one the
/// history covers.
pub const WINDOWS: [(&str, i64); 3] = [("1h", 3600), ("24h", 86_400), ("7d", 7 * 86_400)];

/// One band of a range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Band {
    pub size: u64,
    pub used: u64,
    pub free: u64,
}

/// Allocations and releases in one window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rate {
    pub window: &'static str,
    pub allocated: u64,
    pub released: u64,
}

/// One range.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RangeCapacity {
    pub cidr: String,
    pub size: u64,
    pub used: u64,
    pub free: u64,
    /// The band kept for requested addresses (Kubernetes' `min(max(16, size/16), 256)`).
    pub static_band: Band,
    /// The band dynamic allocations take first.
    pub dynamic_band: Band,
    /// Per window the history covers wholly.
    pub rates: Vec<Rate>,
    /// Net allocations per day over the longest covered window (allocated − released).
    pub net_per_day: Option<f64>,
    /// Days until the range is full at that pace; None when it is not filling (or no
    /// window is covered).
    pub days_to_full: Option<f64>,
}

/// The report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Capacity {
    pub ranges: Vec<RangeCapacity>,
    /// The first moment the history covers (RFC 3339), if it holds anything.
    pub history_from: Option<String>,
}

/// The capacity of `ranges` holding `allocated`, with rates from `log` as of `now` (Unix
/// seconds). A window counts only when the history reaches back over all of it.
pub fn report(ranges: &[ServiceCidr], allocated: &[IpAddr], log: &[Entry], now: i64) -> Capacity {
    let first = log.iter().map(|e| e.at).min();
    let covered: Vec<(&'static str, i64)> = WINDOWS.iter().copied().filter(|(_, secs)| first.is_some_and(|f| f <= now - secs)).collect();
    let ranges = ranges
        .iter()
        .map(|c| {
            let band = c.band_offset();
            let (mut static_used, mut dynamic_used) = (0u64, 0u64);
            for off in allocated.iter().filter_map(|ip| c.offset_of(*ip)) {
                if off < band {
                    static_used += 1;
                } else {
                    dynamic_used += 1;
                }
            }
            let used = static_used + dynamic_used;
            let rates: Vec<Rate> = covered
                .iter()
                .map(|(window, secs)| {
                    let mut r = Rate { window, allocated: 0, released: 0 };
                    for e in log.iter().filter(|e| e.at > now - secs && c.contains(e.address)) {
                        match e.change {
                            Transition::Allocated => r.allocated += 1,
                            Transition::Released | Transition::ReleasedBefore => r.released += 1,
                            // (The change a decision made has its own line, counted above.)
                            Transition::Decided(_) => {}
                        }
                    }
                    r
                })
                .collect();
            let net_per_day = rates.last().zip(covered.last()).map(|(r, (_, secs))| (r.allocated as f64 - r.released as f64) * 86_400.0 / *secs as f64);
            let free = c.size() - used.min(c.size());
            RangeCapacity {
                cidr: c.to_string(),
                size: c.size(),
                used,
                free,
                static_band: Band { size: band, used: static_used, free: band.saturating_sub(static_used) },
                dynamic_band: Band { size: c.size() - band, used: dynamic_used, free: (c.size() - band).saturating_sub(dynamic_used) },
                rates,
                net_per_day,
                days_to_full: net_per_day.filter(|n| *n > 0.0).map(|n| free as f64 / n),
            }
        })
        .collect();
    Capacity { ranges, history_from: first.and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok()).map(|t| t.to_string()) }
}

impl std::fmt::Display for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{:<24} {:>9} {:>9} {:>9} {:>17} {:>19} {:>12} {:>12}", "RANGE", "SIZE", "USED", "FREE", "STATIC USED/SIZE", "DYNAMIC USED/SIZE", "NET PER DAY", "FULL IN")?;
        for r in &self.ranges {
            let net = r.net_per_day.map(|n| format!("{n:+.1}")).unwrap_or_else(|| "-".into());
            let full = match (r.free, r.days_to_full) {
                (0, _) => "full".to_string(),
                (_, Some(d)) => format!("{d:.1} days"),
                (_, None) if r.net_per_day.is_some() => "not filling".into(),
                _ => "-".into(),
            };
            writeln!(
                f,
                "{:<24} {:>9} {:>9} {:>9} {:>17} {:>19} {:>12} {:>12}",
                r.cidr,
                r.size,
                r.used,
                r.free,
                format!("{}/{}", r.static_band.used, r.static_band.size),
                format!("{}/{}", r.dynamic_band.used, r.dynamic_band.size),
                net,
                full
            )?;
        }
        for r in self.ranges.iter().filter(|r| !r.rates.is_empty()) {
            let rates: Vec<String> = r.rates.iter().map(|x| format!("{}: +{} -{}", x.window, x.allocated, x.released)).collect();
            writeln!(f, "{}: {}", r.cidr, rates.join(", "))?;
        }
        match &self.history_from {
            Some(from) => write!(f, "rates from the address history, which begins {from}; the forecast uses the longest window it covers (1h, 24h, 7d)"),
            None => write!(f, "no address history: no rates and no forecast (the leader records it: --address-history-chunks)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(at: i64, change: Transition, ip: &str) -> Entry {
        Entry { at, change, address: ip.parse().expect("ip"), parent: "services/a/b".into(), manager: "m".into() }
    }

    /// A /24 (static band 16): used per band; over a covered 24 h window 30 allocations and
    /// 10 releases are +20 a day, and its 201 free addresses last 10.05 days; the 7 d window
    /// is not covered (the history is 2 days old), nor used for the forecast.
    #[test]
    fn bands_rates_and_the_forecast() {
        let c = ServiceCidr::parse("10.96.0.0/24").expect("range");
        let now = 10 * 86_400;
        let allocated: Vec<IpAddr> = (1..=53).map(|n| format!("10.96.0.{n}").parse().expect("ip")).collect();
        let mut log = vec![e(now - 2 * 86_400, Transition::Allocated, "10.96.0.1")];
        log.extend((0..30).map(|i| e(now - 3600 * 2 - i, Transition::Allocated, "10.96.0.20")));
        log.extend((0..10).map(|i| e(now - 100 - i, Transition::Released, "10.96.0.20")));
        log.push(e(now - 50, Transition::Allocated, "10.97.0.1"));
        let cap = report(&[c], &allocated, &log, now);
        let r = &cap.ranges[0];
        assert_eq!((r.size, r.used, r.free), (254, 53, 201));
        assert_eq!(r.static_band, Band { size: 16, used: 16, free: 0 });
        assert_eq!(r.dynamic_band, Band { size: 238, used: 37, free: 201 });
        assert_eq!(r.rates, vec![Rate { window: "1h", allocated: 0, released: 10 }, Rate { window: "24h", allocated: 30, released: 10 }]);
        assert_eq!(r.net_per_day, Some(20.0));
        assert_eq!(r.days_to_full, Some(201.0 / 20.0));
        assert!(cap.to_string().contains(&format!("{:.1} days", 201.0 / 20.0)), "{cap}");
        // No history: no rates, no forecast.
        let none = report(&[ServiceCidr::parse("10.96.0.0/24").expect("range")], &allocated, &[], now);
        assert_eq!((none.ranges[0].rates.len(), none.ranges[0].days_to_full, none.history_from.clone()), (0, None, None));
    }
}
