//! A host's supervisor: heartbeats this host's chip states on the bus every interval,
//! declares another host down when its heartbeats stop for the configured timeout (and
//! tells the local router, which re-routes that host's requests; only a supervisor
//! beside a router watches its peers, so a cluster of N hosts handles N heartbeats per
//! interval per router rather than N²), and restarts a local
//! chip whose worker died, with exponential backoff and at most `max_restarts` per
//! window — after that the chip is left down and reported. A local chip whose state
//! changes (down, up, draining) is heartbeated at once, not at the next interval, so
//! routers stop placing work on a restarting chip within one bus hop.

use crate::msg::{ChipChange, ChipReport, Duty, Heartbeat, Msg, Role, topic};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tessera_actor_core::{Addr, HostId};
use tessera_actor_core::{Behavior, Effects, Moment};

#[derive(Debug, Clone, PartialEq)]
pub struct SupervisorConfig {
    pub host: HostId,
    pub host_name: String,
    /// The other hosts.
    pub peers: Vec<(HostId, String)>,
    /// The router, if it runs on this host.
    pub router: Option<Addr>,
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
    pub max_restarts: u32,
    pub restart_window: Duration,
    pub restart_backoff: Duration,
}

pub struct Supervisor {
    config: SupervisorConfig,
    chips: BTreeMap<Addr, ChipReport>,
    last_seen: BTreeMap<HostId, Moment>,
    down: BTreeSet<HostId>,
    restarts: BTreeMap<Addr, Vec<Moment>>,
    seq: u64,
}

/// The backoff before restart number `n` (0-based): doubling, capped at 32x.
pub fn backoff(base: Duration, n: usize) -> Duration {
    base * (1u32 << n.min(5))
}

impl Supervisor {
    pub fn new(config: SupervisorConfig) -> Supervisor {
        Supervisor {
            config,
            chips: BTreeMap::new(),
            last_seen: BTreeMap::new(),
            down: BTreeSet::new(),
            restarts: BTreeMap::new(),
            seq: 0,
        }
    }

    /// A re-plan's changes to this host's chips: limits first, so a chip that drains
    /// into a new role starts it with the new limits; then the role, which the chip
    /// takes once drained (or parked: drained, then idle). Each chip finishes what it
    /// holds, so no request is lost.
    fn apply_plan(&mut self, changes: Vec<ChipChange>, fx: &mut dyn Effects<Msg>) {
        for change in changes {
            if change.chip.host != self.config.host {
                tracing::warn!(chip = %change.chip, host = %self.config.host_name, "a plan names a chip of another host");
                continue;
            }
            let limits =
                Msg::SetLimits { max_batch_tokens: change.max_batch_tokens, max_batch_seqs: change.max_batch_seqs };
            let _ = fx.send(change.chip, limits);
            let order = match change.duty {
                None => continue,
                Some(Duty::Idle) => Msg::Park,
                Some(Duty::Prefill) => Msg::SetRole { role: Role::Prefill },
                Some(Duty::Decode) => Msg::SetRole { role: Role::Decode },
                Some(Duty::Both) => Msg::SetRole { role: Role::Both },
            };
            tracing::info!(chip = %change.chip, duty = ?change.duty, "re-plan: chip changes duty");
            let _ = fx.send(change.chip, order);
        }
    }

    fn beat(&mut self, fx: &mut dyn Effects<Msg>) {
        self.seq += 1;
        let beat = Heartbeat {
            host: self.config.host,
            host_name: self.config.host_name.clone(),
            seq: self.seq,
            chips: self.chips.values().cloned().collect(),
        };
        fx.publish(topic::HEARTBEAT, Msg::Heartbeat { beat: std::sync::Arc::new(beat) });
    }

