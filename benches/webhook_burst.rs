//! N Service creates through the kube-apiserver, all at once or by `BURST_WORKERS` workers
//! (upstream's `test/integration/servicecidr/perf_test.go` creates 15,000 by 100); prints
//! the total time, the create latencies (p50, p99, mean) and, when given the controller's
//! metrics URL, the webhook's own answer latency (p50, p99) from its histogram. Used by
//! scripts/bench-webhook.sh.
//!
//!   [BURST_WORKERS=N] cargo bench --bench webhook_burst -- KUBECONFIG NAMESPACE COUNT [METRICS_URL]

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Service, ServicePort, ServiceSpec};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Quantile of a Prometheus histogram (cumulative buckets), linear within a bucket.
fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let Some(&(_, total)) = buckets.last() else { return f64::NAN };
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if !le.is_finite() {
                return prev.0;
            }
            let width = le - prev.0;
            let inside = (count - prev.1).max(1e-9);
            return prev.0 + width * ((rank - prev.1) / inside);
        }
        prev = (le, count);
    }
    f64::NAN
}

async fn webhook_buckets(url: &str, metric: &str, operation: &str) -> Vec<(f64, f64)> {
    let text = match reqwest_lite(url).await {
        Some(t) => t,
        None => return Vec::new(),
    };
    let mut sums: std::collections::BTreeMap<u64, (f64, f64)> = Default::default();
    for line in text.lines() {
        if !line.starts_with(&format!("clusterip_webhook_{metric}_duration_seconds_bucket{{")) || !line.contains(&format!("operation=\"{operation}\"")) {
            continue;
        }
        let le = line.split("le=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or("");
        let le: f64 = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
        let count: f64 = line.rsplit(' ').next().and_then(|c| c.parse().ok()).unwrap_or(0.0);
        let e = sums.entry(le.to_bits()).or_insert((le, 0.0));
        e.1 += count;
    }
    let mut v: Vec<(f64, f64)> = sums.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// A plain HTTP GET of `http://host:port/path` (the test support's, without another
/// dependency).
async fn reqwest_lite(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    clusterip_test_support::http_get(host, &path).await.map(|(_, body)| body)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let [kubeconfig, namespace, count, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: webhook_burst KUBECONFIG NAMESPACE COUNT [METRICS_URL]");
    };
    let count: usize = count.parse()?;
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    cfg.read_timeout = Some(Duration::from_secs(60));
    let client = kube::Client::try_from(cfg)?;
    let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": namespace}}))?;
    let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await;
    let api: Api<Service> = Api::namespaced(client.clone(), namespace);
    // All at once by default; else this many creates in flight at a time.
    let workers = match std::env::var("BURST_WORKERS") {
        Ok(w) => w.parse::<usize>().map_err(|e| anyhow::anyhow!("BURST_WORKERS={w:?}: {e}"))?.max(1),
        Err(_) => count.max(1),
    };
    let started = Instant::now();
    use futures::StreamExt;
    let results: Vec<(Duration, Option<String>)> = futures::stream::iter((0..count).map(|i| {
        let api = api.clone();
        async move {
            let svc = Service {
                metadata: ObjectMeta { name: Some(format!("burst-{i}")), ..Default::default() },
                spec: Some(ServiceSpec { ports: Some(vec![ServicePort { port: 80, ..Default::default() }]), ..Default::default() }),
                ..Default::default()
            };
            let t = Instant::now();
            let r = api.create(&PostParams::default(), &svc).await;
            (t.elapsed(), r.err().map(|e| e.to_string()))
        }
    }))
    .buffer_unordered(workers)
    .collect()
    .await;
    let wall = started.elapsed();
    let failed = results.iter().filter(|r| r.1.is_some()).count();
    // Why creates failed: each distinct message once (at most 5), on stderr.
    let mut why: Vec<&str> = results.iter().filter_map(|r| r.1.as_deref()).collect();
    why.sort();
    why.dedup();
    for w in why.iter().take(5) {
        eprintln!("webhook_burst: a create failed: {w}");
    }
    let mut lat: Vec<Duration> = results.iter().map(|r| r.0).collect();
    lat.sort();
    let mean = lat.iter().sum::<Duration>() / lat.len().max(1) as u32;
    println!(
        "creates={count} workers={workers} failed={failed} wall_s={:.3} create_p50_ms={:.3} create_p99_ms={:.3} create_mean_ms={:.3}",
        wall.as_secs_f64(),
        quantile(&lat, 0.5).as_secs_f64() * 1e3,
        quantile(&lat, 0.99).as_secs_f64() * 1e3,
        mean.as_secs_f64() * 1e3
    );
    if let Some(url) = rest.first() {
        // `admission`: body in hand to answer; `request`: headers to answer (receiving the
        // body from the kube-apiserver included).
        for (metric, label) in [("admission", ""), ("request", "_request")] {
            for op in ["mutate", "validate"] {
                let b = webhook_buckets(url, metric, op).await;
                println!(
                    "webhook_{op}{label}_p50_ms={:.3} webhook_{op}{label}_p99_ms={:.3} webhook_{op}{label}_count={}",
                    histogram_quantile(&b, 0.5) * 1e3,
                    histogram_quantile(&b, 0.99) * 1e3,
                    b.last().map(|x| x.1).unwrap_or(0.0)
                );
            }
        }
    }
    // Delete them and wait until they are gone: the kube-apiserver releases each address
    // as it deletes the Service, and its IPAddress allocator counts every address of the
    // range at each release (O(n)), so a delete of thousands left running would load the
    // next burst measured on the same apiserver (upstream's perf test: 15,000 by 100
    // workers, one burst alone and one with the webhook, run back to back).
    // (One delete-collection request ends at the apiserver's request timeout, 60 s, with
    // part of the Services deleted — 4,000 of 15,000 here — so it is sent again until none is
    // left.)
    let cleanup = Instant::now();
    let mut left = None;
    while cleanup.elapsed() < Duration::from_secs(1800) && left != Some(0) {
        let _ = api.delete_collection(&DeleteParams::default(), &ListParams::default()).await;
        left = api.list(&ListParams::default().limit(1)).await.map(|l| l.items.len()).ok().or(left);
    }
    println!("cleanup_s={:.1} left={}", cleanup.elapsed().as_secs_f64(), left.map_or("unknown".to_string(), |n| n.to_string()));
    if failed > 0 {
        anyhow::bail!("{failed} of {count} creates failed");
    }
    Ok(())
}
