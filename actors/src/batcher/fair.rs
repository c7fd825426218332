//! Fair queuing between the tenants of one chip: weighted virtual token counters (VTC,
//! Sheng et al., "Fairness in Serving Large Language Models", OSDI'24). Each tenant's
//! counter is the service it got here divided by its weight; among waiting sequences of
//! one priority class the batcher starts the one whose tenant's counter is least. A
//! tenant that comes back after having nothing here is lifted to the least counter of
//! those present (with nobody present, to the greatest), so idle time banks no credit
//! and service received alone is no debt. Service is charged in this chip's
//! modelled seconds (its [`Pace`], the router's performance model): a prompt token costs
//! what it costs on this chip, so a tenant's share means the same on a slow chip and a
//! fast one, and the shares summed over chips of unlike speed are comparable.
//!
//! Invariant (VTC's bound): while two tenants both have work waiting here, their
//! counters differ by at most the cost of one sequence's largest step plus one step's
//! decode tokens, divided by the smaller weight.

use crate::msg::TenantShare;
use crate::router::cost::Pace;
use std::collections::BTreeMap;

#[derive(Debug)]
pub struct FairQueue {
    pace: Pace,
    /// Per tenant: weighted service so far, in this chip's seconds.
    counters: BTreeMap<u32, f64>,
    /// Per tenant: service since the last `take_service`, unweighted (chip seconds).
    service: BTreeMap<u32, f64>,
}

impl Default for FairQueue {
    fn default() -> FairQueue {
        FairQueue { pace: Pace::UNKNOWN, counters: BTreeMap::new(), service: BTreeMap::new() }
    }
}

impl FairQueue {
    /// Costs service at `pace` from now on.
    pub fn set_pace(&mut self, pace: Pace) {
        self.pace = pace;
    }

    /// The pace service is costed at.
    pub fn pace(&self) -> Pace {
        self.pace
    }

    /// `tenant`'s counter: its weighted service so far.
    pub fn counter(&self, tenant: u32) -> f64 {
        self.counters.get(&tenant).copied().unwrap_or(0.0)
    }

    /// `tenant` has just got its first sequence here while `present` tenants have some:
    /// its counter rises to the least of theirs — or, with nobody present, to the
    /// greatest counter of all (whoever was served last) — and never falls. So no
    /// tenant banks credit while away, nor carries a debt from having been served
    /// alone.
    pub fn arrive(&mut self, tenant: u32, present: impl IntoIterator<Item = u32>) {
        let least = present.into_iter().filter(|&t| t != tenant).map(|t| self.counter(t)).min_by(f64::total_cmp);
        let floor = least.or_else(|| self.counters.values().copied().max_by(f64::total_cmp)).unwrap_or(0.0);
        let counter = self.counters.entry(tenant).or_insert(0.0);
        *counter = counter.max(floor);
    }

    /// Charges a prompt chunk of `tokens` tokens.
    pub fn charge_prefill(&mut self, share: TenantShare, tokens: usize) {
        self.charge(share, tokens as f64 * self.pace.prefill_s_per_token);
    }

    /// Charges one decode token of a step that decodes `batch` sequences: an equal part
    /// of the step's decode time.
    pub fn charge_decode(&mut self, share: TenantShare, batch: usize) {
        let batch = batch.max(1) as f64;
        self.charge(share, self.pace.decode_s(batch) / batch);
    }

    /// Charges `seconds` of service (at whatever pace the caller costed it).
    pub fn charge(&mut self, share: TenantShare, seconds: f64) {
        *self.counters.entry(share.tenant).or_insert(0.0) += seconds / f64::from(share.weight.max(1));
        *self.service.entry(share.tenant).or_insert(0.0) += seconds;
    }

    /// Chip seconds served to each tenant since the last call.
    pub fn take_service(&mut self) -> BTreeMap<u32, f64> {
        std::mem::take(&mut self.service)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::PriorityClass;

    fn share(tenant: u32, weight: u32) -> TenantShare {
        TenantShare { tenant, weight, class: PriorityClass::Standard }
    }

    const PACE: Pace = Pace { prefill_s_per_token: 1e-3, decode_step_s: 1e-2, decode_s_per_seq: 1e-3 };

    #[test]
    fn service_is_charged_in_chip_seconds_over_the_weight() {
        let mut fair = FairQueue::default();
        fair.set_pace(PACE);
        fair.charge_prefill(share(0, 1), 100);
        fair.charge_prefill(share(1, 2), 100);
        // A decode step of 4 sequences takes 10 + 3 × 1 ms: 3.25 ms each.
        fair.charge_decode(share(1, 2), 4);
        assert!((fair.counter(0) - 0.1).abs() < 1e-12);
        assert!((fair.counter(1) - (0.1 + 0.00325) / 2.0).abs() < 1e-12);
        let service = fair.take_service();
        assert!((service[&1] - 0.10325).abs() < 1e-12);
        assert!(fair.take_service().is_empty());
    }

    #[test]
    fn a_returning_tenant_is_lifted_to_the_least_present_counter_or_the_greatest() {
        let mut fair = FairQueue::default();
        fair.set_pace(PACE);
        fair.charge_prefill(share(0, 1), 500);
        fair.charge_prefill(share(1, 1), 300);
        // Tenant 2, new, starts level with the least served of those present ...
        fair.arrive(2, [0, 1]);
        assert_eq!(fair.counter(2), fair.counter(1));
        // ... and one with more service than that keeps it: a counter never falls.
        fair.arrive(0, [1, 2]);
        assert!((fair.counter(0) - 0.5).abs() < 1e-12);
        // With nobody present, level with whoever was served most: a tenant that ran
        // alone carries no debt into the next contest.
        fair.arrive(3, []);
        assert!((fair.counter(3) - 0.5).abs() < 1e-12);
    }
}
