//! What a dataplane (nftables, iptables) offers the sync loop.

#![forbid(unsafe_code)]

use crate::model::state::DesiredPort;
use crate::model::NamespacedName;
use crate::netns::ExecError;

/// Errors of a dataplane. A dataplane's own failures (nftables: endpoint slots exhausted, a
/// netlink batch refused) come as [`DataplaneError::Dataplane`]: the sync loop only logs
/// and retries them, so this trait names no implementation's error types (each
/// implementation converts its own, `From` next to them).
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Dataplane(Box<dyn std::error::Error + Send + Sync>),
    #[error("cannot read the programmed rules: {0}")]
    Listing(String),
}

/// The Services to (re)program in one sync.
#[derive(Debug, Default)]
pub struct SyncBatch {
    /// Every known Service is in `services`; anything programmed that is not, goes.
    pub full: bool,
    /// Services changed (or all of them), each with its desired ports (empty: deleted).
    pub services: Vec<(NamespacedName, Vec<DesiredPort>)>,
}

/// What a sync did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SyncReport {
    /// Transactions applied (a huge first sync is split).
    pub transactions: usize,
    /// Of those, transactions written as nfnetlink batches by the agent itself
    /// (nftables mode: chain, plain-rule and element deltas) instead of through `nft -f`.
    pub netlink_transactions: usize,
    /// Operations sent (chains, rules, elements added or removed).
    pub operations: usize,
    /// Chains the agent owns after the sync (all families).
    pub chains: usize,
    /// Rules in those chains.
    pub rules: usize,
    /// Elements of the shared maps and sets.
    pub elements: usize,
    /// Time spent waiting for the kernel tools (`nft`, `iptables-restore`), in seconds.
    pub tool_seconds: f64,
    /// Something is left to tidy that the next sync does (emptied chains to delete): the
    /// loop runs one soon even without changes.
    pub cleanup_pending: bool,
}

/// A dataplane.
pub trait Proxier: Send {
    /// Program the batch. On error the next call must be able to recover (it rebuilds).
    fn sync(&mut self, batch: &SyncBatch) -> Result<SyncReport, DataplaneError>;
    /// Compare the kernel with what was programmed; returns the differences found (and
    /// arranges for the next sync to repair them).
    fn verify(&mut self) -> Result<Vec<String>, DataplaneError>;
    /// Remove everything this dataplane ever created.
    fn cleanup(&mut self) -> Result<(), DataplaneError>;
    /// "nftables" or "iptables".
    fn mode(&self) -> &'static str;
}
