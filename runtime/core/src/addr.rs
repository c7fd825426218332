//! Actor addresses: which host, which actor on it.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A host (one OS process) of the cluster: its index in the topology's host list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HostId(pub u16);

/// An actor anywhere in the cluster. Actor ids below [`FIRST_DYNAMIC_ACTOR`] are
/// well-known (fixed by the code and the topology), so any host can name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Addr {
    pub host: HostId,
    pub actor: u64,
}

/// Spawned actors get ids from here upwards.
pub const FIRST_DYNAMIC_ACTOR: u64 = 1 << 20;

impl Addr {
    pub const fn new(host: HostId, actor: u64) -> Addr {
        Addr { host, actor }
    }
}

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host{}", self.0)
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.host, self.actor)
    }
}
