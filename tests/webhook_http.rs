//! The webhook's HTTPS endpoint as a client sees it: real TLS (the dev CA); only callers
//! with the kube-apiserver's client certificate get an answer (anyone else gets none and
//! reserves nothing); bad bodies get a clear 400 and leave the server serving; slow clients
//! are disconnected while others are served; accept() failures (out of descriptors) back off
//! instead of spinning; SIGTERM drains (readyz 503, requests in flight answered, exit 0); a rotated serving certificate is picked up without a restart; and
//! /metrics, /healthz, /readyz answer with Kubernetes-style names.

mod controller_common;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clusterip::store::AllocationStore;
use clusterip_test_support::poll::POLL;
use clusterip_test_support::{control_plane, eventually, eventually_ok, unique_name, wait_ok, wait_within, within, ControlPlane};
use controller_common::admission_client::{allowed, post_head, post_raw, review, tls_client, tls_connect};
use controller_common::{apiserver_client_cert, client_auth_args, metric, Controller};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RANGE: &str = "198.18.200.0/24";

/// A controller (etcd backend, range [`RANGE`], records under an etcd prefix of its own,
/// returned beside it) serving `cert`/`key`, accepting the kube-apiserver's client
/// certificate, with `extra` flags; returned once ready.
fn start(cp: &ControlPlane, cert: &Path, key: &Path, extra: &[&str]) -> (Controller, String) {
    let name = unique_name("http");
    let (etcd, prefix, kubeconfig) = (cp.etcd_endpoints().join(","), format!("/clusterip-test/{name}"), cp.kubeconfig().display().to_string());
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let auth = client_auth_args(cp);
    let args = [
        "--backend",
        "etcd",
        "--service-cidr",
        RANGE,
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
    ];
    let c = Controller::start(args.iter().copied().chain(auth.iter().map(String::as_str)).chain(extra.iter().copied()));
    let ready = wait_within(Duration::from_secs(120), Duration::from_millis(100), || (http_get(c.metrics_port, "/readyz").0 == 200).then_some(()));
    assert!(ready.is_some(), "controller not ready within 120s:\n{}", c.log());
    (c, prefix)
}

fn serving_cert(cp: &ControlPlane) -> (PathBuf, PathBuf) {
    let pki = cp.dir().join("pki");
    (pki.join("webhook.crt"), pki.join("webhook.key"))
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

/// The client certificate a request presents.
#[derive(Clone, Copy)]
enum Caller<'a> {
    /// The kube-apiserver's (the only one the webhook accepts).
    Apiserver(&'a ControlPlane),
    /// None at all.
    Anonymous,
    /// Another certificate and key.
    Cert(&'a Path, &'a Path),
}

/// (status, body) of an HTTPS POST to the webhook, verifying its certificate with `ca`;
/// status 0 when no HTTP answer came.
fn post(port: u16, ca: &Path, caller: Caller, path: &str, body: &Path, http1: bool) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "--max-time", "10", if http1 { "--http1.1" } else { "--http2" }, "--cacert"]).arg(ca);
    let cert = match caller {
        Caller::Apiserver(cp) => Some(apiserver_client_cert(cp)),
        Caller::Anonymous => None,
        Caller::Cert(c, k) => Some((c.to_path_buf(), k.to_path_buf())),
    };
    if let Some((cert, key)) = cert {
        cmd.arg("--cert").arg(cert).arg("--key").arg(key);
    }
    let out = cmd
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(format!("@{}", body.display()))
        .args(["-w", "\n%{http_code}", &format!("https://127.0.0.1:{port}{path}")])
        .output()
        .expect("curl");
    split_status(&String::from_utf8_lossy(&out.stdout))
}