    fn tick(&mut self, fx: &mut dyn Effects<Msg>) {
        self.beat(fx);
        let now = fx.now();
        let watched = if self.config.router.is_some() { &self.config.peers[..] } else { &[] };
        for (host, name) in watched {
            let seen = self.last_seen.get(host).copied().unwrap_or_default();
            if !self.down.contains(host) && now.since(seen) >= self.config.heartbeat_timeout {
                self.down.insert(*host);
                tracing::warn!(host = %name, silent_ms = now.since(seen).as_millis() as u64, "host missed its heartbeats: down");
                metrics::counter!("tessera_supervisor_hosts_down_total").increment(1);
                if let Some(router) = self.config.router {
                    let _ = fx.send(router, Msg::HostDown { host: *host, host_name: name.clone() });
                }
            }
        }
        fx.timer(self.config.heartbeat_interval, Msg::Tick);
    }

    fn chip_crashed(&mut self, chip: Addr, error: String, fx: &mut dyn Effects<Msg>) {
        let now = fx.now();
        let window = self.config.restart_window;
        let history = self.restarts.entry(chip).or_default();
        history.retain(|&t| now.since(t) < window);
        if history.len() as u32 >= self.config.max_restarts {
            let reason = format!(
                "left down after {} restarts within {} s; last error: {error}",
                history.len(),
                window.as_secs()
            );
            tracing::error!(%chip, %reason, "chip given up");
            metrics::counter!("tessera_supervisor_chips_given_up_total").increment(1);
            let _ = fx.send(chip, Msg::GiveUp { reason });
            return;
        }
        let delay = backoff(self.config.restart_backoff, history.len());
        history.push(now.after(delay));
        tracing::warn!(%chip, delay_ms = delay.as_millis() as u64, "restarting chip worker after backoff");
        metrics::counter!("tessera_supervisor_restarts_total").increment(1);
        fx.timer(delay, Msg::RestartDue { chip });
    }
}

impl Behavior<Msg> for Supervisor {
    fn name(&self) -> &'static str {
        "supervisor"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        if self.config.router.is_some() {
            fx.subscribe(topic::HEARTBEAT);
        }
        let now = fx.now();
        for (host, _) in &self.config.peers {
            // Every peer gets one full timeout from our start to show up.
            self.last_seen.insert(*host, now);
        }
        self.tick(fx);
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Tick => self.tick(fx),
            Msg::Report { report } => {
                let changed = self.chips.get(&report.chip).is_some_and(|old| {
                    (old.state, old.draining, old.parked, old.role)
                        != (report.state, report.draining, report.parked, report.role)
                });
                self.chips.insert(report.chip, *report);
                if changed {
                    self.beat(fx);
                }
            }
            Msg::Heartbeat { beat } if beat.host != self.config.host => {
                self.last_seen.insert(beat.host, fx.now());
                if self.down.remove(&beat.host) {
                    tracing::info!(host = %beat.host_name, "host is heartbeating again");
                }
            }
            Msg::RestartDue { chip } => {
                let _ = fx.send(chip, Msg::Restart);
            }
            Msg::ChipCrashed { chip, error } => self.chip_crashed(chip, error, fx),
            Msg::ApplyPlan { changes } => self.apply_plan(changes, fx),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_fx::TestFx;

    const ROUTER: Addr = Addr { host: HostId(0), actor: 2 };

    fn supervisor() -> Supervisor {
        Supervisor::new(SupervisorConfig {
            host: HostId(0),
            host_name: "h0".into(),
            peers: vec![(HostId(1), "h1".into())],
            router: Some(ROUTER),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(1000),
            max_restarts: 2,
            restart_window: Duration::from_secs(60),
            restart_backoff: Duration::from_millis(200),
        })
    }

    fn beat(host: u16) -> Msg {
        let beat = Heartbeat { host: HostId(host), host_name: format!("h{host}"), seq: 1, chips: vec![] };
        Msg::Heartbeat { beat: std::sync::Arc::new(beat) }
    }

    /// Without a router beside it a supervisor only heartbeats: it neither hears its
    /// peers nor judges them.
    #[test]
    fn only_a_supervisor_beside_a_router_watches_its_peers() {
        let mut fx = TestFx::new(Addr::new(HostId(0), 1));
        let mut s = Supervisor::new(SupervisorConfig { router: None, ..supervisor().config });
        s.on_start(&mut fx);
        assert!(fx.subscribed.is_empty(), "{:?}", fx.subscribed);
        assert_eq!(fx.published.len(), 1, "it still heartbeats");
        fx.advance(Duration::from_secs(5), &mut s);
        assert!(fx.take_sent().is_empty());
        let mut fx = TestFx::new(Addr::new(HostId(0), 1));
        supervisor().on_start(&mut fx);
        assert_eq!(fx.subscribed, vec![topic::HEARTBEAT.to_string()]);
    }

