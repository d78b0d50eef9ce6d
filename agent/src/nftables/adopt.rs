//! Adopting the table that is already in the kernel: at start (a previous agent process
//! left its rules in place, as it should) and after a failure or drift, the agent does not
//! know what the table holds. It reads the names of its chains, sets and maps, and the
//! rebuild then flushes and refills them in one transaction (kube-proxy's way) instead of
//! deleting the table: packets see either the old ruleset or the new one, never a VIP
//! missing in between, and ClientIP affinity sets keep their entries.
//!
//! Only names are read (`nft -j list chains`, `nft -t -j list sets|maps`: no rules, no
//! elements), which stays cheap at 10k Services.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;

use super::ops::{Family, SetName, TABLE};
use crate::model::{IpFamily, Protocol};
use crate::netns::Executor;
use crate::proxier::DataplaneError;

/// Names in one family's `clusterip` table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Existing {
    pub chains: BTreeSet<String>,
    pub sets: BTreeSet<String>,
    pub maps: BTreeSet<String>,
}

impl Existing {
    /// Read the family's table in the executor's namespace (empty when there is none).
    pub fn read(exec: &Executor, family: IpFamily) -> Result<Existing, DataplaneError> {
        let fam = Family(family).nft();
        let list = |args: &[&str]| -> Result<Vec<String>, DataplaneError> {
            let json = exec.run("nft", args, None)?;
            names(&json, args[args.len() - 2]).map_err(DataplaneError::Listing)
        };
        Ok(Existing {
            chains: list(&["-j", "list", "chains", fam])?.into_iter().collect(),
            sets: list(&["-t", "-j", "list", "sets", fam])?.into_iter().collect(),
            maps: list(&["-t", "-j", "list", "maps", fam])?.into_iter().collect(),
        })
    }

    /// Nothing there: a cold start, nothing that could black out.
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.sets.is_empty() && self.maps.is_empty()
    }

    /// The shard maps among the maps (`endpoint-dnat-<proto>-<k>`, `endpoint-chains-<k>`).
    pub fn shard_maps(&self) -> impl Iterator<Item = SetName> + '_ {
        self.maps.iter().filter_map(|m| parse_shard(m))
    }
}

/// The names of the objects of `kind` ("chains", "sets", "maps") of our table in an
/// `nft -j list <kind> <family>` output (which lists every table of the family).
fn names(json: &str, kind: &str) -> Result<Vec<String>, String> {
    let key = kind.trim_end_matches('s');
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("nft -j list {kind} output: {e}"))?;
    let items = v.get("nftables").and_then(|x| x.as_array()).ok_or_else(|| format!("nft -j list {kind} output without \"nftables\""))?;
    Ok(items
        .iter()
        .filter_map(|i| i.get(key))
        .filter(|o| o.get("table").and_then(|t| t.as_str()) == Some(TABLE))
        .filter_map(|o| o.get("name").and_then(|n| n.as_str()).map(str::to_string))
        .collect())
}

fn parse_shard(name: &str) -> Option<SetName> {
    if let Some(k) = name.strip_prefix("endpoint-chains-") {
        return k.parse().ok().map(SetName::EndpointChains);
    }
    let rest = name.strip_prefix("endpoint-dnat-")?;
    let (proto, k) = rest.split_once('-')?;
    let proto = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp].into_iter().find(|p| p.keyword() == proto)?;
    k.parse().ok().map(|k| SetName::EndpointDnat(proto, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_for_our_table_only() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
            {"chain": {"family": "ip", "table": "clusterip", "name": "svc-ns/a/tcp/80", "handle": 2}},
            {"chain": {"family": "ip", "table": "kube-proxy", "name": "services", "handle": 3}},
            {"chain": {"family": "ip", "table": "clusterip", "name": "nat-output", "handle": 1, "type": "nat"}}]}"#;
        assert_eq!(names(json, "chains").expect("parse"), vec!["svc-ns/a/tcp/80".to_string(), "nat-output".to_string()]);
        assert!(names("not json", "chains").is_err());
        assert!(names("{}", "chains").is_err());
    }

    #[test]
    fn shard_maps_are_recognised() {
        assert_eq!(parse_shard("endpoint-dnat-udp-3"), Some(SetName::EndpointDnat(Protocol::Udp, 3)));
        assert_eq!(parse_shard("endpoint-chains-12"), Some(SetName::EndpointChains(12)));
        assert_eq!(parse_shard("endpoint-dnat-icmp-1"), None);
        assert_eq!(parse_shard("service-ips"), None);
        for s in [SetName::EndpointDnat(Protocol::Sctp, 7), SetName::EndpointChains(0)] {
            assert_eq!(parse_shard(&s.to_string()), Some(s), "round trip of {s}");
        }
    }
}
