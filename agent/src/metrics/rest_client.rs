//! client-go's `rest_client_requests_total{code,host,method}` and
//! `rest_client_request_duration_seconds{verb,host}` (k8s.io/component-base
//! `metrics/prometheus/restclient`), measured on the agent's own kube client: a tower layer
//! around the client's whole stack counts each request by its answer's status code (or
//! `<error>` when none came) and times it until the response head arrived — for a watch,
//! until the stream opened, as client-go does. kube-proxy serves both and the
//! kubernetes-mixin's proxy dashboard plots them ("Kube API Request Rate", "Get/Post Request
//! Latency 99th Quantile").

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use http::{Request, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub code: String,
    pub host: String,
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabels {
    pub verb: String,
    pub host: String,
}

/// client-go's request latency buckets.
pub const LATENCY_BUCKETS: [f64; 12] = [0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The two families; cloning shares them.
#[derive(Clone, Debug)]
pub struct RestClientMetrics {
    pub requests: Family<RequestLabels, Counter>,
    pub duration: Family<LatencyLabels, Histogram, fn() -> Histogram>,
}

impl Default for RestClientMetrics {
    fn default() -> Self {
        RestClientMetrics { requests: Family::default(), duration: Family::new_with_constructor(latency_histogram) }
    }
}

impl RestClientMetrics {
    /// Register under an unprefixed registry (client-go's names have no subsystem).
    pub fn register(&self, r: &mut Registry) {
        r.register("rest_client_requests", "Number of HTTP requests, partitioned by status code, method, and host.", self.requests.clone());
        r.register("rest_client_request_duration_seconds", "Request latency in seconds. Broken down by verb, and host.", self.duration.clone());
    }

    /// One request to `host` with `method` ended with `code` (a status code, or `<error>`)
    /// after `seconds`.
    pub fn record(&self, host: &str, method: &str, code: &str, seconds: f64) {
        self.requests.get_or_create(&RequestLabels { code: code.into(), host: host.into(), method: method.into() }).inc();
        self.duration.get_or_create(&LatencyLabels { verb: method.into(), host: host.into() }).observe(seconds);
    }

    /// The layer for `kube::client::ClientBuilder::with_layer`; `host` is the API server's
    /// `host:port` (the requests at the outside of the stack carry only a path).
    pub fn layer(&self, host: String) -> RestClientLayer {
        RestClientLayer { metrics: self.clone(), host }
    }
}

/// A tower layer that records every request of the service it wraps.
#[derive(Clone, Debug)]
pub struct RestClientLayer {
    metrics: RestClientMetrics,
    host: String,
}

impl<S> tower::Layer<S> for RestClientLayer {
    type Service = Measured<S>;
    fn layer(&self, inner: S) -> Measured<S> {
        Measured { inner, metrics: self.metrics.clone(), host: self.host.clone() }
    }
}

/// The wrapped service.
#[derive(Clone, Debug)]
pub struct Measured<S> {
    inner: S,
    metrics: RestClientMetrics,
    host: String,
}

impl<S, ReqB, ResB> tower::Service<Request<ReqB>> for Measured<S>
where
    S: tower::Service<Request<ReqB>, Response = Response<ResB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let method = req.method().as_str().to_string();
        let (metrics, host) = (self.metrics.clone(), self.host.clone());
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let result = fut.await;
            let code = match &result {
                Ok(resp) => resp.status().as_u16().to_string(),
                Err(_) => "<error>".to_string(),
            };
            metrics.record(&host, &method, &code, start.elapsed().as_secs_f64());
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, Service, ServiceExt};

    #[tokio::test]
    async fn every_request_is_counted_by_code_and_timed_by_verb() {
        let m = RestClientMetrics::default();
        let backend = tower::service_fn(|req: Request<()>| async move {
            if req.uri().path() == "/fail" {
                return Err("connection refused");
            }
            let status = if req.uri().path() == "/missing" { 404 } else { 200 };
            Ok(Response::builder().status(status).body(()).expect("response"))
        });
        let mut svc = m.layer("10.0.0.1:6443".into()).layer(backend);
        for (method, path) in [("GET", "/ok"), ("GET", "/ok"), ("POST", "/missing"), ("GET", "/fail")] {
            let req = Request::builder().method(method).uri(path).body(()).expect("request");
            let _ = svc.ready().await.expect("ready").call(req).await;
        }
        let mut r = Registry::default();
        m.register(&mut r);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).expect("encode");
        for line in [
            "rest_client_requests_total{code=\"200\",host=\"10.0.0.1:6443\",method=\"GET\"} 2",
            "rest_client_requests_total{code=\"404\",host=\"10.0.0.1:6443\",method=\"POST\"} 1",
            "rest_client_requests_total{code=\"<error>\",host=\"10.0.0.1:6443\",method=\"GET\"} 1",
            "rest_client_request_duration_seconds_count{verb=\"GET\",host=\"10.0.0.1:6443\"} 3",
            "rest_client_request_duration_seconds_bucket{le=\"60.0\",verb=\"POST\",host=\"10.0.0.1:6443\"} 1",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
    }
}
