//! `clusterip allocate` and `clusterip release`: operator commands on the records, also used
//! by the multi-process tests and the backend benchmark.

use std::net::IpAddr;
use std::time::Instant;

use futures::StreamExt;

use crate::cidr::{self, Family};
use crate::store::{AllocationStore, ParentRef};

use super::backend::{BackendArgs, Role};

#[derive(Debug, clap::Args)]
pub struct AllocateArgs {
    #[command(flatten)]
    pub backend: BackendArgs,

    /// Reserve these addresses (static allocation) instead of choosing.
    #[arg(long = "ip", value_name = "IP")]
    pub ips: Vec<String>,

    /// Number of addresses to choose (dynamic allocation).
    #[arg(long, default_value_t = 1)]
    pub count: usize,

    /// Family of the dynamic addresses (default: the family of the first range).
    #[arg(long, value_parser = parse_family)]
    pub family: Option<Family>,

    /// Requests in flight at once.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,

    /// The owner of the addresses, as an IPAddress parentRef: RESOURCE[.GROUP]/[NAMESPACE/]NAME
    /// (e.g. gateways.gateway.networking.k8s.io/infra/edge). Recorded with both backends
    /// (etcd: an owner key beside the map; ipaddress: the object's parentRef); the repair
    /// pass never releases an owned address, and only `clusterip release --parent` with the
    /// same owner does. A Service's addresses are recorded by the kube-apiserver itself.
    #[arg(long)]
    pub parent: Option<String>,

    /// etcd backend: answer dynamic requests for Services from an address pool of this size
    /// per range, as a controller replica does (`clusterip controller --etcd-address-pool`);
    /// 0, the default, allocates each address in a transaction. The pool is returned at the
    /// end. The fault tests run allocators of both kinds side by side.
    #[arg(long, default_value_t = 0)]
    pub etcd_address_pool: usize,
}

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub backend: BackendArgs,

    /// Addresses to release (a free or out-of-range address is a no-op).
    #[arg(required = true, value_name = "IP")]
    pub ips: Vec<String>,

    /// Release on behalf of this owner (as `clusterip allocate --parent` recorded it): an
    /// address is released only while the records name this owner. Without it, an address
    /// that has a recorded owner is not released.
    #[arg(long)]
    pub parent: Option<String>,
}

/// Kubernetes' spelling, lower case, or the version: `IPv4`, `ipv4`, `4`.
fn parse_family(s: &str) -> Result<Family, String> {
    Family::ALL
        .into_iter()
        .find(|f| s == f.as_str() || s == f.as_str().to_ascii_lowercase() || s == f.version().to_string())
        .ok_or_else(|| format!("invalid family {s:?}: use IPv4 or IPv6"))
}

/// Parse `services/default/web` or `gateways.gateway.networking.k8s.io/ns/name`.
pub fn parse_parent(s: &str) -> anyhow::Result<ParentRef> {
    let parts: Vec<&str> = s.split('/').collect();
    let (resource, namespace, name) = match parts.as_slice() {
        [r, n] => (*r, None, *n),
        [r, ns, n] => (*r, Some(ns.to_string()), *n),
        _ => anyhow::bail!("invalid --parent {s:?}: use RESOURCE[.GROUP]/[NAMESPACE/]NAME, e.g. services/default/web"),
    };
    let (resource, group) = resource.split_once('.').unwrap_or((resource, ""));
    if resource.is_empty() || name.is_empty() {
        anyhow::bail!("invalid --parent {s:?}: resource and name must not be empty");
    }
    Ok(ParentRef { group: group.into(), resource: resource.into(), namespace, name: name.into() })
}

/// Print each allocated address on stdout, a summary on stderr; exit 1 if any failed.
pub async fn allocate(args: AllocateArgs) -> anyhow::Result<i32> {
    let ips = args.ips.iter().map(|s| cidr::parse_ip(s).map_err(|e| anyhow::anyhow!("--ip {s}: {e}"))).collect::<anyhow::Result<Vec<IpAddr>>>()?;
    let parent = args.parent.as_deref().map(parse_parent).transpose()?;
    let store = args.backend.build(Role::Command { etcd_address_pool: args.etcd_address_pool }).await?.store;
    let family = match args.family {
        Some(f) => f,
        None => store.ranges().first().map(|c| c.family()).unwrap_or(Family::IPv4),
    };
    let jobs: Vec<Option<IpAddr>> = if ips.is_empty() { vec![None; args.count] } else { ips.into_iter().map(Some).collect() };
    let total = jobs.len();
    let mut failed = 0usize;
    let started = Instant::now();
    let store_ref: &dyn AllocationStore = store.as_ref();
    let parent_ref = parent.as_ref();
    let mut results = futures::stream::iter(jobs)
        .map(|job| async move {
            match job {
                Some(ip) => store_ref.allocate(ip, parent_ref).await.map(|()| ip),
                None => store_ref.allocate_next(family, parent_ref).await,
            }
        })
        .buffer_unordered(args.concurrency.max(1));
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    while let Some(r) = results.next().await {
        match r {
            Ok(ip) => {
                use std::io::Write as _;
                writeln!(out, "{ip}")?;
            }
            Err(e) => {
                failed += 1;
                eprintln!("error: {e}");
            }
        }
    }
    drop(out);
    let secs = started.elapsed().as_secs_f64();
    if args.etcd_address_pool > 0 {
        if let Err(e) = store.close().await {
            eprintln!("warning: the address pool was not returned ({e}); it expires with its lease");
        }
    }
    eprintln!(
        "allocated={} failed={failed} elapsed_s={secs:.3} ops_per_s={:.1} backend={}",
        total - failed,
        (total - failed) as f64 / secs.max(1e-9),
        store.backend()
    );
    Ok(if failed == 0 { 0 } else { 1 })
}

pub async fn release(args: ReleaseArgs) -> anyhow::Result<i32> {
    let ips = args.ips.iter().map(|s| cidr::parse_ip(s).map_err(|e| anyhow::anyhow!("{s}: {e}"))).collect::<anyhow::Result<Vec<IpAddr>>>()?;
    let parent = args.parent.as_deref().map(parse_parent).transpose()?;
    let store = args.backend.build(Role::Command { etcd_address_pool: 0 }).await?.store;
    let mut failed = 0;
    for ip in ips {
        let released = match &parent {
            Some(p) => store.release_owned(ip, p).await,
            None => store.release(ip).await,
        };
        if let Err(e) = released {
            failed += 1;
            eprintln!("error: releasing {ip}: {e}");
        }
    }
    Ok(if failed == 0 { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_as_kubernetes_spells_it_in_lower_case_or_by_version() {
        for (text, want) in [("IPv4", Family::IPv4), ("ipv4", Family::IPv4), ("4", Family::IPv4), ("IPv6", Family::IPv6), ("ipv6", Family::IPv6), ("6", Family::IPv6)] {
            assert_eq!(parse_family(text), Ok(want), "{text}");
        }
        for text in ["IPV4", "v4", "", "46"] {
            assert_eq!(parse_family(text), Err(format!("invalid family {text:?}: use IPv4 or IPv6")));
        }
    }
}
