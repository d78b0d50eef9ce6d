//! The shipped manifests (`deploy/`): the real kube-apiserver accepts the whole kustomize
//! tree in a server-side dry run (schema, defaulting, RBAC escalation checks, PodSecurity,
//! admission), every object the tree should hold is in it, and the RBAC of both components
//! is least privilege and is what docs/operations.md's RBAC tables say. Also: the
//! cert-manager and monitoring components render, `scripts/gen-webhook-certs.sh` makes a
//! serving certificate that verifies for the webhook Service, and every install order the
//! repository writes down registers the webhooks only once a replica is ready.
//!
//! Namespace handling, honestly: a server dry run persists nothing, so the objects that live
//! in `clusterip-system` are rejected ("namespaces clusterip-system not found") when the
//! Namespace itself is only dry-run in the same apply. The test therefore creates the
//! Namespace for real first, from `deploy/namespace.yaml` (so its PodSecurity labels are
//! live and the Deployment is checked against them), dry-runs the whole tree — Namespace
//! included — and deletes the Namespace afterwards. The dev cluster runs no
//! kube-controller-manager, so a deleted namespace would stay Terminating forever; once the
//! test has waited a little, it finalizes the namespace itself (PUT .../finalize), which is
//! safe because a dry run left nothing inside. A namespace that already existed and is
//! Active (a real install) is used as it is and left alone.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use clusterip_test_support::{control_plane, kubectl_path, repo_root, wait_within, ControlPlane};
use serde_json::Value;

const NS: &str = "clusterip-system";
const SECRET: &str = "clusterip-webhook-tls";
const LEASE: &str = "clusterip-controller";
const CLIENT_CA: &str = "clusterip-webhook-client-ca";
const CLIENT_NAME: &str = "kube-apiserver-webhook-client";

fn text(out: &Output) -> String {
    format!("status {}\nstdout:\n{}\nstderr:\n{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn run_with_stdin(mut cmd: Command, stdin: &[u8]) -> Output {
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    child.stdin.take().expect("stdin").write_all(stdin).expect("write stdin");
    child.wait_with_output().expect("wait")
}

/// The phase of the namespace, None when it does not exist.
fn namespace_phase(cp: &ControlPlane) -> Option<String> {
    let out = cp.kubectl().args(["get", "namespace", NS, "-o", "jsonpath={.status.phase}"]).output().expect("kubectl get namespace");
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("NotFound") || err.contains("not found"), "kubectl get namespace {NS}: {}", text(&out));
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Remove the `kubernetes` finalizer of a Terminating namespace (what the namespace
/// controller does once the namespace is empty) and wait until it is gone.
fn finalize_namespace(cp: &ControlPlane) {
    let out = cp.kubectl().args(["get", "namespace", NS, "-o", "json"]).output().expect("kubectl get namespace");
    if !out.status.success() {
        return;
    }
    let mut ns: Value = serde_json::from_slice(&out.stdout).expect("namespace JSON");
    ns["spec"]["finalizers"] = Value::Array(vec![]);
    let mut cmd = cp.kubectl();
    cmd.args(["replace", "--raw", &format!("/api/v1/namespaces/{NS}/finalize"), "-f", "-"]);
    let out = run_with_stdin(cmd, ns.to_string().as_bytes());
    if !out.status.success() {
        eprintln!("deploy test: finalizing namespace {NS} failed: {}", text(&out));
    }
    wait_gone(cp, Duration::from_secs(10));
}

fn wait_gone(cp: &ControlPlane, limit: Duration) -> bool {
    wait_within(limit, Duration::from_millis(200), || namespace_phase(cp).is_none().then_some(())).is_some()
}

/// The namespace for the dry run; deleted on drop if this test made it (failed test too).
struct TestNamespace<'a> {
    cp: &'a ControlPlane,
    made_here: bool,
}

impl<'a> TestNamespace<'a> {
    fn prepare(cp: &'a ControlPlane) -> Self {
        match namespace_phase(cp).as_deref() {
            Some("Active") => {
                eprintln!("deploy test: namespace {NS} already exists and is Active; using it and leaving it in place");
                return Self { cp, made_here: false };
            }
            Some(phase) => {
                // Left Terminating by an earlier, interrupted run (no namespace controller here).
                eprintln!("deploy test: namespace {NS} is {phase}; finalizing it before starting");
                finalize_namespace(cp);
                assert!(namespace_phase(cp).is_none(), "namespace {NS} is still there after finalizing it");
            }
            None => {}
        }
        let guard = Self { cp, made_here: true };
        let ns_file = repo_root().join("deploy/namespace.yaml");
        let out = cp.kubectl().args(["apply", "-f"]).arg(&ns_file).output().expect("kubectl apply namespace");
        assert!(out.status.success(), "creating namespace {NS} for real: {}", text(&out));
        guard
    }
}

impl Drop for TestNamespace<'_> {
    fn drop(&mut self) {
        if !self.made_here {
            return;
        }
        let _ = self.cp.kubectl().args(["delete", "namespace", NS, "--wait=false", "--ignore-not-found"]).output();
        // A cluster with a namespace controller removes it by itself; the dev cluster has none.
        if !wait_gone(self.cp, Duration::from_secs(3)) {
            finalize_namespace(self.cp);
        }
        if namespace_phase(self.cp).is_some() {
            eprintln!("deploy test: WARNING: namespace {NS} could not be removed");
        }
    }
}

