//! The webhook's HTTPS endpoint as a client sees it: real TLS (the dev CA), bad bodies get a
//! clear 400 and leave the server serving, a rotated serving certificate is picked up
//! without a restart, and /metrics, /healthz, /readyz answer with Kubernetes-style names.

mod controller_common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clusterip_test_support::{control_plane, unique_name, ControlPlane};
use controller_common::Controller;

fn start(cp: &ControlPlane, cert: &Path, key: &Path) -> Controller {
    let name = unique_name("http");
    let (etcd, prefix, kubeconfig) = (cp.etcd_endpoints().join(","), format!("/clusterip-test/{name}"), cp.kubeconfig().display().to_string());
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let c = Controller::start([
        "--backend",
        "etcd",
        "--service-cidr",
        "198.18.200.0/24",
        "--etcd-endpoints",
        &etcd,
        "--etcd-prefix",
        &prefix,
        "--kubeconfig",
        &kubeconfig,
        "--leader-elect-namespace",
        "default",
        "--leader-elect-lease-name",
        &name,
        "--tls-cert-file",
        &cert,
        "--tls-private-key-file",
        &key,
    ]);
    let deadline = Instant::now() + Duration::from_secs(120);
    while http_get(c.metrics_port, "/readyz").0 != 200 {
        assert!(Instant::now() < deadline, "controller not ready within 120s:\n{}", c.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    c
}

/// (status, body) of a plain-HTTP GET on the metrics port, via curl.
fn http_get(port: u16, path: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "5", "-w", "\n%{http_code}", &format!("http://127.0.0.1:{port}{path}")])
        .output()
        .expect("curl");
    split_status(&String::from_utf8_lossy(&out.stdout))
}

fn split_status(out: &str) -> (u16, String) {
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", out));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// (status, body) of an HTTPS POST to the webhook, verifying its certificate with `ca`.
fn post(port: u16, ca: &Path, path: &str, body: &Path, http1: bool) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "10", if http1 { "--http1.1" } else { "--http2" }, "--cacert"])
        .arg(ca)
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(format!("@{}", body.display()))
        .args(["-w", "\n%{http_code}", &format!("https://127.0.0.1:{port}{path}")])
        .output()
        .expect("curl");
    split_status(&String::from_utf8_lossy(&out.stdout))
}

