//! The iptables dataplane (`--mode iptables`): placeholder, filled in below.

use ipnet::IpNet;

use crate::netns::Executor;
use crate::proxier::{DataplaneError, Proxier, SyncBatch, SyncReport};

pub struct IptablesProxier {
    exec: Executor,
    masquerade_all: bool,
    cluster_cidrs: Vec<IpNet>,
}

impl IptablesProxier {
    pub fn new(exec: Executor, masquerade_all: bool, cluster_cidrs: Vec<IpNet>) -> Self {
        IptablesProxier { exec, masquerade_all, cluster_cidrs }
    }
}

impl Proxier for IptablesProxier {
    fn sync(&mut self, _batch: &SyncBatch) -> Result<SyncReport, DataplaneError> {
        let _ = (&self.exec, self.masquerade_all, &self.cluster_cidrs);
        Ok(SyncReport::default())
    }
    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        Ok(vec![])
    }
    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        Ok(())
    }
    fn mode(&self) -> &'static str {
        "iptables"
    }
}
