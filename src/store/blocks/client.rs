//! The block store's calls to the kube-apiserver, thin: one method per request, no
//! decisions (those are the book's, `book.rs`). [`BlockApi`] is what the store's shell
//! needs; [`KubeBlockApi`] makes the requests, and the unit tests put an in-memory
//! apiserver in its place (`fake.rs`).

use std::net::IpAddr;

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
}

impl KubeBlockApi {
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        KubeBlockApi { leases: Api::namespaced(client.clone(), namespace), addresses: Api::all(client) }
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

    async fn list_addresses(&self) -> Result<Vec<IpAddr>, CallError> {
        let list = self.addresses.list(&ListParams::default()).await.map_err(CallError::from_kube)?;
        Ok(list.items.iter().filter_map(|o| crate::k8s::ipaddress::address(o.metadata.name.as_deref()?)).collect())
    }

    async fn ping(&self) -> Result<(), CallError> {
        self.leases.list_metadata(&ListParams::default().labels(BLOCK_LABEL).limit(1)).await.map(drop).map_err(CallError::from_kube)
    }
}