/// SHA-256 fingerprint of the certificate the webhook serves now.
fn served_fingerprint(cp: &ControlPlane, port: u16) -> String {
    let (crt, key) = apiserver_client_cert(cp);
    let script = format!(
        "openssl s_client -connect 127.0.0.1:{port} -cert {} -key {} </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256",
        crt.display(),
        key.display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().expect("openssl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn file_fingerprint(cert: &Path) -> String {
    let out = Command::new("openssl").args(["x509", "-noout", "-fingerprint", "-sha256", "-in"]).arg(cert).output().expect("openssl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn openssl(args: &[&str]) {
    let out = Command::new("openssl").args(args).stdin(Stdio::null()).output().expect("run openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A certificate `<dir>/<tag>.crt` (key `<tag>.key`) for subject CN `cn` with the
/// extensions `ext`, signed by `ca`/`ca_key`.
fn issue(ca: &Path, ca_key: &Path, dir: &Path, tag: &str, cn: &str, ext: &str) -> (PathBuf, PathBuf) {
    let p = |name: String| dir.join(name).display().to_string();
    let (crt, key, csr, extfile, serial) = (p(format!("{tag}.crt")), p(format!("{tag}.key")), p(format!("{tag}.csr")), p(format!("{tag}.ext")), p(format!("{tag}.srl")));
    std::fs::write(&extfile, ext).expect("ext");
    openssl(&["req", "-newkey", "rsa:2048", "-nodes", "-subj", &format!("/CN={cn}"), "-keyout", &key, "-out", &csr]);
    let (ca, ca_key) = (ca.display().to_string(), ca_key.display().to_string());
    openssl(&["x509", "-req", "-days", "1", "-in", &csr, "-CA", &ca, "-CAkey", &ca_key, "-CAcreateserial", "-CAserial", &serial, "-extfile", &extfile, "-out", &crt]);
    (crt.into(), key.into())
}

/// A new serving certificate for 127.0.0.1 signed by the dev cluster's CA.
fn issue_cert(pki: &Path, dir: &Path, tag: &str) -> (PathBuf, PathBuf) {
    issue(&pki.join("ca.crt"), &pki.join("ca.key"), dir, tag, tag, "subjectAltName = IP:127.0.0.1\nextendedKeyUsage = serverAuth\n")
}

/// Read until the peer closes the connection (EOF or an error), for at most `limit`; true
/// when it did. What was read is appended to `got`.
async fn closed_within<R: tokio::io::AsyncRead + Unpin>(r: &mut R, limit: Duration, got: &mut Vec<u8>) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, r.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[test]
fn bad_bodies_get_a_clear_400_and_the_server_keeps_serving() {
    let cp = control_plane();
    let (crt, key) = serving_cert(&cp);
    let (c, _) = start(&cp, &crt, &key, &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = cp.dir().join("pki/ca.crt");
    let apiserver = Caller::Apiserver(&cp);
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
            let (code, text) = post(c.webhook_port, &ca, apiserver, path, &file, what == "oversized");
            assert_eq!(code, 400, "{what} on {path}: {text}");
            assert!(text.contains(says), "{what} on {path}: {text:?} lacks {says:?}");
        }
    }
    // Still serving: a well-formed review gets an address (and one for an address outside
    // the range is refused), which also fills the allocator's metric families.
    let file = dir.path().join("review");
    std::fs::write(&file, review("u1", "web", serde_json::json!({"ports": [{"port": 80}]})).to_string()).expect("write");
    let (code, text) = post(c.webhook_port, &ca, apiserver, "/mutate", &file, false);
    assert_eq!(code, 200, "{text}");
    let answer: serde_json::Value = serde_json::from_str(&text).expect("AdmissionReview answer");
    assert_eq!(answer["response"]["uid"], "u1");
    assert_eq!(answer["response"]["allowed"], true, "{text}");
    assert_eq!(answer["response"]["patchType"], "JSONPatch", "{text}");
    std::fs::write(&file, review("u2", "web", serde_json::json!({"clusterIP": "198.18.99.9", "ports": [{"port": 80}]})).to_string()).expect("write");
    let (code, text) = post(c.webhook_port, &ca, apiserver, "/mutate", &file, false);
    assert_eq!(code, 200, "{text}");
    let answer: serde_json::Value = serde_json::from_str(&text).expect("AdmissionReview answer");
    assert_eq!(answer["response"]["allowed"], false, "{text}");
    assert_eq!(answer["response"]["status"]["code"], 422, "{text}");
    // An address in none of the cluster's ranges: stock Kubernetes' words for it.
    assert!(
        answer["response"]["status"]["message"].as_str().unwrap_or("").contains("failed to allocate IP 198.18.99.9: the provided network does not match the current range"),
        "{text}"
    );

    assert_eq!(http_get(c.metrics_port, "/healthz"), (200, "ok".to_string()));
    assert_eq!(http_get(c.health_port, "/readyz"), (200, "ok".to_string()));
    let (code, metrics) = http_get(c.metrics_port, "/metrics");
    assert_eq!(code, 200);
    // The body is OpenMetrics text (it ends in `# EOF`), and says so: Prometheus 3 refuses a
    // scrape without a Content-Type it knows.
    assert!(metrics.trim_end().ends_with("# EOF"), "{metrics}");
    let out = Command::new("curl").args(["-s", "-o", "/dev/null", "-w", "%{content_type}", &format!("http://127.0.0.1:{}/metrics", c.metrics_port)]).output().expect("curl");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "application/openmetrics-text; version=1.0.0; charset=utf-8");
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
    // The process, as every Prometheus client reports it, and the build it runs.
    for series in ["process_resident_memory_bytes ", "process_cpu_seconds_total ", "process_open_fds ", "process_start_time_seconds ", "process_max_fds "] {
        let value = metrics.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.parse::<f64>().ok());
        assert!(value.is_some_and(|v| v > 0.0), "{series}: {value:?} in\n{metrics}");
    }
    // (The binary's stamp, not this test's: a commit made while the suite runs rebuilds one
    // and not necessarily the other.)
    let prefix = format!("clusterip_build_info{{version=\"{}\",commit=\"", clusterip::metrics::VERSION);
    let stamp = metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.strip_suffix("\"} 1"))
        .unwrap_or_else(|| panic!("{prefix}…\"}} 1 missing from /metrics:\n{metrics}"));
    clusterip_test_support::assert_commit_stamp(stamp);
    // Counters whose label values are known are there at 0 before anything happened (the
    // alerts' increase() sees the first error).
    for series in [
        "clusterip_repair_ip_errors_total{type=\"leak\"} 0",
        "clusterip_repair_ip_errors_total{type=\"duplicate\"} 0",
        "clusterip_reconcile_errors_total{controller=\"service\"} 0",
        "clusterip_webhook_refused_connections_total{reason=\"client_certificate\"} 0",
        "clusterip_webhook_released_addresses_total{reason=\"in_flight_limit\"} 0",
        "clusterip_http_refused_connections_total{server=\"health\",reason=\"evicted\"} 0",
        "clusterip_allocator_allocation_errors_total{cidr=\"198.18.",
        // The etcd allocation map's size, from the first scrape.
        "clusterip_allocator_map_bytes{cidr=\"198.18.",
        // Per band of the range, from the first scrape.
        "clusterip_allocator_band_available_ips{cidr=\"198.18.",
        "\",band=\"static\"} ",
        "\",band=\"dynamic\"} ",
    ] {
        assert!(metrics.contains(series), "{series} missing from /metrics:\n{metrics}");
    }
}

/// Only the kube-apiserver makes admission act: a request without a client certificate,
/// with one from another CA (even for the apiserver's name), or with one from the right CA
/// for another name gets no HTTP answer at all, and the static address it asked for stays
/// free — the apiserver's certificate then gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_apiservers_client_certificate_there_is_no_answer_and_nothing_is_reserved() {
    let cp = control_plane();
    let (crt, key) = serving_cert(&cp);
    let (c, prefix) = start(&cp, &crt, &key, &[]);
    let pki = cp.dir().join("pki");
    let ca = pki.join("ca.crt");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // Another CA, and a client certificate from it carrying the apiserver's very name.
    let (other_ca, other_ca_key) = (d.join("other-ca.crt"), d.join("other-ca.key"));
    openssl(&[
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=not-the-dev-ca",
        "-keyout", &other_ca_key.display().to_string(), "-out", &other_ca.display().to_string(),
    ]);
    let client_ext = "extendedKeyUsage = clientAuth\n";
    let name = cp.var("CLUSTERIP_WEBHOOK_CLIENT_NAME").to_string();
    let (impostor_crt, impostor_key) = issue(&other_ca, &other_ca_key, d, "impostor", &name, client_ext);

    // A static address of the range (its static band is the first 16 addresses).
    let ip: IpAddr = "198.18.200.9".parse().expect("ip");
    let file = d.join("review");
    std::fs::write(&file, review("static", "static", serde_json::json!({"clusterIP": ip.to_string(), "ports": [{"port": 80}]})).to_string()).expect("write");
    let (admin_crt, admin_key) = (pki.join("admin.crt"), pki.join("admin.key"));
    let callers = [
        ("no client certificate", Caller::Anonymous),
        ("a certificate from another CA", Caller::Cert(&impostor_crt, &impostor_key)),
        ("a certificate of the dev CA for another name", Caller::Cert(&admin_crt, &admin_key)),
    ];
    for (what, caller) in callers {
        for http1 in [false, true] {
            let (code, text) = post(c.webhook_port, &ca, caller, "/mutate", &file, http1);
            assert_eq!(code, 0, "{what} (HTTP/1.1: {http1}) got an HTTP answer: {code} {text}");
            assert!(text.is_empty(), "{what}: {text}");
        }
    }
    let (_, metrics) = http_get(c.metrics_port, "/metrics");
    assert_eq!(metric(&metrics, "clusterip_webhook_refused_connections_total{reason=\"client_certificate\"}"), Some(6.0), "{metrics}");
    assert!(c.log().contains("refused a connection: no valid client certificate"), "{}", c.log());

    // Nothing was recorded...
    let range = clusterip::cidr::ServiceCidr::parse(RANGE).expect("range");
    let cfg = clusterip::store::etcd::EtcdConfig { endpoints: cp.etcd_endpoints(), prefix, ..Default::default() };
    let records = clusterip::store::etcd::EtcdStore::open(&cfg, vec![range.clone()]).await.expect("open the records");
    assert!(!records.has(ip).await.expect("read the records"), "{ip} recorded for a caller without the apiserver's certificate");
    drop(records);
    // ...and the apiserver's certificate gets the address.
    let (code, text) = post(c.webhook_port, &ca, Caller::Apiserver(&cp), "/mutate", &file, false);
    assert_eq!(code, 200, "{text}");
    let answer: serde_json::Value = serde_json::from_str(&text).expect("AdmissionReview answer");
    assert_eq!(answer["response"]["allowed"], true, "{ip} not free after the refused requests: {text}");
    let records = clusterip::store::etcd::EtcdStore::open(&cfg, vec![range]).await.expect("open the records");
    assert!(records.has(ip).await.expect("read the records"), "{ip} not recorded after the apiserver's request");
}

