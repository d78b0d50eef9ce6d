//! The addresses the cluster already records as IPAddress objects — the kube-apiserver's
//! own allocations included — kept by a watch. Admission never hands out one of them: a
//! stock kube-apiserver would refuse the Service ("provided IP is already allocated").
//!
//! The set is a *view*: it lags the apiserver by the watch's delay, so it serves as a hint
//! (which candidates to skip, when to look again) and never as the deciding read. Where a
//! decision must not be made on a stale picture, callers read the IPAddress itself from the
//! apiserver (`ApiserverIps::recorded_now`; `blocks.rs` lists them before answering from a
//! block; docs/backends.md, "Decisions on a possibly stale view").

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use tokio::sync::watch;
use tracing::warn;

use crate::cidr;

use super::StoreError;
use crate::sync::{read, write};

/// A watch-fed set of IPAddress names.
#[derive(Clone)]
pub struct ApiserverIps {
    set: Arc<RwLock<HashSet<IpAddr>>>,
    /// Counts additions (a new record, or a relist); a receiver never misses one, however
    /// busy its task was when it happened.
    added: Arc<watch::Sender<u64>>,
    /// For reads from storage; None for a fixed view.
    api: Option<Api<IPAddress>>,
}

impl Default for ApiserverIps {
    fn default() -> Self {
        Self { set: Arc::default(), added: Arc::new(watch::Sender::new(0)), api: None }
    }
}

impl ApiserverIps {
    /// Start the watch; `synced` turns true after the first full list.
    pub fn start(client: kube::Client) -> (Self, watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
        let me = Self { api: Some(Api::all(client.clone())), ..Self::default() };
        let (tx, rx) = watch::channel(false);
        let (set, added) = (me.set.clone(), me.added.clone());
        let task = tokio::spawn(async move {
            let api: Api<IPAddress> = Api::all(client);
            let mut stream = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
            let mut relist: Option<HashSet<IpAddr>> = None;
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(Event::Init) => relist = Some(HashSet::new()),
                    Ok(Event::InitApply(o)) => {
                        if let (Some(l), Some(ip)) = (relist.as_mut(), address(&o)) {
                            l.insert(ip);
                        }
                    }
                    Ok(Event::InitDone) => {
                        *write(&set) = relist.take().unwrap_or_default();
                        tx.send_replace(true);
                        added.send_modify(|n| *n += 1);
                    }
                    Ok(Event::Apply(o)) => {
                        if let Some(ip) = address(&o) {
                            write(&set).insert(ip);
                            added.send_modify(|n| *n += 1);
                        }
                    }
                    Ok(Event::Delete(o)) => {
                        if let Some(ip) = address(&o) {
                            write(&set).remove(&ip);
                        }
                    }
                    Err(e) => warn!(error = %e, "IPAddress watch failed; retrying"),
                }
            }
        });
        (me, rx, task)
    }

    /// A view that no watch updates: the given addresses, as of whenever they were read.
    /// For tools that judge against one picture, and for tests that hold a replica's view
    /// back to reproduce a lagging watch.
    pub fn fixed(addresses: impl IntoIterator<Item = IpAddr>) -> Self {
        Self { set: Arc::new(RwLock::new(addresses.into_iter().collect())), ..Self::default() }
    }

    /// Whether the apiserver records `ip` right now, read from storage: a GET without a
    /// resourceVersion, never served from a cache. The deciding read where the view could be
    /// stale (see the module docs). A fixed view answers from its set.
    pub async fn recorded_now(&self, ip: IpAddr) -> Result<bool, StoreError> {
        let Some(api) = &self.api else { return Ok(self.contains(ip)) };
        match api.get_opt(&ip.to_string()).await {
            Ok(found) => Ok(found.is_some()),
            Err(kube::Error::Api(s)) if s.code < 500 && s.code != 429 => Err(StoreError::Backend(format!("reading IPAddress {ip}: {} ({})", s.message, s.code))),
            Err(e) => Err(StoreError::Unavailable(format!("reading IPAddress {ip}: {e}"))),
        }
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        read(&self.set).contains(&ip)
    }

    /// Every recorded address, for seeding a backend.
    pub fn snapshot(&self) -> Vec<IpAddr> {
        read(&self.set).iter().copied().collect()
    }

    /// A receiver that sees every addition to the view from now on (`changed()` resolves
    /// once per batch of additions since it last looked; none is lost while its task is
    /// busy elsewhere).
    pub fn additions(&self) -> watch::Receiver<u64> {
        self.added.subscribe()
    }
}

fn address(o: &IPAddress) -> Option<IpAddr> {
    cidr::parse_ip(o.metadata.name.as_deref()?).ok()
}