fn key(obj: &Value) -> (String, String, String) {
    let s = |v: &Value| v.as_str().unwrap_or("").to_string();
    (s(&obj["kind"]), s(&obj["metadata"]["namespace"]), s(&obj["metadata"]["name"]))
}

fn find<'v>(items: &'v [Value], kind: &str, namespace: &str, name: &str) -> &'v Value {
    items
        .iter()
        .find(|o| key(o) == (kind.to_string(), namespace.to_string(), name.to_string()))
        .unwrap_or_else(|| panic!("{kind} {namespace}/{name} missing from the dry-run output"))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()).unwrap_or_default()
}

/// No `*` anywhere in a Role's or ClusterRole's rules, and no non-resource URLs.
fn assert_no_wildcards(role: &Value) {
    let (kind, ns, name) = key(role);
    for rule in role["rules"].as_array().expect("rules") {
        for field in ["verbs", "resources", "apiGroups", "resourceNames"] {
            let values = strings(&rule[field]);
            assert!(!values.iter().any(|v| v.contains('*')), "{kind} {ns}/{name}: wildcard in {field}: {rule}");
        }
        assert!(rule.get("nonResourceURLs").is_none(), "{kind} {ns}/{name}: nonResourceURLs granted: {rule}");
    }
}

/// (apiGroup, resource) → verbs.
type Grants = BTreeMap<(String, String), BTreeSet<String>>;

/// A role's grants, merged over its rules.
fn grants(role: &Value) -> Grants {
    let mut map = Grants::new();
    for rule in role["rules"].as_array().expect("rules") {
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                map.entry((group.clone(), resource)).or_default().extend(strings(&rule["verbs"]));
            }
        }
    }
    map
}

fn expect_grants(entries: &[(&str, &str, &[&str])]) -> Grants {
    entries
        .iter()
        .map(|(g, r, verbs)| ((g.to_string(), r.to_string()), verbs.iter().map(|v| v.to_string()).collect()))
        .collect()
}

/// Make a serving certificate with the script into `dir`; returns the Secret manifest it prints.
fn gen_certs(dir: &Path) -> String {
    let out = Command::new(repo_root().join("scripts/gen-webhook-certs.sh"))
        .arg("--dir")
        .arg(dir)
        .output()
        .expect("run scripts/gen-webhook-certs.sh");
    assert!(out.status.success(), "gen-webhook-certs.sh: {}", text(&out));
    String::from_utf8(out.stdout).expect("UTF-8 manifest")
}

