//! Flags that choose and configure the allocation backend, shared by every subcommand that
//! reads or writes allocation records, and the one factory that turns them into a backend
//! ([`BackendArgs::build`]: the store for a role, its seeding, what repair reads).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;

use std::time::Duration;

use tracing::{info, warn};

use crate::cidr::ServiceCidr;
use crate::metrics::{MeteredStore, Metrics};
use crate::repair::Target;
use crate::store::etcd::{EtcdArgs, EtcdStore};
use crate::store::ipaddress::apiserver_ips::ApiserverIps;
use crate::store::ipaddress::blocks::{BlockOptions, BlockStore};
use crate::store::ipaddress::{IpAddressConfig, IpAddressStore, DEFAULT_MANAGER};
use crate::store::AllocationStore;
pub use crate::store::BackendKind;

#[derive(Clone, Debug, clap::Args)]
pub struct BackendArgs {
    /// Backend that records allocations.
    #[arg(long, value_enum, default_value_t = BackendKind::Ipaddress, env = "CLUSTERIP_BACKEND")]
    pub backend: BackendKind,

    /// Service CIDR to allocate from; repeat for several ranges (at most one default family:
    /// the family of the first range is the default for Services).
    #[arg(long = "service-cidr", value_name = "CIDR", value_delimiter = ',')]
    pub service_cidrs: Vec<String>,

    /// (ipaddress backend) Also allocate from the cluster's ServiceCIDR objects that are
    /// Ready and not being deleted, as the kube-apiserver's own allocator does (ranges added
    /// with `kubectl apply -f servicecidr.yaml` are followed while running). The
    /// `--service-cidr` ranges come first and always give addresses; an address requested in
    /// any followed range is accepted; new ones come from the next range once one is full.
    #[arg(long)]
    pub use_servicecidrs: bool,

    /// (ipaddress backend) Value of the ipaddress.kubernetes.io/managed-by label on the
    /// IPAddress objects we create.
    #[arg(long, default_value = DEFAULT_MANAGER)]
    pub manager: String,

    /// kubeconfig for the ipaddress backend (default: KUBECONFIG, then in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    #[command(flatten)]
    pub etcd: EtcdArgs,
}

impl BackendArgs {
    /// The configured ranges, parsed strictly.
    pub fn ranges(&self) -> anyhow::Result<Vec<ServiceCidr>> {
        let ranges = self
            .service_cidrs
            .iter()
            .map(|s| ServiceCidr::parse(s).map_err(|e| anyhow::anyhow!("--service-cidr {s}: {e}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                if a.overlaps(b) {
                    anyhow::bail!("--service-cidr {a} and {b} overlap; give ranges that do not share addresses");
                }
            }
        }
        Ok(ranges)
    }

    /// Build the chosen backend for `role`: its store, seeded as the role needs, and what the
    /// repair pass reads. The one place a backend name becomes a store (see
    /// [`crate::store::ipaddress`] for which IPAddress store runs where); a flag the chosen
    /// store does not honour is refused.
    pub async fn build(&self, role: Role<'_>) -> anyhow::Result<Backend> {
        self.refuse_unhonoured(&role)?;
        let ranges = self.ranges()?;
        let (store, records_apart): (Arc<dyn AllocationStore>, _) = match (self.backend, &role) {
            (BackendKind::Etcd, _) => {
                let pool = match &role {
                    Role::Controller(c) => c.etcd_address_pool.unwrap_or(DEFAULT_ETCD_ADDRESS_POOL),
                    Role::Command { etcd_address_pool } => *etcd_address_pool,
                };
                let store = self.open_etcd(ranges, pool).await?;
                // The maps do not count the cluster's IPAddress objects by themselves: a
                // replica records the ones in our ranges it lacks, and reports unreadable ones.
                let apart = match &role {
                    Role::Controller(c) => {
                        seed(store.as_ref(), c.recorded).await;
                        Some(c.recorded.clone())
                    }
                    Role::Command { .. } => None,
                };
                (store, apart)
            }
            (BackendKind::Ipaddress, Role::Controller(c)) => {
                if ranges.is_empty() {
                    anyhow::bail!("the controller needs --service-cidr: the ranges it assigns Service addresses from");
                }
                let options = BlockOptions::new(c.address_block_size, c.address_block_lease_duration, c.address_block_margin).map_err(anyhow::Error::msg)?;
                // (The blocks count every IPAddress object as allocated and report unreadable ones.)
                let store = BlockStore::open(c.client.clone(), c.namespace, ranges, c.recorded.clone(), c.identity, options).await?;
                if self.use_servicecidrs {
                    store.follow_servicecidrs(kube::Api::all(c.client.clone()), SERVICECIDR_LIST_WITHIN).await?;
                }
                (store as Arc<dyn AllocationStore>, None)
            }
            (BackendKind::Ipaddress, Role::Command { .. }) => {
                if ranges.is_empty() && !self.use_servicecidrs {
                    anyhow::bail!("the ipaddress backend needs --service-cidr, --use-servicecidrs, or both");
                }
                let client = kube_client(self.kubeconfig.as_deref()).await?;
                let cfg = IpAddressConfig { ranges, use_servicecidrs: self.use_servicecidrs, manager: self.manager.clone(), ..Default::default() };
                (Arc::new(IpAddressStore::open(client, cfg).await?) as Arc<dyn AllocationStore>, None)
            }
        };
        let repair = self.repair_target_of(Some(&store))?;
        Ok(Backend { kind: self.backend, store, records_apart, repair })
    }

