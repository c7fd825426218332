//! Capabilities: what a region's owner offered a reader. A capability is 16 random
//! bytes naming one region, a set of byte ranges of it, and when it expires (with the
//! hand-off's lease). A secured server serves a read only when its capability covers
//! the whole range asked for; an unknown, expired or mismatched one gets the same
//! refusal, so a guess learns nothing.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use super::TransferError;

pub type Capability = [u8; 16];

struct Grant {
    region: u64,
    /// Sorted, merged, non-empty ranges.
    ranges: Vec<Range<u64>>,
    expires: Instant,
}

/// The grants an engine made, shared with its server's connections.
#[derive(Clone, Default)]
pub(crate) struct Capabilities {
    grants: Arc<RwLock<HashMap<Capability, Grant>>>,
}

/// `ranges` sorted and merged (touching ranges join), empty ones dropped.
fn merged(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.retain(|r| r.start < r.end);
    ranges.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

impl Capabilities {
    pub(crate) fn grant(
        &self,
        token: Option<Capability>,
        region: u64,
        ranges: Vec<Range<u64>>,
        ttl: Duration,
    ) -> Result<Capability, TransferError> {
        let token = match token {
            Some(token) => token,
            None => tessera_access::random_bytes()
                .map_err(|e| TransferError::Internal(format!("no random source for a capability: {e}")))?,
        };
        let now = Instant::now();
        let mut grants = self.grants.write();
        grants.retain(|_, g| g.expires > now);
        grants.insert(token, Grant { region, ranges: merged(ranges), expires: now + ttl });
        Ok(token)
    }

    pub(crate) fn revoke(&self, token: &Capability) {
        self.grants.write().remove(token);
    }

    /// Whether `token` lets its holder read `len` bytes at `offset` of `region` now.
    pub(crate) fn allows(&self, token: &Capability, region: u64, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else { return false };
        let grants = self.grants.read();
        let Some(grant) = grants.get(token) else { return false };
        if grant.region != region || grant.expires <= Instant::now() {
            return false;
        }
        // The merged range that starts at or before `offset` must reach `end`.
        let i = grant.ranges.partition_point(|r| r.start <= offset);
        i > 0 && grant.ranges[i - 1].end >= end && (len > 0 || grant.ranges[i - 1].end > offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capability_covers_exactly_its_ranges_of_its_region_until_it_expires() {
        let caps = Capabilities::default();
        let ranges = vec![100..200, 200..300, 500..600, 0..0];
        let token = caps.grant(None, 7, ranges, Duration::from_secs(60)).expect("grant");
        #[rustfmt::skip]
        let table: [(u64, u64, u64, bool); 9] = [
            (7, 100, 200, true),  // across two touching ranges
            (7, 150, 10, true),
            (7, 500, 100, true),
            (7, 99, 2, false),    // starts before
            (7, 250, 100, false), // runs past the end
            (7, 300, 1, false),   // the gap
            (7, 450, 100, false),
            (8, 100, 10, false),  // another region
            (7, u64::MAX, 2, false),
        ];
        for (region, offset, len, want) in table {
            assert_eq!(caps.allows(&token, region, offset, len), want, "{region} {offset}+{len}");
        }
        assert!(!caps.allows(&[0; 16], 7, 100, 10), "an unknown token");
        // Regranting replaces; revoking ends.
        caps.grant(Some(token), 7, std::iter::once(0..10).collect(), Duration::from_secs(60)).expect("regrant");
        assert!(!caps.allows(&token, 7, 100, 10) && caps.allows(&token, 7, 0, 10));
        caps.revoke(&token);
        assert!(!caps.allows(&token, 7, 0, 10));
        let short = caps.grant(None, 7, std::iter::once(0..10).collect(), Duration::ZERO).expect("grant");
        assert!(!caps.allows(&short, 7, 0, 10), "expired");
    }
}
