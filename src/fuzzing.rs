//! Fuzz harnesses: one function per target, taking the fuzzer's bytes. The fuzz crate
//! (`tests/fuzz/`, cargo-fuzz) and the corpus replay test (`tests/fuzz_corpora.rs`) call the
//! same functions, so every committed corpus file runs in the ordinary suite.
//!
//! Each function returns false early on input the code under test refuses (that is the
//! code doing its job), true once the invariants were checked; it panics only when an
//! invariant is broken — or when the code under
//! test itself panics, which is the defect a fuzzer looks for. The invariants per target
//! are in docs/reliability.md ("Fuzzing").

use std::net::IpAddr;
use std::sync::Arc;

use base64::Engine as _;
use k8s_openapi::api::core::v1::Service;
use kube::core::admission::{AdmissionRequest, AdmissionResponse};

use crate::alloc::AllocationMap;
use crate::cidr::{parse_ip, ServiceCidr};
use crate::store::legacy::RangeAllocation;
use crate::store::memory::MemoryStore;
use crate::webhook::admission::Admission;
use crate::webhook::server::parse_review;

/// The targets, by the names `scripts/fuzz.sh` and the corpus folders use.
pub const TARGETS: &[&str] = &["cidr", "snapshot", "range_allocation", "admission"];

/// Runs the target `name` on `data`: Some(whether the input got past the code's refusals to
/// the invariant checks), None for an unknown target.
pub fn run(name: &str, data: &[u8]) -> Option<bool> {
    Some(match name {
        "cidr" => cidr(data),
        "snapshot" => snapshot(data),
        "range_allocation" => range_allocation(data),
        "admission" => admission(data),
        _ => return None,
    })
}

fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// CIDR and IP parsing. The input is text: a CIDR on the first line, an address on the
/// second (both optional). Checks: nothing panics; a parsed CIDR prints canonically and
/// parses back to itself; offset → address → offset agrees at the edges, the band split
/// and the offset the input's address has; a parsed address prints in a form that parses
/// back to it.
pub fn cidr(data: &[u8]) -> bool {
    let Some(s) = text(data) else { return false };
    let mut lines = s.splitn(2, '\n');
    let cidr_text = lines.next().unwrap_or_default();
    let ip_text = lines.next().unwrap_or_default();

    let ip = parse_ip(ip_text).ok();
    if let Some(ip) = ip {
        assert_eq!(parse_ip(&ip.to_string()).ok(), Some(ip), "{ip_text:?} does not survive its own printing");
    }
    // The first line as an address too (parse_ip has to refuse CIDR text cleanly).
    if let Ok(first) = parse_ip(cidr_text) {
        assert_eq!(parse_ip(&first.to_string()).ok(), Some(first));
    }
    let Ok(c) = ServiceCidr::parse(cidr_text) else { return false };
    let printed = c.to_string();
    assert_eq!(ServiceCidr::parse(&printed).as_ref(), Ok(&c), "{cidr_text:?} prints as {printed:?}, which does not parse back");
    assert!(c.band_offset() <= c.size(), "{c}: static band larger than the range");
    assert_eq!(u128::from(c.size()), c.raw_size() - if c.family() == crate::cidr::Family::IPv4 { 2.min(c.raw_size()) } else { 1 });
    let size = c.size();
    let band = c.band_offset();
    let edges = [0, 1, band.saturating_sub(1), band, band.saturating_add(1), size / 2, size.saturating_sub(1), size];
    for off in edges {
        match c.ip_at(off) {
            Some(at) => {
                assert!(off < size, "{c}: an address at offset {off}, past the size {size}");
                assert_eq!(c.offset_of(at), Some(off), "{c}: offset {off} is {at}, which maps back elsewhere");
                assert!(c.contains(at) && c.covers(at));
            }
            None => assert!(off >= size, "{c}: no address at offset {off} below the size {size}"),
        }
    }
    assert!(!c.contains(c.network()), "{c}: the network address is usable");
    if let Some(ip) = ip {
        match c.offset_of(ip) {
            Some(off) => {
                assert_eq!(c.ip_at(off), Some(ip), "{c}: {ip} is offset {off}, which maps back elsewhere");
                assert!(c.covers(ip));
            }
            None => assert!(!c.contains(ip)),
        }
        if c.contains(ip) {
            assert!(c.usable().is_some_and(|b| b.first <= ip && ip <= b.last));
        }
    }
    if let Some(u) = c.usable() {
        assert_eq!(u.size, size);
    }
    let facts = c.facts();
    assert!(serde_json::to_string(&facts).is_ok());
    true
}

