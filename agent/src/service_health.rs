//! Per-Service health-check node ports (kube-proxy's `service_health.go`): for each
//! Service with `externalTrafficPolicy: Local` and a `healthCheckNodePort`, an HTTP server
//! on that port answers 200 when this node has local ready endpoints (and the proxy is
//! healthy), 503 otherwise, so that load balancers send traffic only to nodes that can
//! serve it. The listeners are opened in the node's network namespace (`--netns`).
//! A port that cannot be opened is retried at every sync and reported as a Warning Event
//! `FailedToStartServiceHealthcheck` on the Service (kube-proxy's reason and wording), once
//! per failing port.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::healthz::ProxyHealth;
use crate::http::{serve_listener, Handler, Response};
use crate::model::NamespacedName;

/// The one question the servers ask of the proxy (kube-proxy's `proxyHealthChecker`):
/// whether it is healthy (programs its changes in time).
pub trait ProxyHealthChecker: Send + Sync {
    fn healthy(&self) -> bool;
}

impl ProxyHealthChecker for ProxyHealth {
    fn healthy(&self) -> bool {
        self.is_healthy()
    }
}

struct Server {
    port: u16,
    local: Arc<AtomicUsize>,
    /// Dropped with the server: its listener closes, its connections end after the request
    /// in flight.
    _stop: watch::Sender<bool>,
}

/// The running health-check servers (their tasks end when this is dropped).
pub struct ServiceHealthServers {
    netns: Option<Arc<File>>,
    handle: tokio::runtime::Handle,
    proxy: Arc<dyn ProxyHealthChecker>,
    servers: HashMap<NamespacedName, Server>,
    tasks: JoinSet<()>,
    /// Where failures are reported as Events (None: logs only).
    recorder: Option<Recorder>,
    /// Services whose port could not be opened (the port), reported once until it changes
    /// or opens.
    failed: HashMap<NamespacedName, u16>,
}

/// kube-proxy's Event reason for a health-check port that cannot be opened.
pub const FAILED_TO_START: &str = "FailedToStartServiceHealthcheck";

fn bind(netns: Option<&Arc<File>>, port: u16) -> std::io::Result<std::net::TcpListener> {
    let open = move || {
        let l = std::net::TcpListener::bind(("0.0.0.0", port))?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    match netns {
        None => open(),
        Some(f) => crate::netns::on_thread_in(f, open)?,
    }
}

impl ServiceHealthServers {
    /// Servers in `netns` (None: the agent's own), run on `handle`, reporting `proxy`'s health.
    pub fn new(netns: Option<Arc<File>>, handle: tokio::runtime::Handle, proxy: Arc<dyn ProxyHealthChecker>) -> Self {
        ServiceHealthServers { netns, handle, proxy, servers: HashMap::new(), tasks: JoinSet::new(), recorder: None, failed: HashMap::new() }
    }

    /// Report failures as Events on the Services, as component `clusterip-agent` on `node`.
    pub fn with_events(mut self, client: kube::Client, node: &str) -> Self {
        self.recorder = Some(Recorder::new(client, Reporter { controller: "clusterip-agent".into(), instance: Some(node.to_string()) }));
        self
    }

    /// Log the failure; the first time for this port, also write the Event (in the
    /// background: the sync loop does not wait for the API server).
    fn failed_to_start(&mut self, nsn: &NamespacedName, port: u16, error: &std::io::Error) {
        tracing::warn!(service = %nsn, port, error = %error, "{FAILED_TO_START}");
        if self.failed.insert(nsn.clone(), port) == Some(port) {
            return;
        }
        let Some(recorder) = self.recorder.clone() else { return };
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(nsn.namespace.clone()),
            name: Some(nsn.name.clone()),
            ..Default::default()
        };
        let ev = Event {
            type_: EventType::Warning,
            reason: FAILED_TO_START.into(),
            // kube-proxy: "Failed to start healthcheck \"%v\" on port %d: %v"
            note: Some(format!("Failed to start healthcheck \"{nsn}\" on port {port}: {error}")),
            action: "Listen".into(),
            secondary: None,
        };
        let nsn = nsn.clone();
        self.handle.spawn(async move {
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::warn!(service = %nsn, error = %e, "could not write the {FAILED_TO_START} Event");
            }
        });
    }

    /// Bring the servers to `wanted` (Service → (port, local ready endpoints)).
    pub fn sync(&mut self, wanted: &HashMap<NamespacedName, (u16, usize)>) {
        // Reap the servers stopped earlier.
        while self.tasks.try_join_next().is_some() {}
        self.failed.retain(|nsn, port| wanted.get(nsn).is_some_and(|(p, _)| p == port));
        self.servers.retain(|nsn, s| wanted.get(nsn).is_some_and(|(p, _)| *p == s.port));
        for (nsn, (port, local)) in wanted {
            if let Some(s) = self.servers.get(nsn) {
                s.local.store(*local, Ordering::Relaxed);
                continue;
            }
            let listener = match bind(self.netns.as_ref(), *port) {
                Ok(l) => l,
                Err(e) => {
                    self.failed_to_start(nsn, *port, &e);
                    continue;
                }
            };
            let listener = {
                let _guard = self.handle.enter();
                tokio::net::TcpListener::from_std(listener)
            };
            let listener = match listener {
                Ok(l) => l,
                Err(e) => {
                    self.failed_to_start(nsn, *port, &e);
                    continue;
                }
            };
            self.failed.remove(nsn);
            let _guard = self.handle.enter();
            let count = Arc::new(AtomicUsize::new(*local));
            let (c, proxy, name) = (count.clone(), self.proxy.clone(), nsn.clone());
            let handler: Handler = Arc::new(move |_path| {
                let n = c.load(Ordering::Relaxed);
                let healthy = proxy.healthy();
                let body = serde_json::json!({
                    "service": {"namespace": name.namespace, "name": name.name},
                    "localEndpoints": n,
                    "serviceProxyHealthy": healthy,
                });
                let mut r = Response::new(if n > 0 && healthy { 200 } else { 503 }, "application/json", body.to_string());
                r.headers.push(("X-Load-Balancing-Endpoint-Weight", n.to_string()));
                r
            });
            let (stop, stopped) = watch::channel(false);
            self.tasks.spawn_on(serve_listener("service-health", listener, handler, stopped), &self.handle);
            tracing::info!(service = %nsn, port, "service health check listening");
            self.servers.insert(nsn.clone(), Server { port: *port, local: count, _stop: stop });
        }
    }
}
