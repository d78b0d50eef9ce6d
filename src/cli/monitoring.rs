//! The controller's plain-HTTP endpoints, each on a listener of its own so that one cannot
//! starve the other: `/metrics` on --metrics-bind-address (also `/healthz` and `/readyz`,
//! for people and older manifests), and the kubelet's probes `/healthz`, `/livez`,
//! `/readyz` on --health-probe-bind-address. Metrics know nothing of HTTP
//! ([`crate::metrics`] only encodes); this is where the two meet.
//!
//! Anyone who can reach a port can call it, so what a call costs is bounded: each server
//! has [`crate::serve`]'s per-source and total connection limits with short timeouts
//! ([`plain_limits`]), and the answers that read the store (`/readyz`, and the gauges
//! `/metrics` refreshes) are computed at most once per [`FRESH_FOR`] however many clients
//! ask — concurrent callers wait for the one check in progress and share its answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use tokio::net::TcpListener;

use crate::metrics::{MeteredStore, Metrics};
use crate::serve::{self, Limits, Refusal, Server};

/// How long an answer from the store serves further `/readyz` and `/metrics` callers.
pub const FRESH_FOR: Duration = Duration::from_secs(1);

/// Limits of the plain-HTTP servers: probes and scrapers open few connections (the kubelet
/// one per probe, without keep-alive), so a source holding more than a few is not one of
/// them; anything idle for a few seconds is closed.
pub fn plain_limits() -> Limits {
    Limits {
        read_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        max_connections: 128,
        max_unauthenticated_per_source: 8,
        ..Limits::default()
    }
}

/// What `/readyz` and `/metrics` read, with the last answers kept for [`FRESH_FOR`].
pub struct Health {
    store: Arc<MeteredStore>,
    metrics: Arc<Metrics>,
    /// Set once the controller shuts down: `/readyz` answers 503 from then on.
    draining: Arc<AtomicBool>,
    ready: tokio::sync::Mutex<Option<(Instant, Result<(), String>)>>,
    gauges: tokio::sync::Mutex<Option<Instant>>,
}

impl Health {
    pub fn new(store: Arc<MeteredStore>, metrics: Arc<Metrics>, draining: Arc<AtomicBool>) -> Arc<Self> {
        Arc::new(Self { store, metrics, draining, ready: Default::default(), gauges: Default::default() })
    }

    /// `/readyz`: the store answers ([`AllocationStore::ready`]: etcd or the kube-apiserver
    /// answers, every record readable), and the controller is not shutting down.
    ///
    /// [`AllocationStore::ready`]: crate::store::AllocationStore::ready
    async fn ready(&self) -> Result<(), String> {
        if self.draining.load(Ordering::SeqCst) {
            return Err("shutting down".into());
        }
        let mut last = self.ready.lock().await;
        if let Some((at, answer)) = last.as_ref() {
            if at.elapsed() < FRESH_FOR {
                return answer.clone();
            }
        }
        let answer = crate::store::AllocationStore::ready(self.store.as_ref()).await.map_err(|e| format!("allocation store not ready: {e}"));
        *last = Some((Instant::now(), answer.clone()));
        answer
    }

    /// `/metrics`: the allocated/available and unreadable-record gauges refreshed from the
    /// store (at most once per [`FRESH_FOR`]), then every metric encoded.
    async fn metrics(&self) -> String {
        {
            let mut last = self.gauges.lock().await;
            if last.is_none_or(|at| at.elapsed() >= FRESH_FOR) {
                let _ = self.store.refresh_gauges().await;
                *last = Some(Instant::now());
            }
        }
        self.metrics.encode()
    }
}

/// Which endpoints a server answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoints {
    Metrics,
    Probes,
}

/// What [`Metrics::encode`] writes (it ends in `# EOF`): Prometheus 3 fails a scrape whose
/// Content-Type it does not know.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

async fn answer(health: &Health, which: Endpoints, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let content_type = if which == Endpoints::Metrics && path == "/metrics" { OPENMETRICS } else { TEXT };
    let (status, body) = match (which, path) {
        (Endpoints::Metrics, "/metrics") => (StatusCode::OK, health.metrics().await),
        (_, "/healthz" | "/livez") => (StatusCode::OK, "ok".to_string()),
        (_, "/readyz") => match health.ready().await {
            Ok(()) => (StatusCode::OK, "ok".to_string()),
            Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
        },
        (Endpoints::Metrics, _) => (StatusCode::NOT_FOUND, "not found; try /metrics, /healthz or /readyz".to_string()),
        (Endpoints::Probes, _) => (StatusCode::NOT_FOUND, "not found; try /healthz, /livez or /readyz (metrics are on --metrics-bind-address)".to_string()),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    resp
}

async fn serve_plain(listener: TcpListener, name: &'static str, which: Endpoints, health: Arc<Health>) {
    let metrics = health.metrics.clone();
    let handler = move |req: Request<Incoming>| {
        let health = health.clone();
        async move { answer(&health, which, req).await }
    };
    let on_refusal: serve::OnRefusal = Arc::new(move |r: Refusal| metrics.http_refused_connection(name, r.label()));
    let server = Server { name, tls: None, limits: plain_limits(), handler, on_refusal: Some(on_refusal) };
    // Serves for as long as the process runs (through the shutdown drain: /readyz must answer).
    let (_never, stop) = tokio::sync::watch::channel(false);
    serve::serve(listener, server, stop, Duration::ZERO).await;
}

/// Serve `/metrics` (and `/healthz`, `/readyz`) until the task is dropped.
pub async fn serve_metrics(listener: TcpListener, health: Arc<Health>) {
    serve_plain(listener, "metrics", Endpoints::Metrics, health).await;
}

/// Serve the probes `/healthz`, `/livez`, `/readyz` until the task is dropped.
pub async fn serve_probes(listener: TcpListener, health: Arc<Health>) {
    serve_plain(listener, "health", Endpoints::Probes, health).await;
}