/// The ranges the allocation-map targets pick from with the input's first byte.
const SNAPSHOT_RANGES: &[&str] =
    &["198.18.0.0/24", "198.18.0.0/28", "198.18.0.0/30", "198.18.0.0/31", "10.96.0.0/12", "198.18.0.0/15", "fd00::/120", "fd00::/108", "fd00:1:2:3::/64", "fd00::/127"];

fn pick_range(selector: u8) -> ServiceCidr {
    let text = SNAPSHOT_RANGES[usize::from(selector) % SNAPSHOT_RANGES.len()];
    ServiceCidr::parse(text).unwrap_or_else(|e| panic!("fixed range {text}: {e}"))
}

/// Checks that two maps hold the same addresses of the same range.
fn assert_same_map(a: &AllocationMap, b: &AllocationMap, what: &str) {
    assert_eq!(a.cidr(), b.cidr(), "{what}: range");
    assert_eq!(a.used(), b.used(), "{what}: count");
    assert_eq!(a.static_used(), b.static_used(), "{what}: static band count");
    assert!(a.offsets().eq(b.offsets()), "{what}: offsets differ");
}

/// Allocation-map snapshot decoding. The input's first byte picks the range, the rest is
/// the snapshot. Checks: restore never panics; whatever it accepts re-encodes to bytes that
/// restore to the same map, and that encoding is stable (encode ∘ restore ∘ encode = encode).
pub fn snapshot(data: &[u8]) -> bool {
    let Some((&sel, bytes)) = data.split_first() else { return false };
    let cidr = pick_range(sel);
    let Ok(map) = AllocationMap::restore(&cidr, bytes) else { return false };
    assert!(map.used() <= cidr.size());
    let again = map.snapshot();
    let back = AllocationMap::restore(&cidr, &again).unwrap_or_else(|e| panic!("a re-encoded snapshot of {cidr} does not restore: {e}"));
    assert_same_map(&map, &back, "snapshot round trip");
    assert_eq!(back.snapshot(), again, "snapshot encoding is not stable");
    // A snapshot of this range is not one of another range.
    let other = pick_range(sel.wrapping_add(1));
    if other != cidr {
        assert!(AllocationMap::restore(&other, &again).is_err(), "a snapshot of {cidr} restores as {other}");
    }
    true
}

/// Kubernetes' RangeAllocation (the legacy import). The input is the stored value (JSON or
/// the protobuf envelope). Checks: decode and `to_map` never panic; an accepted map written
/// back as RangeAllocation `data` reads back to the same map.
pub fn range_allocation(data: &[u8]) -> bool {
    let Ok(ra) = RangeAllocation::decode(data) else { return false };
    let Ok(map) = ra.to_map() else { return false };
    let cidr = map.cidr().clone();
    // The stored range is the CIDR's canonical text or refused (host bits, spellings).
    assert_eq!(ServiceCidr::parse(&ra.range).as_ref(), Ok(&cidr));
    let Ok(bytes) = map.to_range_allocation() else { return false };
    if let Some(first) = bytes.first() {
        assert_ne!(*first, 0, "RangeAllocation data is not minimal");
    }
    let back = AllocationMap::from_range_allocation(&cidr, &bytes).unwrap_or_else(|e| panic!("written RangeAllocation data does not read back: {e}"));
    assert_same_map(&map, &back, "RangeAllocation round trip");
    // Through the JSON form too.
    let json = serde_json::json!({"range": ra.range, "data": base64::engine::general_purpose::STANDARD.encode(&bytes)});
    let again = RangeAllocation::decode(json.to_string().as_bytes()).unwrap_or_else(|e| panic!("our JSON form does not decode: {e}"));
    let again = again.to_map().unwrap_or_else(|e| panic!("our JSON form does not map: {e}"));
    assert_same_map(&map, &again, "RangeAllocation JSON round trip");
    true
}

/// The ranges the admission target's store serves: small, so "range is full" is reachable.
pub const ADMISSION_RANGES: &[&str] = &["198.19.0.0/28", "fd00:10:96::/124"];