    /// What `clusterip repair` judges: the etcd backend's maps (its store opened without a
    /// pool), or the IPAddress objects themselves (no store opened).
    pub async fn repair_target(&self) -> anyhow::Result<Target> {
        self.refuse_unhonoured(&Role::Command { etcd_address_pool: 0 })?;
        match self.backend {
            BackendKind::Etcd => Ok(Target::Etcd(self.open_etcd(self.ranges()?, 0).await?)),
            BackendKind::Ipaddress => self.repair_target_of(None),
        }
    }

    fn repair_target_of(&self, etcd_store: Option<&Arc<dyn AllocationStore>>) -> anyhow::Result<Target> {
        match (self.backend, etcd_store) {
            (BackendKind::Etcd, Some(store)) => Ok(Target::Etcd(store.clone())),
            (BackendKind::Etcd, None) => anyhow::bail!("the etcd backend's repair target needs its store"),
            (BackendKind::Ipaddress, _) => {
                let ranges = self.ranges()?;
                if ranges.is_empty() && !self.use_servicecidrs {
                    anyhow::bail!("the ipaddress backend needs --service-cidr, --use-servicecidrs, or both");
                }
                Ok(Target::IpAddress { manager: self.manager.clone(), ranges, use_servicecidrs: self.use_servicecidrs })
            }
        }
    }

    async fn open_etcd(&self, ranges: Vec<ServiceCidr>, pool_size: usize) -> anyhow::Result<Arc<dyn AllocationStore>> {
        if ranges.is_empty() {
            anyhow::bail!("the etcd backend needs at least one --service-cidr");
        }
        let mut cfg: crate::store::etcd::EtcdConfig = self.etcd.clone().into();
        cfg.pool_size = pool_size;
        Ok(Arc::new(EtcdStore::open(&cfg, ranges).await?))
    }

    /// A flag the store chosen for `role` would not honour, refused rather than ignored.
    fn refuse_unhonoured(&self, role: &Role<'_>) -> anyhow::Result<()> {
        let controller = match role {
            Role::Controller(c) => Some((c.etcd_address_pool, c.address_block_size)),
            Role::Command { etcd_address_pool: 0 } => None,
            Role::Command { etcd_address_pool } => Some((Some(*etcd_address_pool), None)).filter(|_| self.backend == BackendKind::Ipaddress),
        };
        refuse_unhonoured(self.backend, self.use_servicecidrs, controller)
    }
}

/// How long a starting controller waits for the first list of ServiceCIDR objects.
const SERVICECIDR_LIST_WITHIN: Duration = Duration::from_secs(30);

/// The rules of [`BackendArgs::refuse_unhonoured`], on the flags alone: `pool_and_blocks`
/// holds `--etcd-address-pool` and `--address-block-size` where they were given.
fn refuse_unhonoured(backend: BackendKind, use_servicecidrs: bool, pool_and_blocks: Option<(Option<usize>, Option<u64>)>) -> anyhow::Result<()> {
    if use_servicecidrs && backend == BackendKind::Etcd {
        anyhow::bail!("--use-servicecidrs needs --backend ipaddress: the etcd backend allocates from --service-cidr only");
    }
    let Some((etcd_address_pool, address_block_size)) = pool_and_blocks else { return Ok(()) };
    match backend {
        BackendKind::Etcd if address_block_size.is_some() => {
            anyhow::bail!("--address-block-size needs --backend ipaddress: the etcd backend answers from an address pool (--etcd-address-pool)")
        }
        BackendKind::Ipaddress if etcd_address_pool.is_some() => {
            anyhow::bail!("--etcd-address-pool needs --backend etcd: the ipaddress backend keeps no address pool")
        }
        _ => Ok(()),
    }
}

