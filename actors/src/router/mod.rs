//! The router: keeps a view of every chip (from heartbeats and its host supervisor's
//! verdicts) and of the work it has placed, and sends each request to the least loaded
//! healthy chip, by tokens still to be processed. When a chip goes down it tells every
//! request placed there, so they re-route and replay.

use crate::msg::{ChipReport, ChipState, ErrorKind, Msg, ServeError, topic};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use tessera_runtime::actor::{Behavior, Effects};
use tessera_runtime::{Addr, HostId};

/// A chip as the router knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChipView {
    pub report: ChipReport,
    /// Tokens (prompt + max new) of requests placed there and not yet released.
    pub load_tokens: usize,
}

/// The least loaded of the `Up` chips, preferring those not in `exclude`; ties go to
/// fewer placed tokens' chip with the lowest address, so the choice is deterministic.
pub fn pick(chips: &BTreeMap<Addr, ChipView>, down_hosts: &BTreeSet<HostId>, exclude: &[Addr]) -> Option<Addr> {
    let best = |avoid: &[Addr]| {
        chips
            .iter()
            .filter(|(a, c)| c.report.state == ChipState::Up && !down_hosts.contains(&a.host) && !avoid.contains(a))
            .min_by_key(|(a, c)| (c.load_tokens, **a))
            .map(|(a, _)| *a)
    };
    best(exclude).or_else(|| best(&[]))
}

struct Placement {
    chip: Addr,
    req: Addr,
    tokens: usize,
}

pub struct Router {
    chips: BTreeMap<Addr, ChipView>,
    down_hosts: BTreeSet<HostId>,
    down_host_names: BTreeMap<HostId, String>,
    placements: HashMap<u64, Placement>,
    max_queued_requests: usize,
}

impl Router {
    /// `chips`: every chip of the topology, reported as Starting until heard from.
    pub fn new(chips: Vec<ChipReport>, max_queued_requests: usize) -> Router {
        let chips = chips.into_iter().map(|r| (r.chip, ChipView { report: r, load_tokens: 0 })).collect();
        Router {
            chips,
            down_hosts: BTreeSet::new(),
            down_host_names: BTreeMap::new(),
            placements: HashMap::new(),
            max_queued_requests,
        }
    }

    fn update(&mut self, report: ChipReport, fx: &mut dyn Effects<Msg>) {
        let chip = report.chip;
        let was_up = self.chips.get(&chip).is_some_and(|c| c.report.state == ChipState::Up);
        let is_up = report.state == ChipState::Up;
        // The gateway's /metrics shows every chip of the cluster, not only local ones.
        let id = report.id.clone();
        metrics::gauge!("tessera_router_chip_up", "chip" => id.clone()).set(if is_up { 1.0 } else { 0.0 });
        metrics::gauge!("tessera_kv_blocks_used", "chip" => id.clone()).set(report.kv_blocks_used as f64);
        metrics::gauge!("tessera_kv_blocks_total", "chip" => id).set(report.kv_blocks_total as f64);
        let view = self.chips.entry(chip).or_insert_with(|| ChipView { report: report.clone(), load_tokens: 0 });
        view.report = report;
        if was_up && !is_up {
            self.lose(chip, fx);
        }
    }

    /// Every request placed on `chip` must go elsewhere.
    fn lose(&mut self, chip: Addr, fx: &mut dyn Effects<Msg>) {
        let lost: Vec<u64> = self.placements.iter().filter(|(_, p)| p.chip == chip).map(|(id, _)| *id).collect();
        for id in lost {
            if let Some(p) = self.placements.remove(&id) {
                let _ = fx.send(p.req, Msg::ChipLost { chip });
            }
        }
        if let Some(view) = self.chips.get_mut(&chip) {
            view.load_tokens = 0;
        }
    }

    fn host_down(&mut self, host: HostId, name: String, fx: &mut dyn Effects<Msg>) {
        if !self.down_hosts.insert(host) {
            return;
        }
        tracing::warn!(host = %name, "host down: its chips are out of rotation");
        self.down_host_names.insert(host, name);
        let chips: Vec<Addr> = self.chips.keys().filter(|a| a.host == host).copied().collect();
        for chip in chips {
            if let Some(view) = self.chips.get_mut(&chip) {
                metrics::gauge!("tessera_router_chip_up", "chip" => view.report.id.clone()).set(0.0);
                view.report.state = ChipState::Failed;
                view.report.error = Some("its host stopped heartbeating".into());
            }
            self.lose(chip, fx);
        }
    }

    fn route(&mut self, request_id: u64, req: Addr, tokens: usize, exclude: &[Addr], fx: &mut dyn Effects<Msg>) {
        if self.placements.len() >= self.max_queued_requests {
            let error = ServeError::new(
                ErrorKind::Overloaded,
                format!("{} requests are already in flight (the router's limit)", self.placements.len()),
            );
            let _ = fx.send(req, Msg::RouteFailed { request_id, error });
            return;
        }
        let Some(chip) = pick(&self.chips, &self.down_hosts, exclude) else {
            let states: Vec<String> =
                self.chips.values().map(|c| format!("{} {:?}", c.report.id, c.report.state).to_lowercase()).collect();
            let error = ServeError::new(ErrorKind::Unavailable, format!("no healthy chip ({})", states.join(", ")));
            let _ = fx.send(req, Msg::RouteFailed { request_id, error });
            return;
        };
        if let Some(old) = self.placements.insert(request_id, Placement { chip, req, tokens })
            && let Some(v) = self.chips.get_mut(&old.chip)
        {
            v.load_tokens = v.load_tokens.saturating_sub(old.tokens);
        }
        if let Some(v) = self.chips.get_mut(&chip) {
            v.load_tokens += tokens;
        }
        metrics::counter!("tessera_router_decisions_total").increment(1);
        let _ = fx.send(req, Msg::Routed { request_id, chip });
    }

    fn release(&mut self, request_id: u64, chip: Addr) {
        if self.placements.get(&request_id).is_some_and(|p| p.chip == chip)
            && let Some(p) = self.placements.remove(&request_id)
            && let Some(v) = self.chips.get_mut(&p.chip)
        {
            v.load_tokens = v.load_tokens.saturating_sub(p.tokens);
        }
    }
}

impl Behavior<Msg> for Router {
    fn name(&self) -> &'static str {
        "router"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        fx.subscribe(topic::HEARTBEAT);
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Route { request_id, req, tokens, exclude } => self.route(request_id, req, tokens, &exclude, fx),
            Msg::Release { request_id, chip } => self.release(request_id, chip),
            Msg::Heartbeat { beat } => {
                if self.down_hosts.contains(&beat.host) {
                    // The host is back (restarted): its chips report their own state.
                    tracing::info!(host = %beat.host_name, "host heartbeating again");
                    self.down_hosts.remove(&beat.host);
                    self.down_host_names.remove(&beat.host);
                }
                for report in beat.chips {
                    self.update(report, fx);
                }
            }
            Msg::HostDown { host, host_name } => self.host_down(host, host_name, fx),
            Msg::QueryCluster { reply_to } => {
                let chips = self.chips.values().map(|c| c.report.clone()).collect();
                let hosts_down = self.down_host_names.values().cloned().collect();
                let _ = fx.send(reply_to, Msg::ClusterView { chips, hosts_down });
            }
            other => tracing::debug!(kind = ?other, "router: unexpected message"),
        }
    }
}

#[cfg(test)]
mod tests;
