//! The nftables dataplane (default mode).
//!
//! One table per family, `ip clusterip` and `ip6 clusterip` (as kube-proxy: the map key
//! types differ per family, and each family can be rebuilt on its own). Every sync is one
//! `nft -f -` transaction covering both tables, made of deltas against an in-memory
//! [`mirror`] of what was programmed; the table is only listed on full resyncs, to detect
//! changes made behind the agent's back. A sync larger than `max_ops` operations is split
//! into bounded transactions at Service-port boundaries — except a rebuild of a table that
//! is already there (start, failure, drift), which is always one transaction: see
//! [`adopt`].

pub mod adopt;
#[cfg(any(test, feature = "test-util"))]
pub mod fake;
#[cfg(not(any(test, feature = "test-util")))]
mod fake {
    //! Built without the `test-util` feature (release): no fake kernel. A type without values
    //! keeps the proxier's one code path while no fake can exist.
    use super::adopt::Existing;
    use super::transaction::Transaction;
    use crate::model::IpFamily;

    pub enum FakeKernel {}

    impl FakeKernel {
        pub fn existing(&self, _: IpFamily) -> Existing {
            match *self {}
        }
        pub fn listing(&self, _: IpFamily) -> Option<String> {
            match *self {}
        }
        pub fn apply(&mut self, _: &Transaction) -> Result<(), std::convert::Infallible> {
            match *self {}
        }
    }
}
pub mod mirror;
pub mod netlink;
pub mod ops;
pub mod render;
pub mod slots;
#[cfg(test)]
mod sync_tests;
pub mod transaction;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::model::IpFamily;
use crate::netns::{ExecError, Executor};
use crate::proxier::{DataplaneError, Proxier, SyncBatch, SyncReport};
use crate::locks::lock;
use adopt::Existing;
use fake::FakeKernel;
use mirror::FamilyMirror;
use ops::{Family, TABLE};
use render::RenderOptions;
use transaction::Transaction;

impl From<slots::SlotsExhausted> for DataplaneError {
    fn from(e: slots::SlotsExhausted) -> Self {
        DataplaneError::Dataplane(Box::new(e))
    }
}

impl From<netlink::NetlinkError> for DataplaneError {
    fn from(e: netlink::NetlinkError) -> Self {
        DataplaneError::Dataplane(Box::new(e))
    }
}

/// Default bound on the operations of one transaction.
pub const DEFAULT_MAX_OPS: usize = 50_000;

/// Transactions that [`netlink`] can encode, up to this many bytes, go to the kernel
/// directly; bigger ones (a cold start) go through `nft -f`.
const NETLINK_MAX_BYTES: usize = 2 << 20;

/// The nftables dataplane.
pub struct NftablesProxier {
    exec: Executor,
    opts: RenderOptions,
    max_ops: usize,
    mirrors: [FamilyMirror; 2],
    /// Rebuild at the next sync (start, failure, drift): forget the mirror, adopt the
    /// table in the kernel and refill it, in one transaction.
    rebuild: bool,
    /// The last rebuild failed: the next one deletes and re-creates the tables (still in
    /// one transaction) instead of adopting them — what is there may not be adoptable (a
    /// chain or map of another definition, say). Alternates while rebuilds keep failing.
    replace_next: bool,
    /// Time spent in `nft` (or the netlink batch) during the current sync.
    tool_time: std::time::Duration,
    /// Write transactions that [`netlink`] can encode as nfnetlink batches (unset by
    /// `CLUSTERIP_AGENT_NFT_ONLY=1`: everything through `nft -f`).
    use_netlink: bool,
    /// Netlink socket in the node's namespace, opened on first use, kept open.
    socket: Option<netlink::Socket>,
    /// Transactions of the current sync sent as netlink batches.
    netlink_count: usize,
    /// Unit tests: transactions go to this fake kernel instead (each counted as a netlink
    /// batch when the encoder takes it, as it would be sent).
    fake: Option<Arc<Mutex<FakeKernel>>>,
}

impl NftablesProxier {
    pub fn new(exec: Executor, opts: RenderOptions, max_ops: usize) -> Self {
        NftablesProxier {
            exec,
            opts,
            max_ops: max_ops.max(1),
            mirrors: [FamilyMirror::new(IpFamily::V4), FamilyMirror::new(IpFamily::V6)],
            rebuild: true,
            replace_next: false,
            tool_time: std::time::Duration::ZERO,
            use_netlink: std::env::var("CLUSTERIP_AGENT_NFT_ONLY").map_or(true, |v| v != "1"),
            socket: None,
            netlink_count: 0,
            fake: None,
        }
    }