/// AdmissionReview bodies through the webhook: `parse_review`, then `mutate` and `validate`
/// over an in-memory store. Checks: nothing panics; every answer is a well-formed
/// AdmissionReview response for the request's uid; a denial carries a code and a message;
/// an allowed mutation's patch applies to the object and leaves `clusterIP ==
/// clusterIPs[0]`, with every address it adds inside the store's ranges and reserved.
pub fn admission(data: &[u8]) -> bool {
    let Ok(req) = parse_review(data) else { return false };
    let ranges: Vec<ServiceCidr> = ADMISSION_RANGES.iter().map(|r| ServiceCidr::parse(r).unwrap_or_else(|e| panic!("{r}: {e}"))).collect();
    let store = Arc::new(MemoryStore::new(ranges.clone()));
    let adm = Admission::new(store.clone(), None);
    // Twice: the second time the first answer's reservations are in the store.
    for round in 0..2 {
        let mutated = futures::executor::block_on(adm.mutate(&req));
        check_answer(&req, &mutated, &ranges, round);
        let validated = futures::executor::block_on(adm.validate(&req));
        check_answer(&req, &validated, &ranges, round);
        assert!(validated.patch.is_none(), "validation answered with a patch");
    }
    true
}

fn check_answer(req: &AdmissionRequest<Service>, resp: &AdmissionResponse, ranges: &[ServiceCidr], round: u32) {
    let review = serde_json::to_value(resp.clone().into_review()).unwrap_or_else(|e| panic!("the answer does not serialize: {e}"));
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1", "{review}");
    assert_eq!(review["kind"], "AdmissionReview", "{review}");
    let r = &review["response"];
    assert_eq!(r["uid"].as_str(), Some(req.uid.as_str()), "the answer is for another request: {review}");
    let allowed = r["allowed"].as_bool().unwrap_or_else(|| panic!("no allowed: {review}"));
    if !allowed {
        assert!(resp.patch.is_none(), "a denial with a patch: {review}");
        let code = r["status"]["code"].as_u64().unwrap_or(0);
        assert!((400..600).contains(&code), "a denial without an error code: {review}");
        assert!(!resp.result.message.is_empty(), "a denial without a message: {review}");
        return;
    }
    let Some(patch) = resp.patch.as_ref() else { return };
    assert!(!req.dry_run, "a dry run was patched");
    assert_eq!(r["patchType"], "JSONPatch", "{review}");
    // kube writes the bytes as a JSON array of numbers, which the kube-apiserver reads
    // into its []byte as well as the base64 text Go itself writes.
    let sent: Vec<u8> = match &r["patch"] {
        serde_json::Value::String(b64) => base64::engine::general_purpose::STANDARD.decode(b64).unwrap_or_else(|e| panic!("patch is not base64: {e}")),
        other => serde_json::from_value(other.clone()).unwrap_or_else(|e| panic!("patch is neither bytes nor base64: {e}: {other}")),
    };
    assert_eq!(&sent, patch);
    let patch: json_patch::Patch = serde_json::from_slice(patch).unwrap_or_else(|e| panic!("patch is not a JSON patch: {e}"));
    let object = req.object.as_ref().unwrap_or_else(|| panic!("a patch for a request without an object"));
    let mut doc = serde_json::to_value(object).unwrap_or_else(|e| panic!("the object does not serialize: {e}"));
    json_patch::patch(&mut doc, &patch).unwrap_or_else(|e| panic!("round {round}: the patch does not apply to the object: {e}\nobject: {doc}"));
    let svc: Service = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("the patched object is no Service: {e}\n{doc}"));
    let spec = svc.spec.unwrap_or_default();
    let ips = spec.cluster_ips.unwrap_or_default();
    assert!(!ips.is_empty() && ips.len() <= 2, "patched clusterIPs {ips:?}");
    assert_eq!(spec.cluster_ip.as_ref(), ips.first(), "clusterIP is not clusterIPs[0]");
    let families = spec.ip_families.unwrap_or_default();
    assert_eq!(families.len(), ips.len(), "ipFamilies {families:?} for clusterIPs {ips:?}");
    // An UPDATE keeps what the stored object holds; only what it adds must be ours.
    let held: Vec<IpAddr> = req
        .old_object
        .as_ref()
        .and_then(|o| o.spec.as_ref())
        .map(|s| s.cluster_ips.iter().flatten().chain(&s.cluster_ip).filter_map(|t| parse_ip(t).ok()).collect())
        .unwrap_or_default();
    for (text, fam) in ips.iter().zip(&families) {
        let ip: IpAddr = parse_ip(text).unwrap_or_else(|e| panic!("patched address {text:?}: {e}"));
        assert_eq!(crate::cidr::Family::of(ip).as_str(), fam, "{text} is not {fam}");
        if !held.contains(&ip) {
            assert!(ranges.iter().any(|c| c.contains(ip)), "patched address {ip} is in none of the ranges");
        }
    }
}
