//! Differential test: stock Kubernetes is the oracle (docs/fidelity.md).
//!
//! Every case is one Service request (a create; some with a holder created first, some a
//! patch of a created Service) run twice in the same real kube-apiserver: once in a namespace
//! no webhook selects (the apiserver alone decides), once in a namespace our webhook
//! selects. The outcomes must agree: success with the same type, ipFamilyPolicy,
//! ipFamilies and static addresses (ours dynamic ones from our ranges), or failure with the
//! same code, reason, `details` (kind, name, causes) and message, addresses masked. The
//! apiserver prefixes a webhook's message with `admission webhook "…" denied the request: `
//! (its `ToStatusErr`; `details` is passed through unchanged, and kubectl prints from
//! `details`): that prefix is the one difference no webhook can avoid, and is stripped.
//!
//! Addresses: the webhook assigns from 198.19.120.0/22 and fd00:10:96::c000/118 (no other
//! test uses them); the oracle side's static addresses are 198.19.124.x / fd00:10:96::c4xx,
//! outside our ranges and inside the apiserver's 198.19.0.0/16 and fd00:10:96::/112. Every
//! static address is used by one case on one side only, and only if no IPAddress records it
//! when the case begins (`Side::fill`): the shared cluster's other Services may hold any
//! address of the apiserver's dynamic band.

mod controller_common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::core::v1::{Event, Namespace, Service};
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::{json, Value};

use clusterip::cidr::ServiceCidr;
use clusterip_test_support::{block_on_drop, control_plane, eventually_ok, free_leftover, unique_name, ControlPlane};
use controller_common::Controller;