    /// A dataplane programming `kernel`, a [`FakeKernel`] (unit tests of the sync logic:
    /// no root, no namespace, no `nft`; feature `test-util`).
    #[cfg(any(test, feature = "test-util"))]
    pub fn with_fake(kernel: Arc<Mutex<FakeKernel>>, opts: RenderOptions, max_ops: usize) -> Self {
        NftablesProxier { fake: Some(kernel), ..Self::new(Executor::host(), opts, max_ops) }
    }

    /// Whether encodable transactions are written as netlink batches (default: yes,
    /// unless `CLUSTERIP_AGENT_NFT_ONLY=1`). With `false` everything goes through `nft -f`.
    pub fn with_netlink(mut self, on: bool) -> Self {
        self.use_netlink = on;
        self
    }

    /// Apply one transaction: as an nfnetlink batch of our own when [`netlink`] can encode
    /// all of it, else with `nft -f -`.
    fn apply(&mut self, tx: &Transaction) -> Result<(), DataplaneError> {
        if let Some(kernel) = &self.fake {
            if self.use_netlink && self.netlink_batch(tx).is_some() {
                self.netlink_count += 1;
            }
            return lock(kernel).apply(tx).map_err(|e| DataplaneError::Dataplane(Box::new(e)));
        }
        if let Ok(path) = std::env::var("CLUSTERIP_AGENT_DUMP_NFT") {
            let _ = std::fs::write(path, tx.text());
        }
        if self.use_netlink {
            if let Some(batch) = self.netlink_batch(tx).filter(|_| self.ensure_socket()) {
                let start = std::time::Instant::now();
                let r = self.apply_netlink(&batch);
                self.tool_time += start.elapsed();
                self.netlink_count += 1;
                tracing::debug!(bytes = batch.len(), ops = tx.ops(), netlink_us = start.elapsed().as_micros() as u64, "netlink batch");
                return r;
            }
        }
        let text = tx.text();
        let start = std::time::Instant::now();
        let r = self.exec.run("nft", &["-f", "-"], Some(text.as_bytes())).map(|_| ());
        self.tool_time += start.elapsed();
        tracing::debug!(bytes = text.len(), ops = tx.ops(), nft_ms = start.elapsed().as_millis() as u64, "nft transaction");
        Ok(r?)
    }

    /// The transaction as a netlink batch, if everything in it can be encoded and it is
    /// not huge.
    fn netlink_batch(&self, tx: &Transaction) -> Option<netlink::Batch> {
        let ops = tx.netlink_ops()?;
        match netlink::encode(&ops) {
            Ok(b) if b.len() <= NETLINK_MAX_BYTES => Some(b),
            Ok(_) => None,
            Err(e) => {
                // Routine: rules with matches (affinity, masquerade, firewall) need nft.
                tracing::debug!(reason = %e, "transaction goes through nft");
                None
            }
        }
    }