/// A client that never finishes its TLS handshake, one that sends its request headers a
/// byte at a time, and one that never sends the body it announced are each disconnected
/// (the last with a 408) within a bound, while other requests are answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_disconnected_while_others_are_served() {
    let cp = control_plane();
    let (crt, key) = serving_cert(&cp);
    // A short read timeout; the bounds asserted below are many times longer (a loaded machine).
    let (c, _) = start(&cp, &crt, &key, &["--webhook-read-timeout", "2s"]);
    let port = c.webhook_port;
    let connector = tls_client(&cp);
    let bound = Duration::from_secs(60);

    // 1. TCP, then silence: no TLS handshake.
    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    // 2. TLS with the right certificate, then request headers one byte every 200 ms.
    let mut loris = tls_connect(&connector, port).await.expect("TLS");
    let dribble = tokio::spawn(async move {
        let head = b"POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        let started = Instant::now();
        for b in head.iter().cycle() {
            if loris.write_all(&[*b]).await.is_err() || loris.flush().await.is_err() {
                return (true, started.elapsed());
            }
            // A closed connection shows on the read side first (the write may still succeed).
            let mut buf = [0u8; 64];
            if let Ok(r) = tokio::time::timeout(Duration::from_millis(200), loris.read(&mut buf)).await {
                if matches!(r, Ok(0) | Err(_)) {
                    return (true, started.elapsed());
                }
            }
            if started.elapsed() > Duration::from_secs(60) {
                return (false, started.elapsed());
            }
        }
        (false, started.elapsed())
    });
    // 3. TLS, complete headers announcing 1000 bytes, 10 sent.
    let mut no_body = tls_connect(&connector, port).await.expect("TLS");
    no_body.write_all(post_head("/mutate", 1000).as_bytes()).await.expect("write head");
    no_body.write_all(b"{\"apiVersi").await.expect("write some body");

    // Meanwhile a well-behaved caller is answered.
    let body = review("meanwhile", "meanwhile", serde_json::json!({"ports": [{"port": 80}]})).to_string();
    let answer = post_raw(&connector, port, "/mutate", body.as_bytes()).await.expect("a normal request");
    assert!(allowed(&answer), "{answer}");

    let mut got = Vec::new();
    assert!(closed_within(&mut silent, bound, &mut got).await, "a connection without a TLS handshake still open after {bound:?}");
    let mut got = Vec::new();
    assert!(closed_within(&mut no_body, bound, &mut got).await, "a request without its body still open after {bound:?}");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "the unfinished body got: {text:?}");
    assert!(text.contains("request body not received within 2s"), "{text:?}");
    let (closed, after) = dribble.await.expect("slow-loris task");
    assert!(closed, "a client sending its headers a byte at a time was still connected after {after:?}");

    // And still serving.
    let answer = post_raw(&connector, port, "/mutate", body.replace("meanwhile", "after").as_bytes()).await.expect("a request afterwards");
    assert!(allowed(&answer), "{answer}");
    let (_, metrics) = http_get(c.metrics_port, "/metrics");
    assert!(metric(&metrics, "clusterip_webhook_refused_connections_total{reason=\"handshake_timeout\"}").unwrap_or(0.0) >= 1.0, "{metrics}");
}