/// The etcd address pool per range a controller keeps unless `--etcd-address-pool` says.
pub const DEFAULT_ETCD_ADDRESS_POOL: usize = 1024;

/// Who runs the backend: that decides the store a backend name opens.
pub enum Role<'a> {
    /// A controller replica (`clusterip controller`): the etcd backend with an address pool,
    /// seeded from the cluster's IPAddress objects; the ipaddress backend's address blocks.
    Controller(ReplicaBackend<'a>),
    /// A one-shot command (`allocate`, `release`): the etcd backend with an address pool of
    /// this size (0: none); the ipaddress backend's object writer.
    Command { etcd_address_pool: usize },
}

/// What a controller replica's backend needs beside [`BackendArgs`].
pub struct ReplicaBackend<'a> {
    pub client: &'a kube::Client,
    /// The cluster's IPAddress objects (already synced).
    pub recorded: &'a ApiserverIps,
    /// The replica's identity (in its block Leases).
    pub identity: &'a str,
    /// Where the block Leases live.
    pub namespace: &'a str,
    /// `--etcd-address-pool` as given (None: [`DEFAULT_ETCD_ADDRESS_POOL`]).
    pub etcd_address_pool: Option<usize>,
    pub address_block_size: Option<u64>,
    pub address_block_lease_duration: Duration,
    pub address_block_margin: Duration,
}

/// A backend as a command runs it.
pub struct Backend {
    pub kind: BackendKind,
    pub store: Arc<dyn AllocationStore>,
    /// The IPAddress view the store's records do not already count (the etcd backend's maps
    /// in a controller): its unreadable objects are reported beside the store's.
    pub records_apart: Option<ApiserverIps>,
    /// What the repair pass judges.
    pub repair: Target,
}

impl Backend {
    /// The store behind the metrics decorator, which also reports what the store does not
    /// count itself ([`Self::records_apart`]).
    pub fn metered(&self, metrics: Arc<Metrics>) -> Arc<MeteredStore> {
        let store = MeteredStore::new(self.store.clone(), metrics);
        Arc::new(match &self.records_apart {
            Some(recorded) => store.with_recorded(recorded.clone()),
            None => store,
        })
    }
}

/// Record what the cluster already uses in our ranges and the maps lack, in one
/// group-committed batch, not a transaction per address.
async fn seed(store: &dyn AllocationStore, recorded: &ApiserverIps) {
    let (seeded, failed) = crate::store::record_missing(store, recorded.snapshot()).await;
    if seeded > 0 {
        info!(seeded, "recorded addresses the cluster already uses in our ranges");
    }
    if let Some((ip, e)) = failed.first() {
        warn!(failed = failed.len(), first = %ip, error = %e, "could not record addresses the cluster already uses; the Service reconciler and the repair pass retry");
    }
}

/// A kube client from an explicit kubeconfig, or the usual defaults.
pub async fn kube_client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no kubeconfig given and none found (KUBECONFIG, ~/.kube/config, in-cluster)")?,
    };
    kube::Client::try_from(config).context("building the Kubernetes client")
}

#[cfg(test)]
mod tests {
    use super::{refuse_unhonoured, BackendKind};

    fn refused(backend: BackendKind, use_servicecidrs: bool, pool_and_blocks: Option<(Option<usize>, Option<u64>)>) -> Option<String> {
        refuse_unhonoured(backend, use_servicecidrs, pool_and_blocks).err().map(|e| e.to_string())
    }

    #[test]
    fn a_flag_the_chosen_store_does_not_honour_is_refused() {
        // --use-servicecidrs: both IPAddress stores (the controller's blocks, the commands'
        // object writer) follow ServiceCIDRs; the etcd maps do not.
        assert_eq!(refused(BackendKind::Ipaddress, true, None), None);
        assert_eq!(refused(BackendKind::Ipaddress, true, Some((None, None))), None);
        assert!(refused(BackendKind::Etcd, true, None).is_some_and(|e| e.starts_with("--use-servicecidrs needs --backend ipaddress")));
        // Each backend's own way of answering from memory.
        assert!(refused(BackendKind::Etcd, false, Some((None, Some(32)))).is_some_and(|e| e.starts_with("--address-block-size needs --backend ipaddress")));
        assert!(refused(BackendKind::Ipaddress, false, Some((Some(0), None))).is_some_and(|e| e.starts_with("--etcd-address-pool needs --backend etcd")));
        assert_eq!(refused(BackendKind::Etcd, false, Some((Some(64), None))), None);
        assert_eq!(refused(BackendKind::Ipaddress, false, Some((None, Some(32)))), None);
    }
}