    /// Open the netlink socket if needed. When it cannot be opened at all, netlink batches
    /// are turned off and everything goes through `nft` (false).
    fn ensure_socket(&mut self) -> bool {
        if self.socket.is_none() {
            match netlink::Socket::open(self.exec.netns_file().as_deref()) {
                Ok(s) => self.socket = Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "no netlink socket: every transaction goes through nft");
                    self.use_netlink = false;
                }
            }
        }
        self.socket.is_some()
    }

    fn apply_netlink(&mut self, batch: &netlink::Batch) -> Result<(), DataplaneError> {
        let r = match &self.socket {
            Some(s) => s.apply(batch),
            None => Ok(()),
        };
        if r.is_err() {
            // Start the next exchange on a fresh socket.
            self.socket = None;
        }
        Ok(r?)
    }

    fn report(&self, transactions: usize, operations: usize) -> SyncReport {
        let mut r = SyncReport {
            transactions,
            operations,
            netlink_transactions: self.netlink_count,
            tool_seconds: self.tool_time.as_secs_f64(),
            cleanup_pending: self.mirrors.iter().any(FamilyMirror::has_stale_chains),
            ..Default::default()
        };
        for m in &self.mirrors {
            let (chains, rules, elements) = m.counts();
            r.chains += chains;
            r.rules += rules;
            r.elements += elements;
        }
        r
    }

    /// Start a rebuild in `tx`: forget the mirrors, then adopt each family's table as the
    /// kernel has it (or, after a failed rebuild, replace it). Returns what was adopted per
    /// family, and whether the rebuild must be one transaction (something is programmed
    /// that traffic relies on).
    fn start_rebuild(&mut self, tx: &mut Transaction) -> Result<([Option<Existing>; 2], bool), DataplaneError> {
        let mut adopted = [None, None];
        let mut atomic = false;
        for (i, m) in self.mirrors.iter_mut().enumerate() {
            m.reset();
            if self.replace_next {
                tx.rebuild_family(m.family);
                atomic = true;
                continue;
            }
            let existing = match &self.fake {
                Some(kernel) => lock(kernel).existing(m.family),
                None => Existing::read(&self.exec, m.family)?,
            };
            tracing::info!(family = ?m.family, chains = existing.chains.len(), maps = existing.maps.len(), sets = existing.sets.len(), "adopting the table in the kernel");
            atomic |= !existing.is_empty();
            tx.adopt_family(m.family, &existing);
            m.adopt_shard_maps(&existing);
            adopted[i] = Some(existing);
        }
        Ok((adopted, atomic))
    }

    fn sync_inner(&mut self, batch: &SyncBatch) -> Result<SyncReport, DataplaneError> {
        self.tool_time = std::time::Duration::ZERO;
        self.netlink_count = 0;
        let rebuild = self.rebuild;
        let mut tx = Transaction::new();
        let (adopted, atomic) = if rebuild {
            self.start_rebuild(&mut tx)?
        } else {
            for m in &mut self.mirrors {
                m.take_stale_chains(&mut tx);
            }
            ([None, None], false)
        };
        let full = batch.full || rebuild;
        let (mut transactions, mut operations) = (0, 0);
        let mut seen: HashMap<IpFamily, Vec<&crate::model::NamespacedName>> = HashMap::new();
        for (nsn, ports) in &batch.services {
            for m in &mut self.mirrors {
                m.sync_service(nsn, ports, &self.opts, &mut tx)?;
                seen.entry(m.family).or_default().push(nsn);
            }
            // A rebuild of a table traffic relies on is never split: between two parts,
            // the Services of the later parts would have no rules.
            if tx.ops() >= self.max_ops && !atomic {
                self.apply(&tx)?;
                transactions += 1;
                operations += tx.ops();
                tx = Transaction::new();
            }
        }
        if full {
            for m in &mut self.mirrors {
                let keep: std::collections::HashSet<_> = seen.get(&m.family).into_iter().flatten().copied().collect();
                for nsn in m.services_not_in(&keep) {
                    m.sync_service(&nsn, &[], &self.opts, &mut tx)?;
                }
            }
        }
        for (m, existing) in self.mirrors.iter_mut().zip(&adopted) {
            if let Some(existing) = existing {
                m.finish_adoption(existing, &mut tx);
            }
        }
        if !tx.is_empty() {
            self.apply(&tx)?;
            transactions += 1;
            operations += tx.ops();
        }
        if self.use_netlink && self.fake.is_none() {
            // Open it now, outside the next partial sync's time (it may be the first batch).
            self.ensure_socket();
        }
        Ok(self.report(transactions, operations))
    }
}

impl Proxier for NftablesProxier {
    fn sync(&mut self, batch: &SyncBatch) -> Result<SyncReport, DataplaneError> {
        match self.sync_inner(batch) {
            Ok(r) => {
                self.rebuild = false;
                self.replace_next = false;
                Ok(r)
            }
            Err(e) => {
                if self.rebuild {
                    self.replace_next = !self.replace_next;
                }
                // The mirror may be ahead of the kernel now: start over next time.
                self.rebuild = true;
                Err(e)
            }
        }
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        if self.rebuild {
            return Ok(vec![]);
        }
        let mut diffs = Vec::new();
        for m in &self.mirrors {
            let fam = Family(m.family).nft();
            let listing = match &self.fake {
                Some(kernel) => lock(kernel).listing(m.family).ok_or_else(|| ExecError::Failed {
                    program: "nft".into(),
                    status: "exit status: 1".into(),
                    stderr: "Error: No such file or directory".into(),
                }),
                None => self.exec.run("nft", &["-j", "list", "table", fam, TABLE], None),
            };
            match listing {
                Ok(json) => diffs.extend(m.compare_listing(&json).map_err(DataplaneError::Listing)?),
                Err(ExecError::Failed { stderr, .. }) => diffs.push(format!("table {fam} {TABLE} cannot be listed: {}", stderr.trim())),
                Err(e) => return Err(e.into()),
            }
        }
        if !diffs.is_empty() {
            self.rebuild = true;
        }
        Ok(diffs)
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        let mut tx = Transaction::new();
        for fam in IpFamily::ALL {
            tx.delete_family(fam);
        }
        match &self.fake {
            Some(kernel) => lock(kernel).apply(&tx).map_err(|e| DataplaneError::Dataplane(Box::new(e)))?,
            None => {
                self.exec.run("nft", &["-f", "-"], Some(tx.text().as_bytes()))?;
            }
        }
        for m in &mut self.mirrors {
            m.reset();
        }
        self.rebuild = true;
        Ok(())
    }

    fn mode(&self) -> &'static str {
        "nftables"
    }
}
