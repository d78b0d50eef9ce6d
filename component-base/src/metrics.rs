//! The standard `process_*` metrics every Prometheus client library exports (Go's
//! `collectors.NewProcessCollector`, the names of Prometheus' "process metrics"
//! convention), read from `/proc/self` on each scrape, so that the controller and the
//! node agent can be watched like any other Kubernetes component:
//!
//! | metric | type | from |
//! |---|---|---|
//! | `process_cpu_seconds_total` | counter | `/proc/self/stat` utime + stime, over the clock tick |
//! | `process_resident_memory_bytes` | gauge | `/proc/self/stat` rss × page size |
//! | `process_virtual_memory_bytes` | gauge | `/proc/self/stat` vsize |
//! | `process_start_time_seconds` | gauge | `/proc/self/stat` starttime over the clock tick + `/proc/stat` btime |
//! | `process_open_fds` | gauge | entries of `/proc/self/fd` |
//! | `process_max_fds` | gauge | `/proc/self/limits` "Max open files" (soft) |
//!
//! A value that cannot be read (another OS, a `/proc` without the field) is left out of the
//! scrape rather than reported as 0.



use prometheus_client::collector::Collector;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// The fields of `/proc/self/stat` the metrics need, in their units.
#[derive(Debug, Clone, PartialEq)]
pub struct Stat {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    /// Since boot, in seconds.
    pub start_seconds_after_boot: f64,
}

/// Parse `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may hold
/// spaces and parentheses itself, so fields are counted from the last `)`.
pub fn parse_stat(text: &str, ticks_per_second: u64, page_size: u64) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    // rest's first field is field 3 (state): field n is rest[n - 3].
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    let ticks = ticks_per_second.max(1) as f64;
    Some(Stat {
        cpu_seconds: (num(14)? + num(15)?) as f64 / ticks,
        start_seconds_after_boot: num(22)? as f64 / ticks,
        virtual_bytes: num(23)?,
        resident_bytes: num(24)?.saturating_mul(page_size),
    })
}

/// The boot time (`btime`, Unix seconds) from `/proc/stat`.
pub fn parse_boot_time(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("btime ")).and_then(|v| v.trim().parse().ok())
}

/// The soft limit of open files from `/proc/<pid>/limits` ("unlimited" is left out).
pub fn parse_max_fds(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..].split_whitespace().next()?.parse().ok()
}

/// Reads `/proc/self` on each scrape; register it with [`register`].
#[derive(Debug, Default)]
pub struct ProcessCollector;

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, v: Option<f64>) -> Result<(), std::fmt::Error> {
    match v {
        Some(v) => {
            let metric = ConstGauge::new(v);
            metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
        }
        None => Ok(()),
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let ticks = rustix::param::clock_ticks_per_second();
        let page = rustix::param::page_size() as u64;
        let stat = read("/proc/self/stat").and_then(|t| parse_stat(&t, ticks, page));
        if let Some(s) = &stat {
            let cpu = ConstCounter::new(s.cpu_seconds);
            cpu.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                cpu.metric_type(),
            )?)?;
        }
        let e = &mut encoder;
        gauge(e, "process_resident_memory_bytes", "Resident memory size in bytes.", stat.as_ref().map(|s| s.resident_bytes as f64))?;
        gauge(e, "process_virtual_memory_bytes", "Virtual memory size in bytes.", stat.as_ref().map(|s| s.virtual_bytes as f64))?;
        let boot = read("/proc/stat").and_then(|t| parse_boot_time(&t));
        let start = stat.as_ref().zip(boot).map(|(s, b)| b as f64 + s.start_seconds_after_boot);
        gauge(e, "process_start_time_seconds", "Start time of the process since unix epoch in seconds.", start)?;
        let fds = std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as f64);
        gauge(e, "process_open_fds", "Number of open file descriptors.", fds)?;
        let max = read("/proc/self/limits").and_then(|t| parse_max_fds(&t)).map(|v| v as f64);
        gauge(e, "process_max_fds", "Maximum number of open file descriptors.", max)?;
        Ok(())
    }
}

/// Add the `process_*` metrics to `registry` (which must have no prefix: the names are
/// the convention's own).
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(ProcessCollector));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        // A command name with a space and a parenthesis, as the kernel writes it.
        let text = "4242 (clusterip (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 9 0 12345 1000000 300 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        let s = parse_stat(text, 100, 4096).expect("parses");
        assert_eq!(s, Stat { cpu_seconds: 3.0, resident_bytes: 300 * 4096, virtual_bytes: 1_000_000, start_seconds_after_boot: 123.45 });
        assert_eq!(parse_stat("garbage", 100, 4096), None);
    }

    #[test]
    fn boot_time_and_fd_limit() {
        assert_eq!(parse_boot_time("cpu  1 2 3\nbtime 1700000000\nprocesses 5\n"), Some(1_700_000_000));
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1048576              1048576              files\n";
        assert_eq!(parse_max_fds(limits), Some(1_048_576));
        assert_eq!(parse_max_fds("Max open files            unlimited            unlimited            files\n"), None);
    }

    #[test]
    fn this_process_reports_every_metric() {
        let mut registry = Registry::default();
        register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_virtual_memory_bytes ",
            "process_start_time_seconds ",
            "process_open_fds ",
            "process_max_fds ",
        ] {
            assert!(text.contains(&format!("\n{name}")), "{name} missing in:\n{text}");
        }
        assert!(text.contains("# TYPE process_cpu_seconds counter"), "{text}");
    }
}

/// The labels of `<prefix>_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildInfoLabels {
    version: &'static str,
    commit: &'static str,
}

/// Register `build_info` (under the registry's prefix: `clusterip_build_info`,
/// `clusterip_agent_build_info`): a gauge always 1, labelled by the `version` and the
/// `commit` `binary` was built from.
pub fn register_build_info(registry: &mut Registry, binary: &str, version: &'static str, commit: &'static str) {
    let info = Family::<BuildInfoLabels, Gauge>::default();
    info.get_or_create(&BuildInfoLabels { version, commit }).set(1);
    registry.register(
        "build_info",
        format!("A metric with a constant '1' value labeled by the version and the commit {binary} was built from"),
        info,
    );
}