#[test]
fn deploy_tree_passes_a_server_side_dry_run() {
    let cp = control_plane();
    let ns = TestNamespace::prepare(&cp);

    let out = cp
        .kubectl()
        .current_dir(repo_root())
        .args(["apply", "--dry-run=server", "-k", "deploy/", "-o", "json"])
        .output()
        .expect("run kubectl apply -k deploy/");
    assert!(out.status.success(), "kubectl apply --dry-run=server -k deploy/ failed: {}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("PodSecurity"), "the manifests violate the namespace's Pod Security level: {stderr}");
    let list: Value = serde_json::from_slice(&out.stdout).expect("kubectl -o json output");
    let items = list["items"].as_array().expect("a List of objects").clone();

    // Every object the tree should hold, and nothing unexpected.
    let expected: BTreeSet<(String, String, String)> = [
        ("Namespace", "", NS),
        ("ServiceAccount", NS, "clusterip-controller"),
        ("ClusterRole", "", "clusterip-controller"),
        ("ClusterRoleBinding", "", "clusterip-controller"),
        ("Role", NS, "clusterip-controller-leases"),
        ("RoleBinding", NS, "clusterip-controller-leases"),
        ("Deployment", NS, "clusterip-controller"),
        ("PodDisruptionBudget", NS, "clusterip-controller"),
        ("Service", NS, "clusterip-webhook"),
        ("NetworkPolicy", NS, "clusterip-controller"),
        ("MutatingWebhookConfiguration", "", "clusterip"),
        ("ValidatingWebhookConfiguration", "", "clusterip"),
        // The node agent (deploy/agent), included as a resource.
        ("ServiceAccount", "kube-system", "clusterip-agent"),
        ("ClusterRole", "", "clusterip-agent"),
        ("ClusterRoleBinding", "", "clusterip-agent"),
        ("DaemonSet", "kube-system", "clusterip-agent"),
    ]
    .iter()
    .map(|(k, n, m)| (k.to_string(), n.to_string(), m.to_string()))
    .collect();
    let got: BTreeSet<_> = items.iter().map(key).collect();
    assert_eq!(got, expected, "objects in the dry-run output");

    // RBAC: no wildcards anywhere; the controller's grants are exactly what its code calls.
    for role in items.iter().filter(|o| matches!(o["kind"].as_str(), Some("ClusterRole" | "Role"))) {
        assert_no_wildcards(role);
    }
    let controller_role = find(&items, "ClusterRole", "", "clusterip-controller");
    assert_eq!(
        grants(controller_role),
        expect_grants(&[
            ("", "services", &["get", "list", "watch"]),
            ("networking.k8s.io", "servicecidrs", &["get", "list", "watch", "patch"]),
            ("networking.k8s.io", "servicecidrs/status", &["patch"]),
            ("networking.k8s.io", "ipaddresses", &["get", "list", "watch", "create", "delete"]),
            ("events.k8s.io", "events", &["create", "patch"]),
            ("", "nodes", &["list"]),
        ]),
        "controller ClusterRole"
    );
    let lease_role = find(&items, "Role", NS, "clusterip-controller-leases");
    // Leader election and (ipaddress backend) address block Leases, renewed by update;
    // watched for hand-over requests, which are written by patch.
    assert_eq!(
        grants(lease_role),
        expect_grants(&[("coordination.k8s.io", "leases", &["get", "list", "watch", "create", "delete", "update", "patch"]), ("", "configmaps", &["list", "create", "update", "delete"])]),
        "lease Role"
    );
    for binding in [find(&items, "ClusterRoleBinding", "", "clusterip-controller"), find(&items, "RoleBinding", NS, "clusterip-controller-leases")] {
        let subjects = binding["subjects"].as_array().expect("subjects");
        assert_eq!(subjects.len(), 1, "{binding}");
        assert_eq!((subjects[0]["kind"].as_str(), subjects[0]["namespace"].as_str(), subjects[0]["name"].as_str()), (Some("ServiceAccount"), Some(NS), Some("clusterip-controller")));
    }
    // The agent watches (never a single get) and writes events.k8s.io Events: no core
    // Events, no update.
    assert_eq!(
        grants(find(&items, "ClusterRole", "", "clusterip-agent")),
        expect_grants(&[
            ("", "services", &["list", "watch"]),
            ("", "nodes", &["list", "watch"]),
            ("discovery.k8s.io", "endpointslices", &["list", "watch"]),
            ("events.k8s.io", "events", &["create", "patch"]),
        ]),
        "agent ClusterRole"
    );
    let agent_binding = find(&items, "ClusterRoleBinding", "", "clusterip-agent");
    assert_eq!(agent_binding["roleRef"]["name"], "clusterip-agent", "{agent_binding}");
    let subjects = agent_binding["subjects"].as_array().expect("subjects");
    assert_eq!(subjects.len(), 1, "{agent_binding}");
    assert_eq!((subjects[0]["kind"].as_str(), subjects[0]["namespace"].as_str(), subjects[0]["name"].as_str()), (Some("ServiceAccount"), Some("kube-system"), Some("clusterip-agent")));

    // The Deployment.
    let deploy = find(&items, "Deployment", NS, "clusterip-controller");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "clusterip-controller");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    assert!(pod["affinity"]["podAntiAffinity"].is_object(), "pod anti-affinity: {pod}");
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert_eq!(c["image"], "clusterip:dev");
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(strings(&sc["capabilities"]["drop"]), vec!["ALL".to_string()]);
    assert!(sc["capabilities"].get("add").is_none(), "no capability added: {sc}");
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    for what in ["requests", "limits"] {
        for res in ["cpu", "memory"] {
            assert!(c["resources"][what][res].is_string(), "resources.{what}.{res} missing: {}", c["resources"]);
        }
    }
    let args = strings(&c["args"]);
    assert_eq!(args.first().map(String::as_str), Some("controller"), "{args:?}");
    assert!(args.contains(&format!("--leader-elect-lease-name={LEASE}")), "the Lease the Role names: {args:?}");
    let port_of = |name: &str| {
        c["ports"].as_array().expect("ports").iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("container port {name}"))["containerPort"]
            .as_i64()
            .expect("containerPort")
    };
    let (webhook_port, metrics_port, health_port) = (port_of("webhook"), port_of("metrics"), port_of("health"));
    assert!(args.contains(&format!("--webhook-bind-address=0.0.0.0:{webhook_port}")), "{args:?}");
    assert!(args.contains(&format!("--metrics-bind-address=0.0.0.0:{metrics_port}")), "{args:?}");
    assert!(args.contains(&format!("--health-probe-bind-address=0.0.0.0:{health_port}")), "{args:?}");
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")] {
        assert_eq!(c[probe]["httpGet"]["path"], path, "{probe}");
        // Never the metrics port: its clients must not be able to crowd the probes out.
        assert_eq!(c[probe]["httpGet"]["port"], "health", "{probe} on the health-probe port");
    }
    let env: BTreeMap<String, String> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?.to_string(), e["valueFrom"]["fieldRef"]["fieldPath"].as_str()?.to_string())))
        .collect();
    assert_eq!(env.get("POD_NAME").map(String::as_str), Some("metadata.name"));
    assert_eq!(env.get("POD_NAMESPACE").map(String::as_str), Some("metadata.namespace"));
    // The serving certificate: the Secret, mounted where --tls-*-file point.
    let volume = pod["volumes"].as_array().expect("volumes").iter().find(|v| v["secret"]["secretName"] == SECRET).expect("Secret volume");
    let mount = c["volumeMounts"].as_array().expect("mounts").iter().find(|m| m["name"] == volume["name"]).expect("Secret mounted");
    let dir = mount["mountPath"].as_str().expect("mountPath");
    assert!(args.contains(&format!("--tls-cert-file={dir}/tls.crt")), "{args:?}");
    assert!(args.contains(&format!("--tls-private-key-file={dir}/tls.key")), "{args:?}");
    // Only the kube-apiserver may call the webhook: the client CA from the ConfigMap the
    // script makes, mounted where --client-ca-file points, and a name to match.
    let volume = pod["volumes"].as_array().expect("volumes").iter().find(|v| v["configMap"]["name"] == CLIENT_CA).expect("client CA ConfigMap volume");
    let mount = c["volumeMounts"].as_array().expect("mounts").iter().find(|m| m["name"] == volume["name"]).expect("client CA mounted");
    let dir = mount["mountPath"].as_str().expect("mountPath");
    assert!(args.contains(&format!("--client-ca-file={dir}/ca.crt")), "{args:?}");
    assert!(args.contains(&format!("--allowed-client-names={CLIENT_NAME}")), "the name the script's client certificate carries: {args:?}");
    // The shutdown drain and the settling of the replica's answers fit in the grace period.
    let flag = |name: &str| -> u64 {
        let v = args.iter().find_map(|a| a.strip_prefix(&format!("--{name}="))).unwrap_or_else(|| panic!("--{name} not set: {args:?}"));
        v.strip_suffix('s').and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("--{name}={v}: want whole seconds"))
    };
    let grace = pod["terminationGracePeriodSeconds"].as_u64().expect("terminationGracePeriodSeconds");
    assert!(flag("shutdown-delay-duration") + flag("shutdown-drain-timeout") + flag("in-flight-limit") + 5 <= grace, "delay + drain + in-flight limit + 5 s > {grace} s: {args:?}");

    // The NetworkPolicy: on the controller pods, ingress only; the webhook and health-probe
    // ports only from address blocks without the pod network (the kube-apiserver and the
    // kubelet are host-network: no selector can name them), never from everywhere; the
    // metrics port only from the scrapers' namespace.
    let np = find(&items, "NetworkPolicy", NS, "clusterip-controller");
    assert_eq!(np["spec"]["podSelector"]["matchLabels"], deploy["spec"]["selector"]["matchLabels"]);
    assert_eq!(strings(&np["spec"]["policyTypes"]), vec!["Ingress".to_string()], "egress stays open (apiserver, etcd)");
    let rules = np["spec"]["ingress"].as_array().expect("ingress rules");
    let ports_of = |r: &Value| r["ports"].as_array().map(|ps| ps.iter().map(|p| p["port"].clone()).collect::<Vec<_>>()).unwrap_or_default();
    for port in ["webhook", "health"] {
        let port_rules: Vec<&Value> = rules.iter().filter(|r| ports_of(r).contains(&Value::from(port))).collect();
        assert_eq!(port_rules.len(), 1, "{port}: {rules:?}");
        let from = port_rules[0]["from"].as_array().unwrap_or_else(|| panic!("the {port} rule names its sources"));
        assert!(!from.is_empty(), "{from:?}");
        for peer in from {
            assert!(peer["ipBlock"]["cidr"].is_string() && peer.get("podSelector").is_none() && peer.get("namespaceSelector").is_none(), "{peer}");
            assert!(!strings(&peer["ipBlock"]["except"]).is_empty(), "the pod network is left out of {port}: {peer}");
        }
    }
    let metrics_rules: Vec<&Value> = rules.iter().filter(|r| ports_of(r).contains(&Value::from("metrics"))).collect();
    assert_eq!(metrics_rules.len(), 1, "{rules:?}");
    let scrapers = metrics_rules[0]["from"].as_array().expect("the metrics port is open only to its scrapers");
    assert!(!scrapers.is_empty() && scrapers.iter().all(|p| p.get("namespaceSelector").is_some() || p.get("podSelector").is_some()), "{scrapers:?}");
    for r in rules {
        assert!(!ports_of(r).is_empty(), "a rule opening every port: {r}");
    }

    let pdb = find(&items, "PodDisruptionBudget", NS, "clusterip-controller");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], deploy["spec"]["selector"]["matchLabels"]);

    // The webhook Service: 443 → the container's webhook port.
    let svc = find(&items, "Service", NS, "clusterip-webhook");
    assert_eq!(svc["spec"]["selector"], deploy["spec"]["selector"]["matchLabels"]);
    let https = svc["spec"]["ports"].as_array().expect("ports").iter().find(|p| p["port"] == 443).expect("port 443");
    assert_eq!(https["targetPort"], "webhook");

    // Both webhook configurations: the Services' webhook first in each; the validating one
    // also checks ServiceCIDRs, as a check that never blocks (failurePolicy Ignore).
    for (kind, path, side_effects, count) in [("MutatingWebhookConfiguration", "/mutate", "NoneOnDryRun", 1), ("ValidatingWebhookConfiguration", "/validate", "None", 2)] {
        let cfg = find(&items, kind, "", "clusterip");
        let hooks = cfg["webhooks"].as_array().expect("webhooks");
        assert_eq!(hooks.len(), count, "{kind}");
        if count == 2 {
            let c = &hooks[1];
            assert_eq!((c["name"].as_str(), c["failurePolicy"].as_str(), c["sideEffects"].as_str()), (Some("validate-servicecidr.clusterip.allocator"), Some("Ignore"), Some("None")));
            assert_eq!(c["clientConfig"]["service"]["path"], "/validate-servicecidr");
            assert_eq!((strings(&c["rules"][0]["resources"]), strings(&c["rules"][0]["apiGroups"])), (vec!["servicecidrs".to_string()], vec!["networking.k8s.io".to_string()]));
        }
        let h = &hooks[0];
        assert_eq!(h["failurePolicy"], "Fail", "{kind}");
        assert_eq!(h["sideEffects"], side_effects, "{kind}");
        assert_eq!(h["timeoutSeconds"], 5, "{kind}");
        assert_eq!(strings(&h["admissionReviewVersions"]), vec!["v1".to_string()], "{kind}");
        let svc_ref = &h["clientConfig"]["service"];
        assert_eq!((svc_ref["namespace"].as_str(), svc_ref["name"].as_str(), svc_ref["path"].as_str()), (Some(NS), Some("clusterip-webhook"), Some(path)), "{kind}");
        assert_eq!(svc_ref["port"], 443, "{kind}");
        let rules = h["rules"].as_array().expect("rules");
        assert_eq!(rules.len(), 1, "{kind}");
        assert_eq!(strings(&rules[0]["resources"]), vec!["services".to_string()], "{kind}");
        assert_eq!(strings(&rules[0]["apiGroups"]), vec![String::new()], "{kind}");
        assert_eq!(strings(&rules[0]["operations"]).into_iter().collect::<BTreeSet<_>>(), ["CREATE", "UPDATE"].iter().map(|s| s.to_string()).collect(), "{kind}");
        let exprs = h["namespaceSelector"]["matchExpressions"].as_array().expect("namespaceSelector");
        let excluded = exprs
            .iter()
            .find(|e| e["key"] == "kubernetes.io/metadata.name" && e["operator"] == "NotIn")
            .map(|e| strings(&e["values"]))
            .unwrap_or_default();
        for system in ["kube-system", NS] {
            assert!(excluded.iter().any(|v| v == system), "{kind}: {system} not excluded: {exprs:?}");
        }
    }

    // The Secret the script makes is accepted in that namespace too.
    let certs = tempfile::tempdir().expect("tempdir");
    let manifest = gen_certs(&certs.path().join("certs"));
    let mut cmd = cp.kubectl();
    cmd.args(["apply", "--dry-run=server", "-f", "-"]);
    let out = run_with_stdin(cmd, manifest.as_bytes());
    assert!(out.status.success(), "the script's Secret: {}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("secret/{SECRET}")), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("configmap/{CLIENT_CA}")), "{}", text(&out));

    drop(ns);
    if namespace_phase(&cp).is_some() && !matches!(namespace_phase(&cp).as_deref(), Some("Active")) {
        panic!("namespace {NS} was not cleaned up");
    }
}

