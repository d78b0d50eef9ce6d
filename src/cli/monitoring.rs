//! The controller's plain-HTTP endpoint: `/metrics`, `/healthz`, `/readyz`. Metrics know
//! nothing of HTTP ([`crate::metrics`] only encodes); this is where the two meet.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::metrics::{MeteredStore, Metrics};

/// Serve `/metrics`, `/healthz`, `/readyz` over plain HTTP (HTTP/1.1) until the task is
/// dropped, with the same limits on clients as the webhook ([`crate::serve`]). The
/// allocated/available and unreadable-record gauges are refreshed from the store on each
/// scrape. `/readyz` asks the store itself ([`AllocationStore::ready`]: etcd or the
/// kube-apiserver answers, every record readable), and answers 503 with the reason when it
/// cannot, or once `draining` is set (the controller is shutting down).
///
/// [`AllocationStore::ready`]: crate::store::AllocationStore::ready
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    store: Arc<MeteredStore>,
    draining: Arc<AtomicBool>,
) {
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Response, StatusCode};

    let handler = move |req: hyper::Request<hyper::body::Incoming>| {
        let (metrics, store, draining) = (metrics.clone(), store.clone(), draining.clone());
        async move {
            let (status, body) = match req.uri().path() {
                "/metrics" => {
                    let _ = store.refresh_gauges().await;
                    (StatusCode::OK, metrics.encode())
                }
                "/healthz" | "/livez" => (StatusCode::OK, "ok".to_string()),
                "/readyz" if draining.load(std::sync::atomic::Ordering::SeqCst) => (StatusCode::SERVICE_UNAVAILABLE, "shutting down".to_string()),
                "/readyz" => match crate::store::AllocationStore::ready(store.as_ref()).await {
                    Ok(_) => (StatusCode::OK, "ok".to_string()),
                    Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("allocation store not ready: {e}")),
                },
                _ => (StatusCode::NOT_FOUND, "not found; try /metrics, /healthz or /readyz".to_string()),
            };
            let mut resp = Response::new(Full::new(Bytes::from(body)));
            *resp.status_mut() = status;
            resp
        }
    };
    // Probes and scrapers: a few connections at a time.
    let limits = crate::serve::Limits { max_connections: 64, ..Default::default() };
    let server = crate::serve::Server { name: "metrics", tls: None, limits, handler, on_refusal: None };
    // Serves for as long as the process runs (through the shutdown drain: /readyz must answer).
    let (_never, stop) = tokio::sync::watch::channel(false);
    crate::serve::serve(listener, server, stop, std::time::Duration::ZERO).await;
}
