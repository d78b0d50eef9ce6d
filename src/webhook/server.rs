//! The webhook's HTTPS server: `POST /mutate`, `POST /validate` (Services),
//! `POST /validate-servicecidr`, `GET /healthz`,
//! `GET /readyz`. Only clients with a valid client certificate get this far (the TLS
//! handshake checks it, see [`super::tls`]); the connection limits and timeouts are
//! [`crate::serve`]'s. Bodies are read up to [`MAX_BODY`] within the read timeout; anything
//! that is not an AdmissionReview of a Service gets a 400 naming what was wrong, a body that
//! does not arrive in time a 408, never a crash. While the controller shuts down, `/readyz`
//! answers 503 and requests are still answered.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Service;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;
use tracing::debug;

use super::admission::Admission;
use crate::metrics::Metrics;
use crate::serve::{self, Limits, Server};

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
    ValidateServiceCidr,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Mutate => "mutate",
            Kind::Validate => "validate",
            Kind::ValidateServiceCidr => "validate_servicecidr",
        }
    }
}

/// Parse an AdmissionReview of a Service, or say what is wrong with it.
pub fn parse_review(body: &[u8]) -> Result<AdmissionRequest<Service>, String> {
    parse_review_of(body, "a Service")
}

/// Parse an AdmissionReview of a `K` (`what` names it in errors).
pub fn parse_review_of<K>(body: &[u8], what: &str) -> Result<AdmissionRequest<K>, String>
where
    K: kube::Resource + serde::de::DeserializeOwned,
{
    if body.is_empty() {
        return Err("empty body: expected an AdmissionReview (admission.k8s.io/v1) JSON object".into());
    }
    let mut review: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("body is not an AdmissionReview of {what}: {e}"))?;
    // Admission reads the spec and metadata, never the status; and a status the apiserver
    // stores can fail the typed read: a condition set with a zero `lastTransitionTime` comes
    // as `null`, which k8s-openapi's Condition requires to be a timestamp (found by
    // Kubernetes' e2e "should complete a service status lifecycle": every later update of
    // such a Service was refused with a 400).
    if let Some(request) = review.get_mut("request").and_then(|r| r.as_object_mut()) {
        for which in ["object", "oldObject"] {
            if let Some(object) = request.get_mut(which).and_then(|o| o.as_object_mut()) {
                object.remove("status");
            }
        }
    }
    let review: AdmissionReview<K> = serde_json::from_value(review).map_err(|e| format!("body is not an AdmissionReview of {what}: {e}"))?;
    // The answer echoes the request's apiVersion and kind, so anything but the one version
    // our webhook configurations ask for (`admissionReviewVersions: ["v1"]`) is refused here
    // rather than answered in a form the kube-apiserver cannot read (found by fuzzing).
    if review.types.api_version != "admission.k8s.io/v1" || review.types.kind != "AdmissionReview" {
        return Err(format!(
            "body is an {:?} of apiVersion {:?}; expected an AdmissionReview of admission.k8s.io/v1",
            review.types.kind, review.types.api_version
        ));
    }
    review.try_into().map_err(|_| "AdmissionReview has no request".to_string())
}

/// What one request needs: the admission logic, metrics, the body deadline and whether the
/// controller is shutting down.
#[derive(Clone)]
pub struct Webhook {
    pub admission: Arc<Admission>,
    pub metrics: Arc<Metrics>,
    /// Time allowed to receive a request's body (the read timeout).
    pub body_timeout: Duration,
    /// Set once the controller is shutting down: `/readyz` answers 503.
    pub draining: Arc<AtomicBool>,
    /// For the ServiceCIDR overlap check (None: no Nodes are read).
    pub nodes: Option<kube::Api<k8s_openapi::api::core::v1::Node>>,
}

