//! The webhook's HTTPS server: `POST /mutate`, `POST /validate`, `GET /healthz`,
//! `GET /readyz`. Bodies are read up to [`MAX_BODY`]; anything that is not an
//! AdmissionReview of a Service gets a 400 naming what was wrong, never a crash.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use k8s_openapi::api::core::v1::Service;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use tokio::net::TcpListener;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use super::admission::Admission;
use crate::metrics::Metrics;

/// Largest AdmissionReview accepted (the kube-apiserver's own request limit is 3 MiB).
pub const MAX_BODY: usize = 3 * 1024 * 1024;

fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.into())));
    *r.status_mut() = status;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

fn json(body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    r
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Mutate,
    Validate,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Mutate => "mutate",
            Kind::Validate => "validate",
        }
    }
}

/// Parse an AdmissionReview of a Service, or say what is wrong with it.
pub fn parse_review(body: &[u8]) -> Result<AdmissionRequest<Service>, String> {
    if body.is_empty() {
        return Err("empty body: expected an AdmissionReview (admission.k8s.io/v1) JSON object".into());
    }
    let review: AdmissionReview<Service> =
        serde_json::from_slice(body).map_err(|e| format!("body is not an AdmissionReview of a Service: {e}"))?;
    review.try_into().map_err(|_| "AdmissionReview has no request".to_string())
}

async fn handle(admission: Arc<Admission>, metrics: Arc<Metrics>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let kind = match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") | (&Method::GET, "/readyz") | (&Method::GET, "/livez") => return Ok(text(StatusCode::OK, "ok")),
        (&Method::POST, "/mutate") => Kind::Mutate,
        (&Method::POST, "/validate") => Kind::Validate,
        (_, "/mutate") | (_, "/validate") => return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "use POST with an AdmissionReview body\n")),
        _ => return Ok(text(StatusCode::NOT_FOUND, "not found; the webhook serves POST /mutate and POST /validate\n")),
    };
    let started = Instant::now();
    // A declared length over the limit is refused before any of the body is read (a client
    // waiting on `Expect: 100-continue` gets the 400 instead of sending megabytes).
    let declared = req.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        metrics.webhook_bad_request(kind.label());
        return Ok(text(StatusCode::BAD_REQUEST, format!("request body larger than {MAX_BODY} bytes\n")));
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            let msg = if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                format!("request body larger than {MAX_BODY} bytes")
            } else {
                format!("could not read the request body: {e}")
            };
            metrics.webhook_bad_request(kind.label());
            return Ok(text(StatusCode::BAD_REQUEST, msg + "\n"));
        }
    };
    let received = Instant::now();
    let request = match parse_review(&body) {
        Ok(r) => r,
        Err(msg) => {
            debug!(error = %msg, "rejected a malformed admission request");
            metrics.webhook_bad_request(kind.label());
            return Ok(text(StatusCode::BAD_REQUEST, msg + "\n"));
        }
    };
    let response = match kind {
        Kind::Mutate => admission.mutate(&request).await,
        Kind::Validate => admission.validate(&request).await,
    };
    let allowed = response.allowed;
    let answer = match serde_json::to_vec(&response.into_review()) {
        Ok(b) => json(b),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("could not encode the AdmissionReview: {e}\n")),
    };
    metrics.webhook_latency(kind.label(), allowed, received.elapsed(), started.elapsed());
    Ok(answer)
}

/// Serve on a runtime of its own, one thread, so admission answers never queue behind the
/// reconcilers' work on the shared runtime. The receiver resolves when serving stops.
pub fn serve_on_own_thread(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
) -> std::io::Result<tokio::sync::oneshot::Receiver<String>> {
    let listener = listener.into_std()?;
    let (done, stopped) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name("webhook".into()).spawn(move || {
        let why = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(l) => {
                        serve(l, tls, admission, metrics).await;
                        "the accept loop ended".to_string()
                    }
                    Err(e) => format!("could not register the listener: {e}"),
                }
            }),
            Err(e) => format!("could not start the webhook runtime: {e}"),
        };
        let _ = done.send(why);
    })?;
    Ok(stopped)
}

/// Serve HTTPS on `addr` until the task is dropped.
pub async fn serve(listener: TcpListener, tls: Arc<ServerConfig>, admission: Arc<Admission>, metrics: Arc<Metrics>) {
    let acceptor = TlsAcceptor::from(tls);
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "admission webhook serving HTTPS");
    }
    loop {
        let (tcp, peer): (_, SocketAddr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "accept failed");
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let admission = admission.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let stream = match acceptor.accept(tcp).await {
                Ok(s) => s,
                Err(e) => {
                    debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let svc = service_fn(move |req| handle(admission.clone(), metrics.clone(), req));
            if let Err(e) = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), svc).await {
                debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}
