//! The block store's calls to the kube-apiserver, thin: one method per request, no
//! decisions (those are the book's, `book.rs`). [`BlockApi`] is what the store's shell
//! needs; [`KubeBlockApi`] makes the requests, and the unit tests put an in-memory
//! apiserver in its place (`fake.rs`).

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};

use super::layout::{BLOCK_LABEL, WANTED_ANNOTATION};
use crate::store::StoreError;

/// How a call to the kube-apiserver failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The apiserver refused it with this status (below 500): it was not applied.
    #[error("{message} ({code})")]
    Refused { code: u16, message: String },
    /// No answer, or one that does not say whether the call was applied: a transport
    /// error, a timeout, a 5xx. A write may or may not have happened.
    #[error("{0}")]
    Unknown(String),
}

impl CallError {
    pub fn from_kube(e: kube::Error) -> CallError {
        match e {
            kube::Error::Api(s) if s.code < 500 => CallError::Refused { code: s.code, message: s.message },
            other => CallError::Unknown(other.to_string()),
        }
    }

    /// The status code of a refusal.
    pub fn code(&self) -> Option<u16> {
        match self {
            CallError::Refused { code, .. } => Some(*code),
            CallError::Unknown(_) => None,
        }
    }

    /// As the store reports it, `what` saying which call: a refusal other than 429 is the
    /// backend's answer, anything else unavailability.
    pub fn store(self, what: &str) -> StoreError {
        match self {
            CallError::Refused { code, message } if code != 429 => StoreError::Backend(format!("{what}: {message} ({code})").into()),
            other => StoreError::Unavailable(format!("{what}: {other}").into()),
        }
    }
}

/// The calls the block store makes.
#[async_trait]
pub trait BlockApi: Send + Sync {
    /// Every block Lease of the namespace (a consistent list).
    async fn list_leases(&self) -> Result<Vec<Lease>, CallError>;
    async fn get_lease(&self, name: &str) -> Result<Option<Lease>, CallError>;
    async fn create_lease(&self, lease: &Lease) -> Result<Lease, CallError>;
    /// An update carrying `lease`'s resourceVersion as precondition.
    async fn replace_lease(&self, name: &str, lease: &Lease) -> Result<Lease, CallError>;
    /// A delete of `lease` only as it is: its uid and resourceVersion as preconditions.
    async fn delete_lease(&self, name: &str, lease: &Lease) -> Result<(), CallError>;
    /// Ask the holder of Lease `name` for a block: `clusterip.allocator/wanted-by: holder`.
    async fn ask_for_block(&self, name: &str, holder: &str) -> Result<(), CallError>;
    /// The addresses the apiserver records as IPAddress objects (a consistent list).
    async fn list_addresses(&self) -> Result<Vec<IpAddr>, CallError>;
    /// One small read (readiness).
    async fn ping(&self) -> Result<(), CallError>;
}

/// [`BlockApi`] on a kube client: block Leases in one namespace, IPAddresses cluster-wide.
#[derive(Clone)]
pub struct KubeBlockApi {
    pub leases: Api<Lease>,
    addresses: Api<IPAddress>,
    /// IPAddresses per page of [`Self::list_addresses`]: [`ADDRESS_PAGE`].
    address_page: u32,
}

impl KubeBlockApi {
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        KubeBlockApi { leases: Api::namespaced(client.clone(), namespace), addresses: Api::all(client), address_page: ADDRESS_PAGE }
    }

    /// The same with another page size of the IPAddress list (tests: many pages from few
    /// objects).
    pub fn with_address_page(mut self, page: u32) -> Self {
        self.address_page = page.max(1);
        self
    }
}

/// IPAddresses per page of [`KubeBlockApi::list_addresses`] (client-go's pager's default).
const ADDRESS_PAGE: u32 = 500;

/// Every call of `inner` bounded by `timeout` (the kube client has no read timeout: one
/// half-open connection would otherwise hold a renewal for as long as TCP takes to give up,
/// ~15 minutes). A call that times out has an unknown outcome.
pub struct Bounded {
    inner: Arc<dyn BlockApi>,
    timeout: Duration,
}