impl Webhook {
    async fn handle(self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let kind = match (req.method(), req.uri().path()) {
            (&Method::GET, "/readyz") if self.draining.load(Ordering::SeqCst) => return text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n"),
            (&Method::GET, "/healthz") | (&Method::GET, "/readyz") | (&Method::GET, "/livez") => return text(StatusCode::OK, "ok"),
            (&Method::POST, "/mutate") => Kind::Mutate,
            (&Method::POST, "/validate") => Kind::Validate,
            (&Method::POST, "/validate-servicecidr") => Kind::ValidateServiceCidr,
            (_, "/mutate") | (_, "/validate") | (_, "/validate-servicecidr") => return text(StatusCode::METHOD_NOT_ALLOWED, "use POST with an AdmissionReview body\n"),
            _ => return text(StatusCode::NOT_FOUND, "not found; the webhook serves POST /mutate, POST /validate and POST /validate-servicecidr\n"),
        };
        let (admission, metrics) = (&self.admission, &self.metrics);
        let started = Instant::now();
        // A declared length over the limit is refused before any of the body is read (a client
        // waiting on `Expect: 100-continue` gets the 400 instead of sending megabytes).
        let declared = req.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX_BODY as u64) {
            metrics.webhook_bad_request(kind.label());
            return text(StatusCode::BAD_REQUEST, format!("request body larger than {MAX_BODY} bytes\n"));
        }
        let body = match tokio::time::timeout(self.body_timeout, Limited::new(req.into_body(), MAX_BODY).collect()).await {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(e)) => {
                let msg = if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                    format!("request body larger than {MAX_BODY} bytes")
                } else {
                    format!("could not read the request body: {e}")
                };
                metrics.webhook_bad_request(kind.label());
                return text(StatusCode::BAD_REQUEST, msg + "\n");
            }
            Err(_) => {
                metrics.webhook_bad_request(kind.label());
                return text(StatusCode::REQUEST_TIMEOUT, format!("request body not received within {:?}\n", self.body_timeout));
            }
        };
        let received = Instant::now();
        let bad = |msg: String| {
            debug!(error = %msg, "rejected a malformed admission request");
            metrics.webhook_bad_request(kind.label());
            text(StatusCode::BAD_REQUEST, msg + "\n")
        };
        let response = match kind {
            Kind::Mutate => match parse_review(&body) {
                Ok(request) => admission.mutate(&request).await,
                Err(msg) => return bad(msg),
            },
            Kind::Validate => match parse_review(&body) {
                Ok(request) => admission.validate(&request).await,
                Err(msg) => return bad(msg),
            },
            Kind::ValidateServiceCidr => match parse_review_of::<k8s_openapi::api::networking::v1::ServiceCIDR>(&body, "a ServiceCIDR") {
                Ok(request) => super::servicecidr::validate(self.nodes.as_ref(), &request).await,
                Err(msg) => return bad(msg),
            },
        };
        let allowed = response.allowed;
        let answer = match serde_json::to_vec(&response.into_review()) {
            Ok(b) => json(b),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("could not encode the AdmissionReview: {e}\n")),
        };
        metrics.webhook_latency(kind.label(), allowed, received.elapsed(), started.elapsed());
        answer
    }
}

/// Serve on a runtime of its own, one thread, so admission answers never queue behind the
/// reconcilers' work on the shared runtime, until `stop` turns true and the connections
/// have drained (at most `drain_timeout`). The receiver resolves when serving has ended,
/// with what ended it.
pub fn serve_on_own_thread(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    webhook: Webhook,
    limits: Limits,
    stop: watch::Receiver<bool>,
    drain_timeout: Duration,
) -> std::io::Result<tokio::sync::oneshot::Receiver<String>> {
    let listener = listener.into_std()?;
    let (done, stopped) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name("webhook".into()).spawn(move || {
        let why = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(l) => {
                        serve(l, tls, webhook, limits, stop, drain_timeout).await;
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

/// Serve HTTPS on `listener` until `stop` turns true, then drain (see [`crate::serve`]).
pub async fn serve(listener: TcpListener, tls: Arc<ServerConfig>, webhook: Webhook, limits: Limits, stop: watch::Receiver<bool>, drain_timeout: Duration) {
    let metrics = webhook.metrics.clone();
    let server = Server {
        name: "webhook",
        tls: Some(TlsAcceptor::from(tls)),
        limits,
        handler: move |req| webhook.clone().handle(req),
        on_refusal: Some(Arc::new(move |r: serve::Refusal| metrics.webhook_refused_connection(r.label()))),
    };
    serve::serve(listener, server, stop, drain_timeout).await;
}

#[cfg(test)]
mod tests {
    use super::parse_review;

    fn review(api_version: &str, kind: &str) -> String {
        serde_json::json!({
            "apiVersion": api_version, "kind": kind,
            "request": {
                "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Service"},
                "resource": {"group": "", "version": "v1", "resource": "services"},
                "name": "web", "namespace": "default", "operation": "CREATE", "userInfo": {},
                "object": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {}}, "dryRun": false
            }
        })
        .to_string()
    }

    #[test]
    fn a_status_the_typed_service_cannot_read_does_not_fail_the_review() {
        // As the kube-apiserver sends an UPDATE of a Service whose status condition was set
        // with a zero lastTransitionTime (Kubernetes' e2e service status lifecycle test).
        let mut review: serde_json::Value = serde_json::from_str(&review("admission.k8s.io/v1", "AdmissionReview")).expect("json");
        let status = serde_json::json!({"conditions": [{"type": "StatusUpdate", "status": "True", "reason": "E2E", "message": "Set from e2e test", "lastTransitionTime": null}], "loadBalancer": {}});
        review["request"]["operation"] = "UPDATE".into();
        review["request"]["object"]["status"] = status.clone();
        review["request"]["oldObject"] = review["request"]["object"].clone();
        let parsed = parse_review(review.to_string().as_bytes()).expect("parsed");
        assert!(parsed.object.is_some() && parsed.old_object.is_some());
        assert_eq!(parsed.object.and_then(|s| s.metadata.name).as_deref(), Some("web"));
    }

    #[test]
    fn only_v1_admission_reviews_are_answered() {
        // Found by fuzzing (tests/fuzz/corpus/admission/crash-review-of-another-apiversion):
        // the answer echoed a malformed apiVersion.
        assert!(parse_review(review("admission.k8s.io/v1", "AdmissionReview").as_bytes()).is_ok());
        for (v, k) in [("admission.k8s.io'v1", "AdmissionReview"), ("admission.k8s.io/v1beta1", "AdmissionReview"), ("admission.k8s.io/v1", "Review")] {
            let err = parse_review(review(v, k).as_bytes()).expect_err(v);
            assert!(err.contains("expected an AdmissionReview of admission.k8s.io/v1"), "{err}");
        }
    }
}
