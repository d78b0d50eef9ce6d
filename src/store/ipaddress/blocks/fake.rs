//! An in-memory kube-apiserver for the block store's unit tests: the block Leases of one
//! namespace with resourceVersion and uid preconditions as the apiserver applies them, a
//! set of recorded IPAddresses, and faults injected per call: a call that never answers (a
//! half-open connection), or one applied whose answer is lost.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;
use std::sync::Mutex;

use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::Lease;

use super::client::{BlockApi, CallError};
use super::layout::WANTED_ANNOTATION;
use crate::sync::lock;

/// A call of [`BlockApi`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Call {
    ListLeases,
    GetLease,
    CreateLease,
    ReplaceLease,
    DeleteLease,
    AskForBlock,
    ListAddresses,
}

#[derive(Default)]
struct State {
    leases: BTreeMap<String, Lease>,
    revision: u64,
    uids: u64,
    addresses: BTreeSet<IpAddr>,
    hang: HashSet<Call>,
    lose_answer: HashSet<Call>,
    calls: Vec<Call>,
}

/// (Each fault test uses some of the knobs.)
#[allow(dead_code)]
#[derive(Default)]
pub struct FakeApi {
    state: Mutex<State>,
}

fn refused(code: u16, message: &str) -> CallError {
    CallError::Refused { code, message: message.to_string() }
}

#[allow(dead_code)]
impl FakeApi {
    /// Calls of this kind never answer from now on.
    pub fn hang(&self, call: Call) {
        lock(&self.state).hang.insert(call);
    }

    /// Calls of this kind are applied, but their answer is lost (a transport error).
    pub fn lose_answer(&self, call: Call) {
        lock(&self.state).lose_answer.insert(call);
    }

    /// Every call answers again.
    pub fn heal(&self) {
        let mut st = lock(&self.state);
        st.hang.clear();
        st.lose_answer.clear();
    }

    pub fn lease(&self, name: &str) -> Option<Lease> {
        lock(&self.state).leases.get(name).cloned()
    }

    pub fn lease_names(&self) -> Vec<String> {
        lock(&self.state).leases.keys().cloned().collect()
    }

    /// Write `lease` as another client would (a new resourceVersion; a uid if new).
    pub fn put(&self, mut lease: Lease) -> Lease {
        let mut st = lock(&self.state);
        st.revision += 1;
        lease.metadata.resource_version = Some(st.revision.to_string());
        if lease.metadata.uid.is_none() {
            st.uids += 1;
            lease.metadata.uid = Some(format!("uid-{}", st.uids));
        }
        let name = lease.metadata.name.clone().unwrap_or_default();
        st.leases.insert(name, lease.clone());
        lease
    }

    /// Delete a Lease as someone else would (by hand, a namespace clean-up).
    pub fn remove(&self, name: &str) -> Option<Lease> {
        lock(&self.state).leases.remove(name)
    }

    pub fn record_address(&self, ip: IpAddr) {
        lock(&self.state).addresses.insert(ip);
    }

    pub fn calls(&self) -> Vec<Call> {
        lock(&self.state).calls.clone()
    }

    /// Apply `call` through `apply`, with the faults set for it.
    async fn call<T>(&self, call: Call, apply: impl FnOnce(&mut State) -> Result<T, CallError>) -> Result<T, CallError> {
        let (hang, lose) = {
            let mut st = lock(&self.state);
            st.calls.push(call);
            (st.hang.contains(&call), st.lose_answer.contains(&call))
        };
        if hang {
            std::future::pending::<()>().await;
        }
        let out = apply(&mut lock(&self.state));
        if lose {
            return Err(CallError::Unknown("connection reset by peer".into()));
        }
        out
    }
}

fn bump(st: &mut State, lease: &mut Lease) {
    st.revision += 1;
    lease.metadata.resource_version = Some(st.revision.to_string());
}

#[async_trait]
impl BlockApi for FakeApi {
    async fn list_leases(&self) -> Result<Vec<Lease>, CallError> {
        self.call(Call::ListLeases, |st| Ok(st.leases.values().cloned().collect())).await
    }

    async fn get_lease(&self, name: &str) -> Result<Option<Lease>, CallError> {
        self.call(Call::GetLease, |st| Ok(st.leases.get(name).cloned())).await
    }

    async fn create_lease(&self, lease: &Lease) -> Result<Lease, CallError> {
        self.call(Call::CreateLease, |st| {
            let name = lease.metadata.name.clone().unwrap_or_default();
            if st.leases.contains_key(&name) {
                return Err(refused(409, "already exists"));
            }
            let mut lease = lease.clone();
            st.uids += 1;
            lease.metadata.uid = Some(format!("uid-{}", st.uids));
            bump(st, &mut lease);
            st.leases.insert(name, lease.clone());
            Ok(lease)
        })
        .await
    }

    async fn replace_lease(&self, name: &str, lease: &Lease) -> Result<Lease, CallError> {
        self.call(Call::ReplaceLease, |st| {
            let Some(cur) = st.leases.get(name) else { return Err(refused(404, "not found")) };
            if cur.metadata.resource_version != lease.metadata.resource_version {
                return Err(refused(409, "the object has been modified"));
            }
            let mut lease = lease.clone();
            lease.metadata.uid = cur.metadata.uid.clone();
            bump(st, &mut lease);
            st.leases.insert(name.to_string(), lease.clone());
            Ok(lease)
        })
        .await
    }

    async fn delete_lease(&self, name: &str, lease: &Lease) -> Result<(), CallError> {
        self.call(Call::DeleteLease, |st| {
            let Some(cur) = st.leases.get(name) else { return Err(refused(404, "not found")) };
            let uid_ok = lease.metadata.uid.is_none() || cur.metadata.uid == lease.metadata.uid;
            let rv_ok = lease.metadata.resource_version.is_none() || cur.metadata.resource_version == lease.metadata.resource_version;
            if !uid_ok || !rv_ok {
                return Err(refused(409, "precondition failed"));
            }
            st.leases.remove(name);
            Ok(())
        })
        .await
    }

    async fn ask_for_block(&self, name: &str, holder: &str) -> Result<(), CallError> {
        self.call(Call::AskForBlock, |st| {
            let Some(mut cur) = st.leases.get(name).cloned() else { return Err(refused(404, "not found")) };
            cur.metadata.annotations.get_or_insert_with(Default::default).insert(WANTED_ANNOTATION.to_string(), holder.to_string());
            bump(st, &mut cur);
            st.leases.insert(name.to_string(), cur);
            Ok(())
        })
        .await
    }

    async fn list_addresses(&self) -> Result<Vec<IpAddr>, CallError> {
        self.call(Call::ListAddresses, |st| Ok(st.addresses.iter().copied().collect())).await
    }

    async fn ping(&self) -> Result<(), CallError> {
        self.call(Call::ListLeases, |_| Ok(())).await
    }
}