impl Bounded {
    pub fn new(inner: Arc<dyn BlockApi>, timeout: Duration) -> Self {
        Bounded { inner, timeout }
    }

    async fn run<T>(&self, call: impl Future<Output = Result<T, CallError>>) -> Result<T, CallError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(CallError::Unknown(format!("the kube-apiserver did not answer within {:?}", self.timeout))),
        }
    }
}

#[async_trait]
impl BlockApi for Bounded {
    async fn list_leases(&self) -> Result<Vec<Lease>, CallError> {
        self.run(self.inner.list_leases()).await
    }

    async fn get_lease(&self, name: &str) -> Result<Option<Lease>, CallError> {
        self.run(self.inner.get_lease(name)).await
    }

    async fn create_lease(&self, lease: &Lease) -> Result<Lease, CallError> {
        self.run(self.inner.create_lease(lease)).await
    }

    async fn replace_lease(&self, name: &str, lease: &Lease) -> Result<Lease, CallError> {
        self.run(self.inner.replace_lease(name, lease)).await
    }

    async fn delete_lease(&self, name: &str, lease: &Lease) -> Result<(), CallError> {
        self.run(self.inner.delete_lease(name, lease)).await
    }

    async fn ask_for_block(&self, name: &str, holder: &str) -> Result<(), CallError> {
        self.run(self.inner.ask_for_block(name, holder)).await
    }

    async fn list_addresses(&self) -> Result<Vec<IpAddr>, CallError> {
        self.run(self.inner.list_addresses()).await
    }

    async fn ping(&self) -> Result<(), CallError> {
        self.run(self.inner.ping()).await
    }
}

fn unchanged(lease: &Lease) -> DeleteParams {
    DeleteParams { preconditions: Some(Preconditions { uid: lease.metadata.uid.clone(), resource_version: lease.metadata.resource_version.clone() }), ..Default::default() }
}

#[async_trait]
impl BlockApi for KubeBlockApi {
    async fn list_leases(&self) -> Result<Vec<Lease>, CallError> {
        Ok(self.leases.list(&ListParams::default().labels(BLOCK_LABEL)).await.map_err(CallError::from_kube)?.items)
    }

    async fn get_lease(&self, name: &str) -> Result<Option<Lease>, CallError> {
        self.leases.get_opt(name).await.map_err(CallError::from_kube)
    }

    async fn create_lease(&self, lease: &Lease) -> Result<Lease, CallError> {
        self.leases.create(&PostParams::default(), lease).await.map_err(CallError::from_kube)
    }

    async fn replace_lease(&self, name: &str, lease: &Lease) -> Result<Lease, CallError> {
        self.leases.replace(name, &PostParams::default(), lease).await.map_err(CallError::from_kube)
    }

    async fn delete_lease(&self, name: &str, lease: &Lease) -> Result<(), CallError> {
        self.leases.delete(name, &unchanged(lease)).await.map(drop).map_err(CallError::from_kube)
    }

    async fn ask_for_block(&self, name: &str, holder: &str) -> Result<(), CallError> {
        let patch = serde_json::json!({"metadata": {"annotations": {WANTED_ANNOTATION: holder}}});
        self.leases.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(drop).map_err(CallError::from_kube)
    }

    /// Metadata only (the name is the address), in pages of [`ADDRESS_PAGE`]: one
    /// consistent snapshot (the first page without a resourceVersion, the rest by its
    /// continue token), never every object whole in one answer.
    async fn list_addresses(&self) -> Result<Vec<IpAddr>, CallError> {
        let mut out = Vec::new();
        let mut params = ListParams::default().limit(self.address_page);
        loop {
            let page = self.addresses.list_metadata(&params).await.map_err(CallError::from_kube)?;
            out.extend(page.items.iter().filter_map(|o| crate::k8s::ipaddress::address(o.metadata.name.as_deref()?)));
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => return Ok(out),
            }
        }
    }

    async fn ping(&self) -> Result<(), CallError> {
        self.leases.list_metadata(&ListParams::default().labels(BLOCK_LABEL).limit(1)).await.map(drop).map_err(CallError::from_kube)
    }
}