/// SIGTERM while admissions stream in: /readyz turns 503 at once while requests are still
/// answered, then the listener closes, a request that was in flight across all of it is
/// answered, the answers no kube-apiserver will record (reviews posted straight to the
/// webhook) are released once past the in-flight limit (10 s here), the address pool is
/// returned and the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_readyz_503_requests_in_flight_answered_exit_0() {
    let cp = control_plane();
    let (crt, key) = serving_cert(&cp);
    let (mut c, _) = start(&cp, &crt, &key, &["--shutdown-delay-duration", "10s", "--shutdown-drain-timeout", "60s", "--webhook-read-timeout", "120s", "--apiserver-request-timeout", "5s", "--in-flight-limit", "10s"]);
    let port = c.webhook_port;
    let connector = tls_client(&cp);

    // A request in flight: headers and half of its body sent now, the rest after the
    // listener has closed.
    let body = review("in-flight", "in-flight", serde_json::json!({"ports": [{"port": 80}]})).to_string();
    let (first, rest) = body.as_bytes().split_at(body.len() / 2);
    let mut in_flight = tls_connect(&connector, port).await.expect("TLS");
    in_flight.write_all(post_head("/mutate", body.len()).as_bytes()).await.expect("head");
    in_flight.write_all(first).await.expect("first half");
    in_flight.flush().await.expect("flush");

    // A stream of admissions (validations: they hold no address, so the range never fills),
    // each on a connection of its own, until connecting fails.
    let streamed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stream = {
        let (connector, streamed) = (connector.clone(), streamed.clone());
        tokio::spawn(async move {
            let mut answers = Vec::new();
            for i in 0.. {
                let body = review(&format!("s{i}"), &format!("s{i}"), serde_json::json!({"ports": [{"port": 80}]})).to_string();
                match post_raw(&connector, port, "/validate", body.as_bytes()).await {
                    Ok(a) => answers.push(a),
                    Err(_) => return answers,
                }
                streamed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // (A stream at a rate, not a wait: one admission every 10 ms at most.)
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            answers
        })
    };
    let streamed = &streamed;
    eventually("the stream has begun (an answer)", Duration::from_secs(60), move || async move { streamed.load(std::sync::atomic::Ordering::SeqCst) > 0 }).await;
    c.signal(libc::SIGTERM);

    let (metrics_port, log) = (c.metrics_port, &c);
    let text = eventually_ok("/readyz turns 503 after SIGTERM", Duration::from_secs(60), POLL, move || async move {
        match http_get(metrics_port, "/readyz") {
            (503, text) => Ok(text),
            (code, text) => Err(format!("still {code} {text:?}:\n{}", log.log())),
        }
    })
    .await;
    assert_eq!(text, "shutting down");
    assert_eq!(http_get(c.metrics_port, "/healthz"), (200, "ok".to_string()), "liveness during the drain");
    // During the shutdown delay, requests are answered as usual.
    let answer = post_raw(&connector, port, "/mutate", review("delay", "delay", serde_json::json!({"ports": [{"port": 80}]})).to_string().as_bytes()).await;
    assert!(answer.as_deref().is_ok_and(allowed), "a request during the shutdown delay: {answer:?}\n{}", c.log());

    // After the delay the listener closes: connecting fails.
    let closed = within(Duration::from_secs(60), Duration::from_millis(100), move || async move { tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err().then_some(()) }).await;
    assert!(closed.is_some(), "the webhook still accepts connections 60s after SIGTERM:\n{}", c.log());
    // The request in flight all along is answered.
    in_flight.write_all(rest).await.expect("the rest of the body");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(60), in_flight.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(allowed(&answer), "the request in flight got {answer:?}\n{}", c.log());
    assert!(answer.contains("\"uid\":\"in-flight\""), "{answer}");

    let status = tokio::task::block_in_place(|| c.wait_exit(Duration::from_secs(90)));
    let status = status.unwrap_or_else(|| panic!("still running 90s after SIGTERM:\n{}", c.log()));
    assert_eq!(status.code(), Some(0), "exit status {status}:\n{}", c.log());
    // Every answer the stream got is a whole one: a connection accepted just as the
    // listener closed may be closed before its request is read (nothing done, no answer),
    // and connections refused afterwards end the stream; never a partial or failed answer.
    let answers = stream.await.expect("stream task");
    for a in &answers {
        assert!(a.is_empty() || allowed(a), "a streamed request got {a:?}");
    }
    let log = c.log();
    assert!(log.contains("returned the address pool"), "{log}");
    assert!(log.contains("all connections finished"), "{log}");
    // The two mutations ("in-flight", "delay"), never recorded, released before the exit.
    assert!(log.contains("answers settled") && log.contains("released=2"), "{log}");
}

