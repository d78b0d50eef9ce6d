//! Units of the command line that are not Kubernetes' or etcd's: durations as the flags of
//! every subcommand spell them. A leaf: it knows nothing of the layers that use it.

use std::time::Duration;

/// Parse `500ms`, `5s`, `3m`, `1h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected a number with a unit, e.g. 500ms, 5s, 3m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("invalid duration {s:?}: unit must be ms, s, m or h")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("invalid duration {s:?}: must be a non-negative time"));
    }
    Duration::try_from_secs_f64(secs).map_err(|_| format!("invalid duration {s:?}: too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_each_unit_and_bare_seconds() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("15"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("3m"), Ok(Duration::from_secs(180)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration(" 1.5s "), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn what_is_not_a_duration_says_what_is_allowed() {
        assert_eq!(parse_duration("5d").unwrap_err(), "invalid duration \"5d\": unit must be ms, s, m or h");
        assert_eq!(parse_duration("s").unwrap_err(), "invalid duration \"s\": expected a number with a unit, e.g. 500ms, 5s, 3m");
        assert!(parse_duration("1e400s").is_err());
    }
}