/// A path from `from` (a directory) to `to`, both absolute: kustomize refuses absolute
/// resource paths.
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    for c in &to[common..] {
        path.push(c.as_os_str());
    }
    path
}

/// `kubectl kustomize` of deploy/ with one of its optional components, through an overlay
/// outside deploy/ (inside it kustomize sees a cycle), as docs/operations.md says.
fn render_with_component(component: &str) -> String {
    let overlay = tempfile::tempdir().expect("tempdir");
    let rel = relative(&overlay.path().canonicalize().expect("canonical tempdir"), &repo_root());
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [{0}/deploy]\ncomponents: [{0}/deploy/{component}]\n",
            rel.display()
        ),
    )
    .expect("write overlay");
    let out = Command::new(kubectl_path()).arg("kustomize").arg(overlay.path()).output().expect("run kubectl kustomize");
    assert!(out.status.success(), "kubectl kustomize (deploy + {component} component): {}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn cert_manager_component_renders() {
    let root = repo_root();
    let yaml = render_with_component("cert-manager");
    for needle in [
        "kind: Issuer",
        "kind: Certificate",
        "name: clusterip-webhook\n  namespace: clusterip-system",
        &format!("secretName: {SECRET}"),
        "- clusterip-webhook.clusterip-system.svc\n",
        // The kube-apiserver's client certificate, and the controller trusting its CA.
        "name: clusterip-apiserver-webhook-client\n  namespace: clusterip-system",
        &format!("commonName: {CLIENT_NAME}"),
        "- client auth",
        "secretName: clusterip-apiserver-webhook-client\n",
    ] {
        assert!(yaml.contains(needle), "{needle:?} missing from the rendered tree:\n{yaml}");
    }
    assert_eq!(
        yaml.matches("cert-manager.io/inject-ca-from: clusterip-system/clusterip-webhook").count(),
        2,
        "the cainjector annotation on both webhook configurations:\n{yaml}"
    );

    // And the default tree (no component) has neither.
    let out = Command::new(kubectl_path()).arg("kustomize").arg(root.join("deploy")).output().expect("run kubectl kustomize");
    assert!(out.status.success(), "kubectl kustomize deploy/: {}", text(&out));
    let plain = String::from_utf8_lossy(&out.stdout);
    assert!(!plain.contains("cert-manager.io") && !plain.contains("kind: Certificate"), "deploy/ pulls in cert-manager:\n{plain}");
    assert!(plain.contains(&format!("name: {CLIENT_CA}")), "the client CA ConfigMap volume:\n{plain}");
    assert!(!yaml.contains(&format!("name: {CLIENT_CA}")), "with cert-manager the client CA comes from the Secret:\n{yaml}");
}