    #[test]
    fn a_silent_host_is_declared_down_within_the_timeout_once() {
        let mut fx = TestFx::new(Addr::new(HostId(0), 1));
        let mut s = supervisor();
        s.on_start(&mut fx);
        assert_eq!(fx.published.len(), 1, "heartbeats at once");
        for _ in 0..5 {
            fx.advance(Duration::from_millis(300), &mut s);
            s.handle(beat(1), &mut fx);
        }
        assert!(fx.take_sent().is_empty(), "a heartbeating peer stays up");
        // h1 falls silent at t = 1.5 s.
        fx.advance(Duration::from_millis(900), &mut s);
        assert!(fx.take_sent().is_empty());
        fx.advance(Duration::from_millis(200), &mut s);
        let down: Vec<_> =
            fx.take_sent().into_iter().filter(|(to, m)| *to == ROUTER && matches!(m, Msg::HostDown { .. })).collect();
        assert_eq!(down.len(), 1, "down within timeout + one interval");
        fx.advance(Duration::from_secs(5), &mut s);
        assert!(fx.take_sent().is_empty(), "reported once");
        assert!(fx.published.len() > 60, "it kept heartbeating every 100 ms");
    }

    #[test]
    fn crashed_chips_restart_with_backoff_then_are_given_up() {
        let chip = Addr::new(HostId(0), 16);
        let mut fx = TestFx::new(Addr::new(HostId(0), 1));
        let mut s = supervisor();
        s.on_start(&mut fx);
        // (crash, wait, expected message to the chip)
        for (wait_ms, expect_restart) in [(200, true), (400, true), (0, false)] {
            s.handle(Msg::ChipCrashed { chip, error: "boom".into() }, &mut fx);
            if expect_restart {
                fx.advance(Duration::from_millis(wait_ms - 1), &mut s);
                assert!(!fx.sent.iter().any(|(to, _)| *to == chip), "not before the backoff");
                fx.advance(Duration::from_millis(1), &mut s);
                assert!(fx.take_sent().iter().any(|(to, m)| *to == chip && *m == Msg::Restart));
            } else {
                assert!(fx.take_sent().iter().any(|(to, m)| *to == chip && matches!(m, Msg::GiveUp { .. })));
            }
        }
    }

    #[test]
    fn a_chip_state_change_is_heartbeated_at_once() {
        use crate::msg::ChipState;
        let chip = Addr::new(HostId(0), 16);
        let mut fx = TestFx::new(Addr::new(HostId(0), 1));
        let mut s = supervisor();
        s.on_start(&mut fx);
        let report = |state| ChipReport { state, ..ChipReport::starting(chip, "c", "h0", Role::Both) };
        // (report, heartbeats published at once)
        let table = [
            (report(ChipState::Starting), 0), // first report: the next tick carries it
            (report(ChipState::Up), 1),
            (ChipReport { kv_blocks_used: 3, ..report(ChipState::Up) }, 0), // figures only
            (report(ChipState::Down), 1),
            (report(ChipState::Starting), 1),
        ];
        for (i, (r, want)) in table.into_iter().enumerate() {
            fx.published.clear();
            let state = r.state;
            s.handle(Msg::Report { report: Box::new(r) }, &mut fx);
            assert_eq!(fx.published.len(), want, "report {i}");
            if want == 1 {
                let Msg::Heartbeat { beat } = &fx.published[0].1 else { panic!("not a heartbeat") };
                assert_eq!(beat.chips[0].state, state, "report {i}");
            }
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let base = Duration::from_millis(100);
        let table = [(0, 100), (1, 200), (2, 400), (5, 3200), (9, 3200)];
        for (n, ms) in table {
            assert_eq!(backoff(base, n), Duration::from_millis(ms), "restart {n}");
        }
    }
}