/// The addresses one backend's run uses: our ranges (the webhook's), and the stock side's
/// static addresses; both runs go on side by side, so nothing is shared.
struct Layout {
    backend: &'static str,
    our_v4: &'static str,
    our_v6: &'static str,
    /// Our side: network, broadcast, IPv6 network, IPv6 all-ones, and an address in the
    /// apiserver's range outside ours.
    ours_fixed: [&'static str; 5],
    stock_v4_base: &'static str,
    stock_v6_base: &'static str,
    /// The stock side's address in the apiserver's range (the counterpart of ours_fixed[4]).
    stock_out: &'static str,
}

/// An address in the apiserver's range outside every range of ours: refused by our webhook
/// (and only by it) with "The range of valid IPs is …", which shows the webhook is called.
const PROBE: &str = "198.19.200.5";

const ETCD: Layout = Layout {
    backend: "etcd",
    our_v4: "198.19.120.0/22",
    our_v6: "fd00:10:96::c000/118",
    ours_fixed: ["198.19.120.0", "198.19.123.255", "fd00:10:96::c000", "fd00:10:96::c3ff", "198.19.125.7"],
    stock_v4_base: "198.19.124.0",
    stock_v6_base: "fd00:10:96::c400",
    stock_out: "198.19.126.7",
};

const IPADDRESS: Layout = Layout {
    backend: "ipaddress",
    our_v4: "198.19.136.0/22",
    our_v6: "fd00:10:96::d000/118",
    ours_fixed: ["198.19.136.0", "198.19.139.255", "fd00:10:96::d000", "fd00:10:96::d3ff", "198.19.141.7"],
    stock_v4_base: "198.19.140.0",
    stock_v6_base: "fd00:10:96::d400",
    stock_out: "198.19.142.7",
};

impl Layout {
    fn our_ranges(&self) -> [ServiceCidr; 2] {
        [ServiceCidr::parse(self.our_v4).expect("v4"), ServiceCidr::parse(self.our_v6).expect("v6")]
    }
}

/// The address values of one side.
struct Side {
    namespace: String,
    v4_base: u32,
    v6_base: u128,
    next4: u32,
    next6: u128,
    /// Token → the address text it stood for on this side.
    tokens: BTreeMap<String, String>,
    /// Network, broadcast, IPv6 network and all-ones addresses of this side's range, and an
    /// address in the apiserver's range outside ours.
    fixed: [(&'static str, String); 5],
    /// Our ranges (only the webhook side's dynamic addresses must come from them).
    ours: Option<[ServiceCidr; 2]>,
}

impl Side {
    fn new(namespace: String, v4: &str, v6: &str, fixed: [(&'static str, String); 5]) -> Side {
        Side {
            namespace,
            v4_base: u32::from(v4.parse::<std::net::Ipv4Addr>().expect("v4 base")),
            v6_base: u128::from(v6.parse::<std::net::Ipv6Addr>().expect("v6 base")),
            next4: 1,
            next6: 1,
            tokens: BTreeMap::new(),
            fixed,
            ours: None,
        }
    }

    /// `spec` with its tokens replaced by fresh addresses of this side: {A}, {A2} (IPv4),
    /// {X} (IPv6), {XNC} (an IPv6 address spelled non-canonically), and the fixed ones.
    ///
    /// A fresh address is one no IPAddress records now: the shared cluster keeps every
    /// Service other tests left (namespaces are never finalized without
    /// kube-controller-manager), and the apiserver's own dynamic picks — this test's stock
    /// side's among them — land anywhere in its dynamic band, which holds these addresses.
    /// Nothing else allocates while this test runs (test binaries run one at a time, the two
    /// backends' runs one after the other), so a free address stays free for the case.
    async fn fill(&mut self, client: &Client, text: &str) -> String {
        let mut out = text.to_string();
        for tok in ["{A}", "{A2}"] {
            if out.contains(tok) {
                let ip = loop {
                    let ip = IpAddr::from(std::net::Ipv4Addr::from(self.v4_base + self.next4));
                    self.next4 += 1;
                    if unrecorded(client, ip).await {
                        break ip.to_string();
                    }
                };
                out = out.replace(tok, &ip);
                self.tokens.insert(tok.into(), ip);
            }
        }
        for (tok, spelled) in [("{X}", false), ("{XNC}", true)] {
            if out.contains(tok) {
                let ip = loop {
                    let ip = std::net::Ipv6Addr::from(self.v6_base + self.next6);
                    self.next6 += 1;
                    if unrecorded(client, IpAddr::from(ip)).await {
                        break ip;
                    }
                };
                let text = if spelled { ip.to_string().replacen("::", ":0::", 1) } else { ip.to_string() };
                out = out.replace(tok, &text);
                self.tokens.insert(tok.into(), text);
            }
        }
        for (tok, ip) in &self.fixed {
            if out.contains(tok) {
                out = out.replace(tok, ip);
                self.tokens.insert(tok.to_string(), ip.clone());
            }
        }
        out
    }

    /// The static addresses this side may use (an earlier run's leftovers among them are
    /// freed before the run).
    fn statics(&self) -> Vec<String> {
        let mut v: Vec<String> = (1..64).map(|n| std::net::Ipv4Addr::from(self.v4_base + n).to_string()).collect();
        v.extend((1..64u128).map(|n| std::net::Ipv6Addr::from(self.v6_base + n).to_string()));
        v.extend(self.fixed.iter().map(|(_, ip)| ip.clone()));
        v
    }
}

enum Step {
    Create,
    DryRun,
    /// Create a holder Service with `holder` first, then the case.
    AfterHolder(&'static str, bool),
    /// Create `spec`, then merge-patch the Service's spec with `patch`.
    Patch(&'static str),
    /// A create that fails after admission (the apiserver's validation refuses it: port 0),
    /// by the same Service (true) or another one, then the case.
    AfterFailedCreate(&'static str, bool),
    /// Create and delete the case's Service this many times, then the case.
    AfterDeletes(u32),
    /// Create `spec`, then merge-patch its spec with each patch in turn; the last one's
    /// outcome is compared.
    Patches(&'static [&'static str]),
    /// A holder created with the case's addresses gives them up with `patch`, then the case.
    AfterHolderPatched(&'static str, &'static str),
    /// A create with `metadata.generateName` instead of a name.
    GenerateName,
}

struct Case {
    name: &'static str,
    spec: &'static str,
    step: Step,
    /// Why clusterip deliberately answers otherwise (docs/fidelity.md), or None.
    differs: Option<&'static str>,
}

/// A merge patch that turns a ClusterIP Service into an ExternalName one.
const EXTERNAL_NAME: &str = r#"{"type":"ExternalName","externalName":"example.invalid"}"#;

fn cases() -> Vec<Case> {
    use Step::*;
    let c = |name, spec, step| Case { name, spec, step, differs: None };
    vec![
        // IP families and policies.
        c("default", r#"{}"#, Create),
        c("prefer-dual", r#"{"ipFamilyPolicy":"PreferDualStack"}"#, Create),
        c("require-dual", r#"{"ipFamilyPolicy":"RequireDualStack"}"#, Create),
        c("ipv6-only", r#"{"ipFamilies":["IPv6"]}"#, Create),
        c("family-order-v6-first", r#"{"ipFamilies":["IPv6","IPv4"],"ipFamilyPolicy":"RequireDualStack"}"#, Create),
        c("prefer-v6-first", r#"{"ipFamilies":["IPv6"],"ipFamilyPolicy":"PreferDualStack"}"#, Create),
        c("two-families-no-policy", r#"{"ipFamilies":["IPv4","IPv6"]}"#, Create),
        c("two-families-single", r#"{"ipFamilies":["IPv4","IPv6"],"ipFamilyPolicy":"SingleStack"}"#, Create),
        c("policy-unsupported", r#"{"ipFamilyPolicy":"Bogus"}"#, Create),
        c("family-unsupported", r#"{"ipFamilies":["IPv5"]}"#, Create),
        c("family-duplicate", r#"{"ipFamilies":["IPv4","IPv4"],"ipFamilyPolicy":"PreferDualStack"}"#, Create),
        c("headless-selector", r#"{"clusterIP":"None","selector":{"app":"x"}}"#, Create),
        c("headless-no-selector", r#"{"clusterIP":"None"}"#, Create),
        c("headless-prefer", r#"{"clusterIP":"None","selector":{"app":"x"},"ipFamilyPolicy":"PreferDualStack"}"#, Create),
        // clusterIP / clusterIPs consistency.
        c("first-must-match", r#"{"clusterIP":"{A}","clusterIPs":["{A2}"]}"#, Create),
        c("ips-without-ip", r#"{"clusterIPs":["{A}"]}"#, Create),
        c("none-not-alone", r#"{"clusterIP":"None","clusterIPs":["None","{A}"]}"#, Create),
        c("three-ips", r#"{"clusterIP":"{A}","clusterIPs":["{A}","{X}","{A2}"],"ipFamilyPolicy":"RequireDualStack"}"#, Create),
        c("two-v4", r#"{"clusterIP":"{A}","clusterIPs":["{A}","{A2}"],"ipFamilyPolicy":"PreferDualStack"}"#, Create),
        c("two-ips-single-stack", r#"{"clusterIP":"{A}","clusterIPs":["{A}","{X}"],"ipFamilyPolicy":"SingleStack"}"#, Create),
        c("ip-family-mismatch", r#"{"clusterIP":"{A}","ipFamilies":["IPv6"]}"#, Create),
        // Malformed addresses.
        c("leading-zeros", r#"{"clusterIP":"198.19.010.5"}"#, Create),
        c("ipv4-mapped", r#"{"clusterIP":"::ffff:198.19.1.5"}"#, Create),
        c("garbage", r#"{"clusterIP":"garbage"}"#, Create),
        c("second-malformed", r#"{"clusterIP":"{A}","clusterIPs":["{A}","fd00::zz"],"ipFamilyPolicy":"RequireDualStack"}"#, Create),
        c("non-canonical-ipv6", r#"{"clusterIP":"{XNC}"}"#, Create),
        // Ranges.
        c("in-no-servicecidr", r#"{"clusterIP":"198.20.0.5"}"#, Create),
        c("ipv6-in-no-servicecidr", r#"{"clusterIP":"fd00:10:97::5"}"#, Create),
        c("network-address", r#"{"clusterIP":"{NET}"}"#, Create),
        c("broadcast-address", r#"{"clusterIP":"{BCAST}"}"#, Create),
        c("ipv6-network-address", r#"{"clusterIP":"{NET6}"}"#, Create),
        c("ipv6-all-ones", r#"{"clusterIP":"{ONES6}"}"#, Create),
        c("dual-second-out", r#"{"clusterIP":"{A}","clusterIPs":["{A}","fd00:10:97::5"],"ipFamilyPolicy":"RequireDualStack"}"#, Create),
        c("dry-run-in-no-servicecidr", r#"{"clusterIP":"198.20.0.5"}"#, DryRun),
        // Static addresses.
        c("static", r#"{"clusterIP":"{A}"}"#, Create),
        c("static-dual", r#"{"clusterIP":"{A}","clusterIPs":["{A}","{X}"],"ipFamilyPolicy":"RequireDualStack"}"#, Create),
        c("static-plus-dynamic", r#"{"clusterIP":"{A}","ipFamilyPolicy":"PreferDualStack"}"#, Create),
        // Duplicates and dry-run.
        c("duplicate", r#"{"clusterIP":"{A}"}"#, AfterHolder(r#"{"clusterIP":"{A}"}"#, false)),
        c("duplicate-dry-run", r#"{"clusterIP":"{A}"}"#, AfterHolder(r#"{"clusterIP":"{A}"}"#, true)),
        c("dry-run-dynamic", r#"{"ipFamilyPolicy":"RequireDualStack"}"#, DryRun),
        c("dry-run-static", r#"{"clusterIP":"{A}"}"#, DryRun),
        // Updates.
        c("patch-upgrade-to-dual", r#"{}"#, Patch(r#"{"ipFamilyPolicy":"RequireDualStack"}"#)),
        c("patch-two-families-single", r#"{}"#, Patch(r#"{"ipFamilies":["IPv4","IPv6"]}"#)),
        c("patch-change-ip", r#"{"clusterIP":"{A}"}"#, Patch(r#"{"clusterIP":"{A2}","clusterIPs":["{A2}"]}"#)),
        // When an address is held: from the Service's storing until it gives the address up.
        c("retry-after-failed-create", r#"{"clusterIP":"{A}"}"#, AfterFailedCreate(r#"{"clusterIP":"{A}","ports":[{"port":0}]}"#, true)),
        c("other-after-failed-create", r#"{"clusterIP":"{A}"}"#, AfterFailedCreate(r#"{"clusterIP":"{A}","ports":[{"port":0}]}"#, false)),
        c("dual-retry-after-failed-create", r#"{"clusterIP":"{A}","clusterIPs":["{A}","{X}"],"ipFamilyPolicy":"RequireDualStack"}"#, AfterFailedCreate(r#"{"clusterIP":"{A}","clusterIPs":["{A}","{X}"],"ipFamilyPolicy":"RequireDualStack","ports":[{"port":0}]}"#, true)),
        c("recreate-after-5-deletes", r#"{"clusterIP":"{A}"}"#, AfterDeletes(5)),
        c("externalname-and-back-same-ip", r#"{"clusterIP":"{A}"}"#, Patches(&[EXTERNAL_NAME, r#"{"type":"ClusterIP","externalName":null,"clusterIP":"{A}"}"#])),
        c("externalname-and-back-new-ip", r#"{"clusterIP":"{A}"}"#, Patches(&[EXTERNAL_NAME, r#"{"type":"ClusterIP","externalName":null,"clusterIP":"{A2}"}"#])),
        c("externalname-and-back-dynamic", r#"{"clusterIP":"{A}"}"#, Patches(&[EXTERNAL_NAME, r#"{"type":"ClusterIP","externalName":null}"#])),
        c("generate-name-dynamic", r#"{"ipFamilyPolicy":"PreferDualStack"}"#, GenerateName),
        c("generate-name-static", r#"{"clusterIP":"{A}"}"#, GenerateName),
        c("taken-after-externalname", r#"{"clusterIP":"{A}"}"#, AfterHolderPatched(r#"{"clusterIP":"{A}"}"#, EXTERNAL_NAME)),
        c("taken-after-downgrade", r#"{"clusterIP":"{X}","ipFamilies":["IPv6"]}"#, AfterHolderPatched(r#"{"clusterIP":"{A}","clusterIPs":["{A}","{X}"],"ipFamilyPolicy":"RequireDualStack"}"#, r#"{"ipFamilyPolicy":"SingleStack","ipFamilies":["IPv4"],"clusterIPs":["{A}"]}"#)),
        // Deliberate differences.
        Case {
            name: "outside-our-ranges",
            spec: r#"{"clusterIP":"{OUT}"}"#,
            step: Create,
            differs: Some("an address in the apiserver's range but outside clusterip's ranges is refused: every address comes from clusterip's ranges"),
        },
    ]
}

/// The outcome of one request, comparable across the two sides.
#[derive(Debug, PartialEq)]
enum Outcome {
    Created { type_: String, policy: String, families: Vec<String>, ips: Vec<String> },
    Failed { code: u16, reason: String, kind: String, name: String, message: String, causes: Vec<(String, String, String)> },
}

/// One table cell for an outcome: what was stored, or the code and message of the refusal.
fn summary(o: &Outcome) -> String {
    match o {
        Outcome::Created { type_, policy, families, ips } => {
            format!("created: {type_}, {policy}, [{}], {} address(es){}", families.join(","), ips.len(), if ips.is_empty() { String::new() } else { format!(" {}", ips.join(",")) })
        }
        Outcome::Failed { code, reason, message, .. } => format!("{code} {reason}: {}", message.replace('|', "\\|")),
    }
}

/// Addresses and CIDRs in `text` replaced by `<ip>`.
fn mask(text: &str) -> String {
    let is_ipish = |c: char| c.is_ascii_hexdigit() || c == ':' || c == '.' || c == '/';
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        if !is_ipish(chars[i]) {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len() && is_ipish(chars[j]) {
            j += 1;
        }
        let run: String = chars[i..j].iter().collect();
        // The longest prefix that is an address or a CIDR.
        let mut matched = 0;
        for end in (1..=run.len()).rev() {
            let p = &run[..end];
            if p.parse::<IpAddr>().is_ok() || p.split_once('/').map(|(a, b)| a.parse::<IpAddr>().is_ok() && b.parse::<u8>().is_ok()).unwrap_or(false) {
                matched = end;
                break;
            }
        }
        if matched > 0 && run[..matched].contains(['.', ':']) {
            out.push_str("<ip>");
            out.push_str(&run[matched..]);
        } else {
            out.push_str(&run);
        }
        i = j;
    }
    out
}

/// One request, its status code and its body (kept whole: `details` included).
async fn send(client: &Client, req: Result<http::Request<Vec<u8>>, kube::core::request::Error>) -> (u16, Value) {
    let req = req.expect("request").map(kube::client::Body::from);
    let resp = client.send(req).await.expect("send");
    let code = resp.status().as_u16();
    use http_body_util::BodyExt;
    let bytes = resp.into_body().collect().await.expect("response body").to_bytes();
    (code, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn service_body(name: &str, spec: &str) -> Vec<u8> {
    let mut spec: Value = serde_json::from_str(spec).expect("case spec");
    if spec.get("ports").is_none() {
        spec["ports"] = json!([{"port": 80}]);
    }
    serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec})).expect("json")
}

/// The comparable outcome of a response on `side`; `dry_run`: dynamic addresses are the
/// apiserver's dry-run placeholders on both sides and are compared as they are.
fn outcome(side: &Side, code: u16, body: &Value, ours: bool, dry_run: bool) -> Outcome {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    if (200..300).contains(&code) {
        let spec = &body["spec"];
        let ranges = side.ours.clone().unwrap_or_else(|| ETCD.our_ranges());
        let ips = spec["clusterIPs"]
            .as_array()
            .map(|a| a.iter().map(s).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .map(|ip| {
                if let Some((tok, _)) = side.tokens.iter().find(|(_, v)| **v == ip) {
                    return tok.clone();
                }
                if ip == "None" || dry_run {
                    return ip;
                }
                match ip.parse::<IpAddr>() {
                    Ok(a) if !ours || ranges.iter().any(|r| r.contains(a)) => "<dynamic>".into(),
                    _ => format!("{ip} (not from our ranges)"),
                }
            })
            .collect();
        let families = spec["ipFamilies"].as_array().map(|a| a.iter().map(s).collect()).unwrap_or_default();
        return Outcome::Created { type_: s(&spec["type"]), policy: s(&spec["ipFamilyPolicy"]), families, ips };
    }
    let message = s(&body["message"]);
    let message = match message.strip_prefix("admission webhook \"") {
        Some(rest) => rest.split_once("\" denied the request: ").map(|(_, m)| m.to_string()).unwrap_or(message.clone()),
        None => message,
    };
    let d = &body["details"];
    let causes = d["causes"]
        .as_array()
        .map(|a| a.iter().map(|c| (s(&c["field"]), s(&c["reason"]), mask(&s(&c["message"])))).collect())
        .unwrap_or_default();
    Outcome::Failed { code, reason: s(&body["reason"]), kind: s(&d["kind"]), name: s(&d["name"]), message: mask(&message), causes }
}

/// The request whose answer a case compares: made after the case's earlier steps.
enum Final {
    Create { body: Vec<u8>, dry_run: bool },
    Patch { name: String, patch: Value },
}

impl Final {
    async fn send(&self, client: &Client, namespace: &str) -> (u16, Value) {
        let path = format!("/api/v1/namespaces/{namespace}/services");
        let req = kube::core::Request::new(&path);
        match self {
            Final::Create { body, dry_run, .. } => send(client, req.create(&PostParams { dry_run: *dry_run, ..Default::default() }, body.clone())).await,
            Final::Patch { name, patch } => send(client, req.patch(name, &PatchParams::default(), &Patch::Merge(json!({"spec": patch})))).await,
        }
    }
}

/// Run one case on one side.
async fn run(client: &Client, side: &mut Side, case: &Case, ours: bool) -> Outcome {
    side.tokens.clear();
    let path = format!("/api/v1/namespaces/{}/services", side.namespace);
    let req = kube::core::Request::new(&path);
    let name = format!("fid-{}", case.name);
    let spec = side.fill(client, case.spec).await;
    let pp = PostParams::default();
    let create = |dry_run| Final::Create { body: service_body(&name, &spec), dry_run };
    let last = match case.step {
        Step::Create => create(false),
        Step::DryRun => create(true),
        Step::AfterHolder(holder, dry_run) => {
            let (c, b) = send(client, req.create(&pp, service_body(&format!("{name}-holder"), &side.fill_keep(holder)))).await;
            assert_eq!(c, 201, "{}: the holder was not created: {b}", case.name);
            create(dry_run)
        }
        Step::Patch(patch) => {
            let (c, b) = send(client, req.create(&pp, service_body(&name, &spec))).await;
            assert_eq!(c, 201, "{}: the Service to patch was not created: {b}", case.name);
            Final::Patch { name: name.clone(), patch: serde_json::from_str(&side.fill(client, patch).await).expect("patch") }
        }
        Step::AfterFailedCreate(failing, same) => {
            let first = if same { name.clone() } else { format!("{name}-failed") };
            let (c, b) = send(client, req.create(&pp, service_body(&first, &side.fill_keep(failing)))).await;
            assert_eq!(c, 422, "{}: the failing create did not fail validation: {b}", case.name);
            create(false)
        }
        Step::GenerateName => {
            let mut body: Value = serde_json::from_slice(&service_body(&name, &spec)).expect("body");
            body["metadata"] = json!({"generateName": format!("{name}-")});
            Final::Create { body: serde_json::to_vec(&body).expect("json"), dry_run: false }
        }
        Step::AfterDeletes(n) => {
            for round in 0..n {
                let (c, b) = send(client, req.create(&pp, service_body(&name, &spec))).await;
                assert_eq!(c, 201, "{} (round {round}): create: {b}", case.name);
                let (c, b) = send(client, req.delete(&name, &DeleteParams::default())).await;
                assert_eq!(c, 200, "{} (round {round}): delete: {b}", case.name);
            }
            create(false)
        }
        Step::Patches(patches) => {
            let (c, b) = send(client, req.create(&pp, service_body(&name, &spec))).await;
            assert_eq!(c, 201, "{}: the Service to patch was not created: {b}", case.name);
            let (init, last) = patches.split_at(patches.len() - 1);
            for (i, patch) in init.iter().enumerate() {
                let text = side.fill_keep(patch);
                let patch: Value = serde_json::from_str(&side.fill(client, &text).await).expect("patch");
                let (c, b) = send(client, req.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"spec": patch})))).await;
                assert_eq!(c, 200, "{}: patch {i} failed: {b}", case.name);
            }
            let text = side.fill_keep(last[0]);
            Final::Patch { name: name.clone(), patch: serde_json::from_str(&side.fill(client, &text).await).expect("patch") }
        }
        Step::AfterHolderPatched(holder, patch) => {
            let holder_name = format!("{name}-holder");
            // The case's addresses, and fresh ones for tokens only the holder has.
            let holder = side.fill_keep(holder);
            let holder = side.fill(client, &holder).await;
            let (c, b) = send(client, req.create(&pp, service_body(&holder_name, &holder))).await;
            assert_eq!(c, 201, "{}: the holder was not created: {b}", case.name);
            let patch: Value = serde_json::from_str(&side.fill_keep(patch)).expect("patch");
            let (c, b) = send(client, req.patch(&holder_name, &PatchParams::default(), &Patch::Merge(json!({"spec": patch})))).await;
            assert_eq!(c, 200, "{}: the holder did not give its addresses up: {b}", case.name);
            create(false)
        }
    };
    let (mut code, mut body) = last.send(client, &side.namespace).await;
    if let Some((ip, event)) = repair_race(client, side, code, &body).await {
        // The kube-apiserver's own repair controller recreated the record of an address
        // this case's earlier steps released (see `repair_race`): the refusal is that
        // race's, not the allocator's answer. Once the controller has collected the
        // recreated record, the same request is asked again; it cannot meet the race twice,
        // since the collection means the controller has seen the release.
        eprintln!("fidelity: {} ({}): refused by the apiserver's repair race ({event}); asking again once {ip} is unrecorded", case.name, side.namespace);
        let what = format!("the apiserver's repair controller collects the record of {ip} it recreated");
        let (client_ref, ip_ref) = (client, &ip);
        eventually_ok(&what, Duration::from_secs(240), Duration::from_millis(500), move || async move {
            if unrecorded(client_ref, ip_ref.parse().expect("token address")).await {
                Ok(())
            } else {
                Err("still recorded".to_string())
            }
        })
        .await;
        (code, body) = last.send(client, &side.namespace).await;
    }
    let dry_run = matches!(last, Final::Create { dry_run: true, .. });
    outcome(side, code, &body, ours, dry_run)
}

/// Evidence that a refusal "provided IP is already allocated" is the kube-apiserver's own
/// repair race rather than its allocator's answer: its `ipallocator-repair-controller`
/// watches Services and IPAddresses through separate informers, and when the deletion of an
/// IPAddress (a Service deleted, downgraded or turned ExternalName) reaches it before the
/// Service's change does, the Service still looks as if it held the address and the record
/// is created again — Warning Event `ClusterIPNotAllocated`, "Cluster IP [IPv6]: <ip> is
/// not allocated; repairing" — until the same controller collects it (as leaked, or as
/// wrongly referenced). Returns the address and the Event's message when such an Event in
/// the side's namespace names one of this case's addresses and the refusal is "already
/// allocated".
async fn repair_race(client: &Client, side: &Side, code: u16, body: &Value) -> Option<(String, String)> {
    if code != 422 || !body["message"].as_str().unwrap_or_default().contains("provided IP is already allocated") {
        return None;
    }
    let events: Api<Event> = Api::namespaced(client.clone(), &side.namespace);
    let list = events.list(&ListParams::default().fields("reason=ClusterIPNotAllocated")).await.expect("list Events");
    list.items.iter().find_map(|e| repaired(e, side.tokens.values()).map(|ip| (ip, e.message.clone().unwrap_or_default())))
}

/// The address among `ips` that `event` says the apiserver's `ipallocator-repair-controller`
/// recreated a record of. Only that controller's Events count: ours reports as
/// `clusterip-controller`, and a record it recreated would be our defect, not a race in the
/// judge. (core/v1's view of an events.k8s.io Event names the controller in
/// `reportingComponent`; a legacy recorder's, in `source.component`.)
fn repaired<'a>(event: &Event, ips: impl IntoIterator<Item = &'a String>) -> Option<String> {
    let name = "ipallocator-repair-controller";
    let from_repair = event.reporting_component.as_deref() == Some(name) || event.source.as_ref().and_then(|s| s.component.as_deref()) == Some(name);
    let message = event.message.as_deref().unwrap_or_default();
    if event.reason.as_deref() != Some("ClusterIPNotAllocated") || !from_repair {
        return None;
    }
    // "Cluster IP [IPv6]: <ip> is not allocated; repairing" (and the "]:<ip>" spelling).
    ips.into_iter().find(|ip| message.contains(&format!(" {ip} is not allocated")) || message.contains(&format!(":{ip} is not allocated"))).cloned()
}

#[test]
fn a_repair_event_is_recognised_only_from_the_apiservers_controller_and_for_its_address() {
    let event = |component: &str, message: &str| -> Event {
        serde_json::from_value(json!({"metadata": {"name": "e"}, "involvedObject": {}, "reason": "ClusterIPNotAllocated", "reportingComponent": component, "message": message})).expect("event")
    };
    let ips = ["fd00:10:96::c401".to_string(), "198.19.124.1".to_string()];
    let stock = event("ipallocator-repair-controller", "Cluster IP [IPv6]: fd00:10:96::c401 is not allocated; repairing");
    assert_eq!(repaired(&stock, &ips), Some("fd00:10:96::c401".to_string()));
    assert_eq!(repaired(&event("ipallocator-repair-controller", "Cluster IP [IPv4]:198.19.124.1 is not allocated; repairing"), &ips), Some("198.19.124.1".to_string()));
    // Another address that merely starts with one of ours.
    assert_eq!(repaired(&event("ipallocator-repair-controller", "Cluster IP [IPv4]: 198.19.124.10 is not allocated; repairing"), &ips), None);
    // Our own controller's Event of the same text is not the judge's race.
    assert_eq!(repaired(&event("clusterip-controller", "Cluster IP [IPv6]: fd00:10:96::c401 is not allocated; repairing"), &ips), None);
}

impl Side {
    /// Like `fill`, reusing the addresses the case's own spec got.
    fn fill_keep(&self, text: &str) -> String {
        let mut out = text.to_string();
        for (tok, ip) in &self.tokens {
            out = out.replace(tok.as_str(), ip);
        }
        out
    }
}

/// Our controller and its webhook registration for one namespace, removed on drop.
struct Webhook {
    _child: Controller,
    name: String,
    client: Client,
}

impl Webhook {
    async fn start(cp: &ControlPlane, layout: &Layout) -> Webhook {
        Self::start_for(cp, layout.backend, &format!("{},{}", layout.our_v4, layout.our_v6), PROBE).await
    }

    /// Our controller with `backend` over `ranges` (the first one IPv4); `probe` as [`PROBE`].
    async fn start_for(cp: &ControlPlane, backend: &str, ranges: &str, probe: &str) -> Webhook {
        let client = cp.client().await;
        let name = unique_name(&format!("fidelity-{backend}"));
        let pki = cp.dir().join("pki");
        let our_v4 = ranges.split(',').next().unwrap_or_default().to_string();
        let mut args = controller_common::controller_args(cp, backend, ranges, &name, "default", "replica-0", &cp.kubeconfig());
        // Only the kube-apiserver's client certificate makes the webhook act.
        args.extend(controller_common::client_auth_args(cp));
        let child = Controller::start(args);
        child.wait_ready().await;
        let port = child.webhook_port;
        let wh = Webhook { _child: child, name: name.clone(), client: client.clone() };
        use base64::Engine as _;
        let ca = base64::engine::general_purpose::STANDARD.encode(std::fs::read(pki.join("ca.crt")).expect("dev CA"));
        let selector = json!({"matchLabels": {"clusterip.allocator/e2e": name}});
        let rules = json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["services"], "scope": "Namespaced"}]);
        let hook = |kind: &str, path: &str, side_effects: &str| {
            json!({"name": format!("{kind}.clusterip.allocator"), "clientConfig": {"url": format!("https://127.0.0.1:{port}/{path}"), "caBundle": ca},
                "rules": rules, "namespaceSelector": selector, "failurePolicy": "Fail", "sideEffects": side_effects,
                "admissionReviewVersions": ["v1"], "timeoutSeconds": 30})
        };
        let mutating: MutatingWebhookConfiguration =
            serde_json::from_value(json!({"metadata": {"name": name}, "webhooks": [hook("assign", "mutate", "NoneOnDryRun")]})).expect("mutating");
        let validating: ValidatingWebhookConfiguration =
            serde_json::from_value(json!({"metadata": {"name": name}, "webhooks": [hook("validate", "validate", "None")]})).expect("validating");
        Api::<MutatingWebhookConfiguration>::all(client.clone()).create(&PostParams::default(), &mutating).await.expect("register mutating webhook");
        Api::<ValidatingWebhookConfiguration>::all(client.clone()).create(&PostParams::default(), &validating).await.expect("register validating webhook");
        create_namespace(&client, &name, json!({"clusterip.allocator/e2e": name})).await;
        // The apiserver picks configurations up asynchronously: a dry-run create of an
        // address only our webhook refuses, until it does.
        let path = format!("/api/v1/namespaces/{name}/services");
        let (client, path, ours) = (&client, &path, &format!("The range of valid IPs is {our_v4}"));
        eventually_ok("the apiserver calls the webhook", Duration::from_secs(60), Duration::from_millis(200), move || async move {
            let spec = json!({"clusterIP": probe}).to_string();
            let (code, body) = send(client, kube::core::Request::new(path).create(&PostParams { dry_run: true, ..Default::default() }, service_body("probe", &spec))).await;
            if code == 422 && body["message"].as_str().unwrap_or_default().contains(ours.as_str()) {
                Ok(())
            } else {
                Err(format!("{code} {body}"))
            }
        })
        .await;
        wh
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let (client, name) = (self.client.clone(), self.name.clone());
        block_on_drop(async move {
            let dp = DeleteParams::default();
            let _ = Api::<MutatingWebhookConfiguration>::all(client.clone()).delete(&name, &dp).await;
            let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone()).delete(&name, &dp).await;
            for ns in [name.clone(), format!("{name}-stock")] {
                let _ = Api::<Service>::namespaced(client.clone(), &ns).delete_collection(&dp, &ListParams::default()).await;
                let _ = Api::<Namespace>::all(client.clone()).delete(&ns, &dp).await;
            }
        });
    }
}

/// Whether no IPAddress records `ip` now (read from storage).
async fn unrecorded(client: &Client, ip: IpAddr) -> bool {
    let addrs: Api<IPAddress> = Api::all(client.clone());
    addrs.get_opt(&ip.to_string()).await.expect("read IPAddress").is_none()
}

/// If `ip` is held by a Service of an earlier run of this test (`fid-…`), delete that
/// Service and wait until the address is free. The fixed stock addresses (the IPv6 all-ones
/// address) must be freed so; the others are skipped by `fill` when held.
async fn free_fidelity_leftover(client: &Client, ip: &str) {
    let addrs: Api<IPAddress> = Api::all(client.clone());
    if let Some(rec) = addrs.get_opt(ip).await.expect("read IPAddress") {
        if rec.spec.parent_ref.resource == "services" && rec.spec.parent_ref.name.starts_with("fid-") {
            free_leftover(client, ip, |p| p.name.starts_with("fid-")).await;
        }
    }
}

async fn create_namespace(client: &Client, name: &str, labels: Value) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).expect("namespace");
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.expect("create namespace");
}


#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_backend_answers_match_stock_kubernetes() {
    matches_stock(&ETCD).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipaddress_backend_answers_match_stock_kubernetes() {
    matches_stock(&IPADDRESS).await;
}

/// One backend's run at a time: both stock sides ask for the apiserver's IPv6 all-ones
/// address (the one fixed address stock allocates), and the later run frees the earlier
/// one's holder first (`free_leftover`).
static ONE_RUN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn matches_stock(layout: &Layout) {
    let _one = ONE_RUN.lock().await;
    let cp = control_plane();
    let wh = Webhook::start(&cp, layout).await;
    let client = wh.client.clone();
    let stock_ns = format!("{}-stock", wh.name);
    create_namespace(&client, &stock_ns, json!({})).await;
    let base = |cidr: &str| cidr.split('/').next().unwrap_or_default().to_string();
    let f = layout.ours_fixed;
    let mut ours = Side::new(
        wh.name.clone(),
        &base(layout.our_v4),
        &base(layout.our_v6),
        [("{NET}", f[0].into()), ("{BCAST}", f[1].into()), ("{NET6}", f[2].into()), ("{ONES6}", f[3].into()), ("{OUT}", f[4].into())],
    );
    ours.ours = Some(layout.our_ranges());
    let mut stock = Side::new(
        stock_ns,
        layout.stock_v4_base,
        layout.stock_v6_base,
        [
            ("{NET}", "198.19.0.0".into()),
            ("{BCAST}", "198.19.255.255".into()),
            ("{NET6}", "fd00:10:96::".into()),
            ("{ONES6}", "fd00:10:96::ffff".into()),
            ("{OUT}", layout.stock_out.into()),
        ],
    );
    for ip in ours.statics().into_iter().chain(stock.statics()) {
        // A Service named `fid-…` holding it is an earlier run's (on a reused cluster); an
        // address anyone else holds is skipped when the cases are filled in.
        free_fidelity_leftover(&client, &ip).await;
    }
    only_the_default_servicecidr(&client).await;
    let cases = cases();
    let (mut matched, mut unexpected, mut deliberate) = (0, Vec::new(), Vec::new());
    let mut table = vec![format!("| case | stock Kubernetes ({} backend run) | clusterip, {} backend |", layout.backend, layout.backend), "|---|---|---|".to_string()];
    for case in &cases {
        let want = run(&client, &mut stock, case, false).await;
        let got = run(&client, &mut ours, case, true).await;
        let same = want == got;
        if same {
            matched += 1;
        }
        let verdict = match (same, case.differs) {
            (true, _) => "same".to_string(),
            (false, Some(_)) => format!("deliberately different: {}", summary(&got)),
            (false, None) => format!("**different**: {}", summary(&got)),
        };
        table.push(format!("| `{}` | {} | {verdict} |", case.name, summary(&want)));
        match (same, case.differs) {
            (true, None) => {}
            (false, Some(why)) => deliberate.push(format!("{}: {why}", case.name)),
            (true, Some(why)) => unexpected.push(format!("{}: listed as a deliberate difference ({why}) but matches stock:\n  {want:?}", case.name)),
            (false, None) => unexpected.push(format!("{}:\n  stock: {want:?}\n  ours:  {got:?}", case.name)),
        }
    }
    eprintln!("fidelity ({} backend): {matched}/{} cases match stock Kubernetes", layout.backend, cases.len());
    // The per-case table of docs/fidelity.md: CLUSTERIP_FIDELITY_TABLE=<dir> writes
    // <dir>/fidelity-<backend>.md.
    if let Ok(dir) = std::env::var("CLUSTERIP_FIDELITY_TABLE") {
        let path = std::path::Path::new(&dir).join(format!("fidelity-{}.md", layout.backend));
        table.push(format!("\n{matched}/{} cases match stock Kubernetes.", cases.len()));
        std::fs::write(&path, table.join("\n") + "\n").unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        eprintln!("fidelity ({} backend): table written to {}", layout.backend, path.display());
    }
    for d in &deliberate {
        eprintln!("fidelity ({} backend): deliberate difference: {d}", layout.backend);
    }
    assert!(unexpected.is_empty(), "unexpected differences from stock Kubernetes:\n{}", unexpected.join("\n"));
}

/// Waits (up to 120 s) until the apiserver's default ServiceCIDR `kubernetes` is the only
/// one. Stock Kubernetes answers a dry-run create with a static address from one ServiceCIDR
/// of the family chosen at random (v1.37.1's `MetaAllocator.DryRun` takes the first entry of
/// a Go map), so its answer is the apiserver's range's only while no other ServiceCIDR exists;
/// other tests' ServiceCIDRs linger for the 10 s deletion grace period after those tests end.
async fn only_the_default_servicecidr(client: &Client) {
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let api: Api<ServiceCIDR> = Api::all(client.clone());
    let api = &api;
    let what = "no ServiceCIDR besides `kubernetes` exists (else stock Kubernetes' dry-run answers would depend on which one it picks)";
    eventually_ok(what, Duration::from_secs(120), Duration::from_millis(500), move || async move {
        let others: Vec<String> = api.list(&Default::default()).await.expect("list ServiceCIDRs").items.into_iter().filter_map(|sc| sc.metadata.name).filter(|n| n != "kubernetes").collect();
        if others.is_empty() {
            Ok(())
        } else {
            Err(format!("{others:?}"))
        }
    })
    .await
}

/// A full range, compared with stock Kubernetes on a control plane of its own whose
/// apiserver range is a /28: the stock side fills it with dynamic creates, then each
/// backend's webhook fills a /28 of ours (a ServiceCIDR of its own, created after the stock
/// side is full, so the apiserver's own allocator never reaches it first), and the next
/// create on each side is compared — stock answers 500 "Internal error occurred: failed to
/// allocate a serviceIP: range is full".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_range_is_answered_as_stock_kubernetes_answers_it() {
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let cp = ControlPlane::private_with("fidelity-full", &[("CLUSTERIP_APISERVER_SERVICE_CIDRS", "198.19.144.0/28")]);
    let client = cp.client().await;
    // Creates `fid-full-<n>` until one fails; then the compared create, `fid-full`.
    let fill_then_create = |side: Side| {
        let client = client.clone();
        async move {
            let path = format!("/api/v1/namespaces/{}/services", side.namespace);
            let req = kube::core::Request::new(&path);
            let mut stored = 0;
            loop {
                let (c, b) = send(&client, req.create(&PostParams::default(), service_body(&format!("fid-full-{stored}"), "{}"))).await;
                if c != 201 {
                    assert!(stored >= 13, "{}: only {stored} creates succeeded before {c} {b}", side.namespace);
                    break;
                }
                stored += 1;
                assert!(stored <= 14, "{}: more than a /28's 14 addresses given", side.namespace);
            }
            let (c, b) = send(&client, req.create(&PostParams::default(), service_body("fid-full", "{}"))).await;
            let ours = side.ours.is_some();
            (stored, outcome(&side, c, &b, ours, false))
        }
    };
    let no_fixed = || [("{NET}", String::new()), ("{BCAST}", String::new()), ("{NET6}", String::new()), ("{ONES6}", String::new()), ("{OUT}", String::new())];
    let stock_ns = unique_name("fid-full-stock");
    create_namespace(&client, &stock_ns, json!({})).await;
    let (stock_stored, want) = fill_then_create(Side::new(stock_ns, "198.19.144.0", "fd00::", no_fixed())).await;
    let message = match &want {
        Outcome::Failed { code: 500, message, .. } => message.clone(),
        other => panic!("stock Kubernetes did not refuse a create in its full range with 500: {other:?}"),
    };
    assert!(message.contains("range is full"), "{message}");
    eprintln!("fidelity (full range): stock Kubernetes, {stock_stored} Services stored, then: {want:?}");

    for (backend, ours) in [("etcd", "198.19.144.16/28"), ("ipaddress", "198.19.144.32/28")] {
        let sc: ServiceCIDR = serde_json::from_value(json!({"metadata": {"name": format!("fid-full-{backend}")}, "spec": {"cidrs": [ours]}})).expect("ServiceCIDR");
        Api::<ServiceCIDR>::all(client.clone()).create(&PostParams::default(), &sc).await.expect("create our ServiceCIDR");
        // In the apiserver's range (full, so never given by it), outside ours.
        let wh = Webhook::start_for(&cp, backend, ours, "198.19.144.5").await;
        let mut side = Side::new(wh.name.clone(), "198.19.144.0", "fd00::", no_fixed());
        side.ours = Some([ServiceCidr::parse(ours).expect("ours"), ServiceCidr::parse("fd00:10:96::/112").expect("v6")]);
        let (stored, got) = fill_then_create(side).await;
        eprintln!("fidelity (full range, {backend} backend): {stored} Services stored, then: {got:?}");
        assert_eq!(stored, 14, "{backend}: a /28 of ours holds 14 Services");
        assert_eq!(got, want, "{backend}: a create in a full range is not answered as stock Kubernetes answers it");
    }
}