/// deploy/ + deploy/monitoring: the PodMonitors name container ports the pods they select
/// have, the agent's metrics move to the node's address, the dashboard ConfigMap holds
/// dashboard.json, and every controller metric the rules and the dashboard name exists.
/// (scripts/test-monitoring.sh checks the rest against a real Prometheus and apiserver.)
#[test]
fn monitoring_component_renders() {
    let root = repo_root();
    let yaml = render_with_component("monitoring");
    let docs: Vec<serde_json::Value> = yaml
        .split("\n---\n")
        .map(|d| serde_yaml::from_str(d).unwrap_or_else(|e| panic!("rendered YAML: {e}:\n{d}")))
        .collect();
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in the rendered tree:\n{yaml}"))
    };
    for (workload_kind, name) in [("Deployment", "clusterip-controller"), ("DaemonSet", "clusterip-agent")] {
        let monitor = find("PodMonitor", name);
        let workload = find(workload_kind, name);
        assert_eq!(monitor["metadata"]["namespace"], workload["metadata"]["namespace"], "{name}: a PodMonitor selects pods of its own namespace");
        let labels = &workload["spec"]["template"]["metadata"]["labels"];
        for (k, v) in monitor["spec"]["selector"]["matchLabels"].as_object().expect("matchLabels") {
            assert_eq!(&labels[k], v, "{name}: the PodMonitor's selector {k}={v} does not match the pods' labels {labels}");
        }
        assert_eq!(monitor["spec"]["jobLabel"], "app.kubernetes.io/name");
        assert_eq!(labels["app.kubernetes.io/name"], name, "the job label");
        let ports: Vec<&str> = workload["spec"]["template"]["spec"]["containers"][0]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .filter_map(|p| p["name"].as_str())
            .collect();
        for ep in monitor["spec"]["podMetricsEndpoints"].as_array().expect("endpoints") {
            let port = ep["port"].as_str().expect("port name");
            assert!(ports.contains(&port), "{name}: the PodMonitor scrapes port {port}, the pods have {ports:?}");
        }
    }
    let agent = &find("DaemonSet", "clusterip-agent")["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = agent["args"].as_array().expect("args").iter().filter_map(|a| a.as_str()).collect();
    assert!(args.contains(&"--metrics-bind-address=$(NODE_IP):10249"), "{args:?}");
    assert!(
        agent["env"].as_array().expect("env").iter().any(|e| e["name"] == "NODE_IP" && e["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"),
        "{agent}"
    );
    let dashboard = std::fs::read_to_string(root.join("deploy/monitoring/dashboard.json")).expect("dashboard.json");
    let cm = find("ConfigMap", "clusterip-dashboard");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(cm["data"]["clusterip.json"].as_str(), Some(dashboard.as_str()));
    assert!(find("PrometheusRule", "clusterip")["spec"]["groups"].as_array().is_some_and(|g| !g.is_empty()));

    // The controller's metric names the rules and the dashboard use are the controller's.
    // (A family is exposed once it has a series: one of each.)
    let metrics = clusterip::metrics::Metrics::new();
    let d = std::time::Duration::from_millis(1);
    metrics.webhook_latency("mutate", true, d, d);
    metrics.allocation("10.96.0.0/12", "dynamic", true, d);
    metrics.allocation("10.96.0.0/12", "dynamic", false, d);
    metrics.set_usage("10.96.0.0/12", 1, 2, 0, Some(100));
    metrics.set_unreadable(&[]);
    metrics.set_leading("clusterip-system/clusterip-controller", true);
    let exposed = metrics.encode();
    let rules = std::fs::read_to_string(root.join("deploy/monitoring/prometheusrule.yaml")).expect("prometheusrule.yaml");
    for source in [&rules, &dashboard] {
        for name in source.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("clusterip_") && !w.starts_with("clusterip_agent_")) {
            let base = ["_bucket", "_count", "_sum", "_total"].iter().fold(name, |n, s| n.strip_suffix(s).unwrap_or(n));
            assert!(exposed.contains(&format!("# TYPE {base} ")) || exposed.contains(&format!("\n{base}")), "{name}: not a metric of the controller");
        }
    }
}