/// The soft RLIMIT_NOFILE of `pid`, set to `soft` when given; the previous value.
fn nofile(pid: u32, soft: Option<u64>) -> u64 {
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    let mut new = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: prlimit(2) reading (and with `soft`, setting) a resource limit of our own child.
    let rc = unsafe { libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    if let Some(soft) = soft {
        new.rlim_cur = soft;
        new.rlim_max = old.rlim_max;
        // SAFETY: as above.
        let rc = unsafe { libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
        assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    }
    old.rlim_cur
}

/// Out of file descriptors, accept() fails at once for as long as connections wait: the
/// webhook logs it and backs off (a handful of failures over seconds, not thousands), and
/// serves again once descriptors are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_failures_back_off_and_serving_resumes() {
    let cp = control_plane();
    let (crt, key) = serving_cert(&cp);
    let (c, _) = start(&cp, &crt, &key, &[]);
    let (pid, port) = (c.pid(), c.webhook_port);
    let failures = |log: &str| log.matches("accept failed").count();

    // Room for a few more descriptors only, then more connections than that: the rest wait
    // in the accept queue and every accept() fails with EMFILE.
    let open = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the controller's descriptors").count() as u64;
    let before = nofile(pid, Some(open + 4));
    let mut held = Vec::new();
    for _ in 0..32 {
        held.push(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect (the kernel queues it)"));
    }
    let controller = &c;
    let logged = within(Duration::from_secs(60), Duration::from_millis(100), move || async move { (failures(&controller.log()) >= 3).then_some(()) }).await;
    assert!(logged.is_some(), "no accept failure logged within 60s:\n{}", c.log());
    let first = Instant::now();
    // Time is the subject: how many failures the back-off logs in these 3 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = c.log();
    assert!(log.contains("Too many open files"), "{log}");
    // Back-off: 10 ms doubling to 1 s is about a dozen in these seconds; a busy loop logs
    // thousands even on a loaded machine.
    let n = failures(&log);
    assert!(n < 60, "{n} accept failures logged in {:?}: a busy loop", first.elapsed());

    // Descriptors back: the waiting connections are taken (and time out), and a caller is
    // answered again.
    nofile(pid, Some(before));
    drop(held);
    let connector = tls_client(&cp);
    let body = review("after-emfile", "after-emfile", serde_json::json!({"ports": [{"port": 80}]})).to_string();
    let (connector, body, controller) = (&connector, &body, &c);
    eventually_ok("an answer after descriptors were freed", Duration::from_secs(60), Duration::from_millis(200), move || async move {
        match post_raw(connector, port, "/mutate", body.as_bytes()).await {
            Ok(a) if allowed(&a) => Ok(()),
            other => Err(format!("{other:?}\n{}", controller.log())),
        }
    })
    .await;
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
    let (c, _) = start(&cp, &crt, &key, &[]);
    assert_eq!(served_fingerprint(&cp, c.webhook_port), file_fingerprint(&first_crt));

    let (second_crt, second_key) = issue_cert(&pki, dir.path(), "second");
    assert_ne!(file_fingerprint(&first_crt), file_fingerprint(&second_crt));
    // Rotate as a Secret volume does: new files renamed into place.
    std::fs::copy(&second_key, dir.path().join("tls.key.new")).expect("copy");
    std::fs::copy(&second_crt, dir.path().join("tls.crt.new")).expect("copy");
    std::fs::rename(dir.path().join("tls.key.new"), &key).expect("rename");
    std::fs::rename(dir.path().join("tls.crt.new"), &crt).expect("rename");
    let want = file_fingerprint(&second_crt);
    wait_ok(&format!("the rotated certificate {want} served"), Duration::from_secs(30), Duration::from_millis(200), || {
        let got = served_fingerprint(&cp, c.webhook_port);
        if got == want {
            Ok(())
        } else {
            Err(format!("still serving {got}"))
        }
    });
}