/// SHA-256 fingerprint of the certificate the webhook serves now.
fn served_fingerprint(port: u16) -> String {
    let script = format!("openssl s_client -connect 127.0.0.1:{port} </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256");
    let out = Command::new("sh").args(["-c", &script]).output().expect("openssl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn file_fingerprint(cert: &Path) -> String {
    let out = Command::new("openssl").args(["x509", "-noout", "-fingerprint", "-sha256", "-in"]).arg(cert).output().expect("openssl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A new serving certificate for 127.0.0.1 signed by the dev cluster's CA.
fn issue_cert(pki: &Path, dir: &Path, tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let (key, csr, crt, ext) = (dir.join(format!("{tag}.key")), dir.join(format!("{tag}.csr")), dir.join(format!("{tag}.crt")), dir.join("ext"));
    std::fs::write(&ext, "subjectAltName = IP:127.0.0.1\nextendedKeyUsage = serverAuth\n").expect("ext");
    let ok = Command::new("openssl")
        .args(["req", "-newkey", "rsa:2048", "-nodes", "-subj", &format!("/CN={tag}"), "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&csr)
        .stderr(Stdio::null())
        .status()
        .expect("openssl req")
        .success()
        && Command::new("openssl")
            .args(["x509", "-req", "-days", "1", "-in"])
            .arg(&csr)
            .arg("-CA")
            .arg(pki.join("ca.crt"))
            .arg("-CAkey")
            .arg(pki.join("ca.key"))
            .args(["-CAcreateserial", "-CAserial"])
            .arg(dir.join("ca.srl"))
            .arg("-extfile")
            .arg(&ext)
            .arg("-out")
            .arg(&crt)
            .stderr(Stdio::null())
            .status()
            .expect("openssl x509")
            .success();
    assert!(ok, "issuing a test certificate failed");
    (crt, key)
}

#[test]
fn bad_bodies_get_a_clear_400_and_the_server_keeps_serving() {
    let cp = control_plane();
    let pki = cp.dir().join("pki");
    let c = start(&cp, &pki.join("webhook.crt"), &pki.join("webhook.key"));
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = pki.join("ca.crt");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "empty body"),
        ("garbage", b"\x00\xffnot json at all".to_vec(), "not an AdmissionReview"),
        ("truncated", br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"#.to_vec(), "not an AdmissionReview"),
        ("no request", br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(), "no request"),
        ("oversized", vec![b' '; 4 * 1024 * 1024], "larger than"),
    ];
    for (what, body, says) in cases {
        let file = dir.path().join("body");
        std::fs::write(&file, &body).expect("write body");
        for path in ["/mutate", "/validate"] {
            // The oversized body over HTTP/1.1: over HTTP/2 the early 400 is followed by a
            // stream reset (the body is never read), which curl reports as a failed transfer.
            let (code, text) = post(c.webhook_port, &ca, path, &file, what == "oversized");
            assert_eq!(code, 400, "{what} on {path}: {text}");
            assert!(text.contains(says), "{what} on {path}: {text:?} lacks {says:?}");
        }
    }
    // Still serving: a well-formed review gets an address (and one for an address outside
    // the range is refused), which also fills the allocator's metric families.
    let review = |uid: &str, spec: serde_json::Value| {
        serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Service"},
                "resource": {"group": "", "version": "v1", "resource": "services"},
                "name": "web", "namespace": "default", "operation": "CREATE",
                "userInfo": {"username": "test"}, "dryRun": false,
                "object": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"}, "spec": spec}
            }
        })
    };
    let file = dir.path().join("review");
    std::fs::write(&file, review("u1", serde_json::json!({"ports": [{"port": 80}]})).to_string()).expect("write");
    let (code, text) = post(c.webhook_port, &ca, "/mutate", &file, false);
    assert_eq!(code, 200, "{text}");
    let answer: serde_json::Value = serde_json::from_str(&text).expect("AdmissionReview answer");
    assert_eq!(answer["response"]["uid"], "u1");
    assert_eq!(answer["response"]["allowed"], true, "{text}");
    assert_eq!(answer["response"]["patchType"], "JSONPatch", "{text}");
    std::fs::write(&file, review("u2", serde_json::json!({"clusterIP": "198.18.99.9", "ports": [{"port": 80}]})).to_string()).expect("write");
    let (code, text) = post(c.webhook_port, &ca, "/mutate", &file, false);
    assert_eq!(code, 200, "{text}");
    let answer: serde_json::Value = serde_json::from_str(&text).expect("AdmissionReview answer");
    assert_eq!(answer["response"]["allowed"], false, "{text}");
    assert_eq!(answer["response"]["status"]["code"], 422, "{text}");
    assert!(answer["response"]["status"]["message"].as_str().unwrap_or("").contains("The range of valid IPs is 198.18.200.0/24"), "{text}");

    assert_eq!(http_get(c.metrics_port, "/healthz"), (200, "ok".to_string()));
    let (code, metrics) = http_get(c.metrics_port, "/metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains("clusterip_webhook_bad_requests_total{operation=\"mutate\"} 5"), "{metrics}");
    for name in [
        "clusterip_allocator_allocated_ips",
        "clusterip_allocator_available_ips",
        "clusterip_allocator_allocation_total",
        "clusterip_allocator_allocation_errors_total",
        "clusterip_allocator_allocation_duration_seconds",
        "clusterip_webhook_admission_duration_seconds",
    ] {
        assert!(metrics.contains(&format!("# TYPE {name}")) || metrics.contains(&format!("# TYPE {}", name.trim_end_matches("_total"))), "{name} missing from /metrics:\n{metrics}");
    }
}

#[test]
fn a_rotated_serving_certificate_is_served_without_a_restart() {
    let cp = control_plane();
    let pki = cp.dir().join("pki");
    let dir = tempfile::tempdir().expect("tempdir");
    let (crt, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let (first_crt, first_key) = issue_cert(&pki, dir.path(), "first");
    std::fs::copy(&first_crt, &crt).expect("copy");
    std::fs::copy(&first_key, &key).expect("copy");
    let c = start(&cp, &crt, &key);
    assert_eq!(served_fingerprint(c.webhook_port), file_fingerprint(&first_crt));

    let (second_crt, second_key) = issue_cert(&pki, dir.path(), "second");
    assert_ne!(file_fingerprint(&first_crt), file_fingerprint(&second_crt));
    // Rotate as a Secret volume does: new files renamed into place.
    std::fs::copy(&second_key, dir.path().join("tls.key.new")).expect("copy");
    std::fs::copy(&second_crt, dir.path().join("tls.crt.new")).expect("copy");
    std::fs::rename(dir.path().join("tls.key.new"), &key).expect("rename");
    std::fs::rename(dir.path().join("tls.crt.new"), &crt).expect("rename");
    let want = file_fingerprint(&second_crt);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = served_fingerprint(c.webhook_port);
        if got == want {
            break;
        }
        assert!(Instant::now() < deadline, "still serving {got} 30s after the rotation (want {want})");
        std::thread::sleep(Duration::from_millis(200));
    }
}