#[test]
fn gen_webhook_certs_makes_a_serving_cert_for_the_service() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("certs");
    let manifest = gen_certs(&dir);
    for needle in ["kind: Secret", &format!("name: {SECRET}"), "namespace: clusterip-system", "type: kubernetes.io/tls", "tls.crt: ", "tls.key: ", "ca.crt: "] {
        assert!(manifest.contains(needle), "{needle:?} missing from the Secret manifest:\n{manifest}");
    }
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(&dir).output().expect("run openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    openssl(&["verify", "-CAfile", "ca.crt", "tls.crt"]);
    let ext = openssl(&["x509", "-in", "tls.crt", "-noout", "-ext", "subjectAltName,extendedKeyUsage"]);
    assert!(ext.contains("DNS:clusterip-webhook.clusterip-system.svc,"), "{ext}");
    assert!(ext.contains("DNS:clusterip-webhook.clusterip-system.svc.cluster.local"), "{ext}");
    assert!(ext.contains("TLS Web Server Authentication"), "{ext}");
    for needle in [format!("name: {CLIENT_CA}"), "kind: ConfigMap".to_string(), "ca.crt: |".to_string()] {
        assert!(manifest.contains(&needle), "{needle:?} missing from the manifests:\n{manifest}");
    }
    // The kube-apiserver's client certificate, from the client CA, for the Deployment's name,
    // and its AdmissionConfiguration + kubeconfig presenting it to the webhook Service.
    openssl(&["verify", "-CAfile", "client-ca.crt", "apiserver-webhook-client.crt"]);
    let subject = openssl(&["x509", "-in", "apiserver-webhook-client.crt", "-noout", "-subject", "-ext", "extendedKeyUsage"]);
    assert!(subject.contains(&format!("CN = {CLIENT_NAME}")) || subject.contains(&format!("CN={CLIENT_NAME}")), "{subject}");
    assert!(subject.contains("TLS Web Client Authentication"), "{subject}");
    let admission = std::fs::read_to_string(dir.join("apiserver/admission-config.yaml")).expect("admission-config.yaml");
    let admission: Value = serde_yaml::from_str(&admission).expect("AdmissionConfiguration YAML");
    assert_eq!((admission["apiVersion"].as_str(), admission["kind"].as_str()), (Some("apiserver.config.k8s.io/v1"), Some("AdmissionConfiguration")));
    let plugins: BTreeSet<String> = admission["plugins"].as_array().expect("plugins").iter().filter_map(|p| p["name"].as_str().map(str::to_string)).collect();
    assert_eq!(plugins, ["MutatingAdmissionWebhook", "ValidatingAdmissionWebhook"].iter().map(|s| s.to_string()).collect());
    for p in admission["plugins"].as_array().expect("plugins") {
        assert_eq!(p["configuration"]["kind"], "WebhookAdmissionConfiguration", "{p:?}");
        assert_eq!(p["configuration"]["kubeConfigFile"], "/etc/kubernetes/clusterip/admission-kubeconfig.yaml", "{p:?}");
    }
    let kubeconfig: Value = serde_yaml::from_str(&std::fs::read_to_string(dir.join("apiserver/admission-kubeconfig.yaml")).expect("kubeconfig")).expect("kubeconfig YAML");
    let users: Vec<&str> = kubeconfig["users"].as_array().expect("users").iter().filter_map(|u| u["name"].as_str()).collect();
    assert_eq!(users, vec!["clusterip-webhook.clusterip-system.svc", "clusterip-webhook.clusterip-system.svc:443"]);
    use base64::Engine as _;
    let embedded = base64::engine::general_purpose::STANDARD.decode(kubeconfig["users"][0]["user"]["client-certificate-data"].as_str().expect("certificate data")).expect("base64");
    assert_eq!(embedded, std::fs::read(dir.join("apiserver-webhook-client.crt")).expect("client certificate"));

    // A second run renews the serving certificate under the same CA: the caBundle stays.
    let bundle = |extra: &[&str]| {
        let out = Command::new(repo_root().join("scripts/gen-webhook-certs.sh"))
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .arg("--print-ca-bundle")
            .output()
            .expect("run gen-webhook-certs.sh");
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let first = bundle(&[]);
    let cert_before = std::fs::read(dir.join("tls.crt")).expect("tls.crt");
    assert_eq!(bundle(&[]), first, "renewal changed the CA");
    assert_ne!(std::fs::read(dir.join("tls.crt")).expect("tls.crt"), cert_before, "the serving certificate was not renewed");
    // A new CA keeps the previous one in the bundle during the rollover.
    let rolled = bundle(&["--new-ca"]);
    assert_ne!(rolled, first);
    openssl(&["verify", "-CAfile", "ca.crt", "tls.crt"]);
    let pem = String::from_utf8(std::fs::read(dir.join("ca-bundle.crt")).expect("ca-bundle.crt")).expect("PEM");
    assert_eq!(pem.matches("BEGIN CERTIFICATE").count(), 2, "{pem}");
}

/// A role as docs/operations.md names it: (kind, namespace, name).
type RoleKey = (String, String, String);

/// The RBAC tables of docs/operations.md (section "## RBAC"): each line `ClusterRole
/// `name`` or `Role `namespace/name`` followed by a table whose first three columns are
/// API group (`""` for core), resources (comma-separated) and verbs (comma-separated).
fn documented_rbac(markdown: &str) -> Result<BTreeMap<RoleKey, Grants>, String> {
    let markdown = format!("\n{markdown}");
    let section = markdown.split("\n## ").find(|s| s.starts_with("RBAC\n")).ok_or("no section \"## RBAC\"")?;
    let code = |cell: &str| -> Result<String, String> {
        let inner = cell.strip_prefix('`').and_then(|c| c.strip_suffix('`')).ok_or_else(|| format!("{cell:?}: want one `code` span"))?;
        Ok(if inner == "\"\"" { String::new() } else { inner.to_string() })
    };
    let mut roles = BTreeMap::new();
    let mut current: Option<(RoleKey, Grants)> = None;
    let mut rows = 0;
    for (n, line) in section.lines().enumerate() {
        let n = n + 1; // counted from the "## RBAC" line
        let heading = line.strip_prefix("ClusterRole `").map(|r| ("ClusterRole", r)).or_else(|| line.strip_prefix("Role `").map(|r| ("Role", r)));
        if let Some((kind, rest)) = heading {
            let name = rest.split('`').next().unwrap_or_default();
            let (namespace, name) = match kind {
                "Role" => name.split_once('/').ok_or_else(|| format!("RBAC section, line {n}: Role {name:?} without its namespace/"))?,
                _ => ("", name),
            };
            if let Some((key, grants)) = current.take() {
                roles.insert(key, grants);
            }
            current = Some(((kind.to_string(), namespace.to_string(), name.to_string()), BTreeMap::new()));
            rows = 0;
            continue;
        }
        let Some(row) = line.strip_prefix('|') else { continue };
        let Some((key, grants)) = current.as_mut() else { return Err(format!("RBAC section, line {n}: a table before any role line: {line}")) };
        rows += 1;
        // The header and the |---| line.
        if rows <= 2 {
            continue;
        }
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let [group, resources, verbs, ..] = cells[..] else { return Err(format!("RBAC section, line {n} ({key:?}): fewer than three columns: {line}")) };
        let group = code(group).map_err(|e| format!("RBAC section, line {n}, API group: {e}"))?;
        let verbs: BTreeSet<String> = verbs.split(',').map(|v| v.trim().to_string()).collect();
        for resource in resources.split(',') {
            let resource = code(resource.trim()).map_err(|e| format!("RBAC section, line {n}, resource: {e}"))?;
            if grants.insert((group.clone(), resource.clone()), verbs.clone()).is_some() {
                return Err(format!("RBAC section, line {n} ({key:?}): {group:?} {resource} in two rows"));
            }
        }
    }
    if let Some((key, grants)) = current {
        roles.insert(key, grants);
    }
    match roles.iter().find(|(_, g)| g.is_empty()) {
        Some((key, _)) => Err(format!("{key:?}: no table under it")),
        None => Ok(roles),
    }
}

/// docs/operations.md's RBAC tables hold exactly the rules of deploy/ (every ClusterRole
/// and Role the tree renders, the agent's included), so the two cannot drift apart.
#[test]
fn rbac_tables_in_operations_md_are_the_rules_of_deploy() {
    let root = repo_root();
    let markdown = std::fs::read_to_string(root.join("docs/operations.md")).expect("docs/operations.md");
    let documented = documented_rbac(&markdown).unwrap_or_else(|e| panic!("docs/operations.md: {e}"));

    let out = Command::new(kubectl_path()).arg("kustomize").arg(root.join("deploy")).output().expect("run kubectl kustomize");
    assert!(out.status.success(), "kubectl kustomize deploy/: {}", text(&out));
    let yaml = String::from_utf8_lossy(&out.stdout);
    let mut shipped = BTreeMap::new();
    for doc in yaml.split("\n---\n") {
        let obj: Value = serde_yaml::from_str(doc).unwrap_or_else(|e| panic!("rendered YAML: {e}:\n{doc}"));
        if !matches!(obj["kind"].as_str(), Some("ClusterRole" | "Role")) {
            continue;
        }
        for rule in obj["rules"].as_array().expect("rules") {
            // The tables have no column for them: a rule narrowed by name needs one first.
            assert!(rule.get("resourceNames").is_none(), "{:?}: a rule with resourceNames, which the tables cannot show: {rule}", key(&obj));
        }
        shipped.insert(key(&obj), grants(&obj));
    }
    assert_eq!(shipped.len(), 3, "the controller's ClusterRole and lease Role, the agent's ClusterRole: {:?}", shipped.keys());
    assert_eq!(documented, shipped, "docs/operations.md's RBAC tables (left) against deploy/ (right)");
}

#[test]
fn documented_rbac_reads_each_role_and_refuses_a_role_without_a_table() {
    let md = "# x\n\n## RBAC\n\nClusterRole `a`:\n\n| API group | resource | verbs | why |\n|---|---|---|---|\n\
              | `\"\"` | `services`, `nodes` | list, watch | a \\| b |\n\nRole `ns/b` (namespaced):\n\n| g | r | v | w |\n|---|---|---|---|\n\
              | `coordination.k8s.io` | `leases` | get | x |\n\n## Next\n\nClusterRole `c`:\n";
    let roles = documented_rbac(md).expect("parses");
    let role = |kind: &str, ns: &str, name: &str| roles.get(&(kind.to_string(), ns.to_string(), name.to_string()));
    assert_eq!(role("ClusterRole", "", "a"), Some(&expect_grants(&[("", "services", &["list", "watch"]), ("", "nodes", &["list", "watch"])])));
    assert_eq!(role("Role", "ns", "b"), Some(&expect_grants(&[("coordination.k8s.io", "leases", &["get"])])));
    assert_eq!(roles.len(), 2, "the next section's role is not RBAC's: {roles:?}");
    assert!(documented_rbac("## RBAC\n\nClusterRole `a`:\n\nprose only\n").is_err());
    assert!(documented_rbac("## RBAC\n\nRole `no-namespace`:\n\n| g | r | v |\n|---|---|---|\n| `x` | `y` | get |\n").is_err());
}

/// One step of an install order, as the docs and headers write it.
#[derive(Debug, PartialEq)]
enum Step {
    Certificates,
    AllButWebhooks,
    WaitForReplica,
    Everything,
}

/// The install order in `text` after the line containing `marker`: from its first command
/// line to the next blank line or code fence (`#` comment markers stripped), each command
/// read as a [`Step`].
fn install_order(text: &str, marker: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    for line in text.lines().skip_while(|l| !l.contains(marker)).skip(1).map(|l| l.trim_start_matches('#').trim()) {
        if !steps.is_empty() && (line.is_empty() || line.starts_with("```")) {
            break;
        }
        let step = if line.starts_with("scripts/gen-webhook-certs.sh --apply") {
            Step::Certificates
        } else if line.starts_with("kubectl apply -k deploy/ -l 'app.kubernetes.io/component!=admission-registration'") {
            Step::AllButWebhooks
        } else if line.starts_with("kubectl -n clusterip-system rollout status deploy/clusterip-controller") {
            Step::WaitForReplica
        } else if line.starts_with("kubectl apply -k deploy/") {
            Step::Everything
        } else {
            continue;
        };
        steps.push(step);
    }
    steps
}

/// Every install order the repository gives registers the `failurePolicy: Fail` webhooks
/// only after a controller replica is ready: docs/operations.md's, the README's, and the
/// headers of deploy/kustomization.yaml and scripts/gen-webhook-certs.sh, which once gave a
/// shorter order (certificates, `kubectl apply -k deploy/`, certificates) that registered
/// them at once.
#[test]
fn every_install_order_registers_the_webhooks_after_a_ready_replica() {
    let root = repo_root();
    let safe = [Step::Certificates, Step::AllButWebhooks, Step::WaitForReplica, Step::Everything, Step::Certificates];
    for (file, marker) in [
        ("docs/operations.md", "So register last"),
        ("README.md", "## Install in your cluster"),
        ("deploy/kustomization.yaml", "# Install order"),
        ("scripts/gen-webhook-certs.sh", "# Install order"),
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(text.contains(marker), "{file}: {marker:?} not found");
        assert_eq!(install_order(&text, marker), safe, "{file}: the install order after {marker:?}");
    }
}
