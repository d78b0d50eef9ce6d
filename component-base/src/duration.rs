//! Durations as Kubernetes users type them: Go's `time.ParseDuration` syntax — a sequence
//! of decimal numbers, each with a unit (`ns`, `us`/`µs`, `ms`, `s`, `m`, `h`): `1m30s`,
//! `1.5h`, `300ms`, `2h45m`. A bare number is seconds (`15`), as the controller's flags
//! always took it; `0` is zero. Negative durations are refused: no flag takes one.

use std::time::Duration;

const UNITS: [(&str, f64); 7] = [("ns", 1e-9), ("us", 1e-6), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0)];

/// Parse a duration (see the module docs); the error says what is accepted.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    let bad = |why: &str| format!("invalid duration {text:?}: {why}; e.g. 1m30s, 500ms, 1.5h, or 15 (seconds)");
    if s.is_empty() {
        return Err(bad("empty"));
    }
    if s.starts_with('-') {
        return Err(bad("must not be negative"));
    }
    let s = s.strip_prefix('+').unwrap_or(s);
    // A bare number: seconds.
    if let Ok(n) = s.parse::<f64>() {
        return seconds(n).ok_or_else(|| bad("out of range"));
    }
    let mut rest = s;
    let mut total = 0f64;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        if digits == 0 {
            return Err(bad("expected a number"));
        }
        let n: f64 = rest[..digits].parse().map_err(|_| bad("expected a number"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        let Some((_, scale)) = UNITS.iter().find(|(u, _)| *u == unit) else {
            return Err(bad(if unit.is_empty() { "missing unit" } else { "unknown unit (ns, us, ms, s, m, h)" }));
        };
        total += n * scale;
        rest = &rest[unit_len..];
    }
    seconds(total).ok_or_else(|| bad("out of range"))
}

fn seconds(n: f64) -> Option<Duration> {
    (n.is_finite() && n >= 0.0).then(|| Duration::try_from_secs_f64(n).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_and_bare_seconds() {
        let ok = |s: &str, d: Duration| assert_eq!(parse_duration(s), Ok(d), "{s}");
        ok("1m30s", Duration::from_secs(90));
        ok("2h45m", Duration::from_secs(9900));
        ok("1.5h", Duration::from_secs(5400));
        ok("500ms", Duration::from_millis(500));
        ok("300us", Duration::from_micros(300));
        ok("300µs", Duration::from_micros(300));
        ok("10ns", Duration::from_nanos(10));
        ok("5s", Duration::from_secs(5));
        ok("3m", Duration::from_secs(180));
        ok("15", Duration::from_secs(15));
        ok(" 1.5s ", Duration::from_millis(1500));
        ok("0", Duration::ZERO);
        ok("0s", Duration::ZERO);
        ok("+2s", Duration::from_secs(2));
    }

    #[test]
    fn what_is_refused_says_why() {
        for (s, why) in [("", "empty"), ("-1s", "negative"), ("1x", "unknown unit"), ("1m30", "missing unit"), ("s", "expected a number"), ("1..2s", "expected a number"), ("1e400", "out of range")] {
            let e = parse_duration(s).expect_err(s);
            assert!(e.contains(why), "{s}: {e}");
            assert!(e.contains("1m30s"), "{s}: the error teaches the syntax: {e}");
        }
    }
}
