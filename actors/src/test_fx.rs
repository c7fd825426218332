//! A recording `Effects` for unit tests of behaviors: a clock the test moves by hand,
//! and every send, publication and timer kept for inspection — virtual time, no threads.

use crate::msg::Msg;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tessera_runtime::Addr;
use tessera_runtime::actor::{Behavior, Effects, Job, Moment, Notifier, SendError, TimerId, WorkerId, WorkerSpec};

pub struct TestFx {
    pub me: Addr,
    pub now: Moment,
    pub sent: Vec<(Addr, Msg)>,
    pub published: Vec<(String, Msg)>,
    pub subscribed: Vec<String>,
    /// (due, message) of timers not yet fired.
    pub timers: Vec<(Moment, Msg)>,
    pub stopped: bool,
    /// Addresses whose sends fail with `NoSuchActor`.
    pub unreachable: Vec<Addr>,
    /// Behaviors spawned (not started).
    pub spawned: Vec<Box<dyn Behavior<Msg>>>,
    /// Jobs submitted to workers, not run: a test runs them (or not) by hand.
    pub jobs: Vec<Job<Msg>>,
    /// Messages posted through notifiers.
    pub notified: Arc<Mutex<Vec<Msg>>>,
}

impl TestFx {
    pub fn new(me: Addr) -> TestFx {
        TestFx {
            me,
            now: Moment(0),
            sent: Vec::new(),
            published: Vec::new(),
            subscribed: Vec::new(),
            timers: Vec::new(),
            stopped: false,
            unreachable: Vec::new(),
            spawned: Vec::new(),
            jobs: Vec::new(),
            notified: Arc::default(),
        }
    }

    /// Everything sent since the last call.
    pub fn take_sent(&mut self) -> Vec<(Addr, Msg)> {
        std::mem::take(&mut self.sent)
    }

    /// Moves the clock by `d`, delivering every timer that falls due, in order.
    pub fn advance(&mut self, d: Duration, behavior: &mut dyn Behavior<Msg>) {
        let end = self.now.after(d);
        loop {
            let next =
                self.timers.iter().enumerate().filter(|(_, (due, _))| *due <= end).min_by_key(|(_, (due, _))| *due);
            let Some((i, _)) = next else { break };
            let (due, msg) = self.timers.remove(i);
            self.now = due;
            behavior.handle(msg, self);
        }
        self.now = end;
    }
}

impl Effects<Msg> for TestFx {
    fn me(&self) -> Addr {
        self.me
    }
    fn now(&self) -> Moment {
        self.now
    }
    fn send(&mut self, to: Addr, msg: Msg) -> Result<(), SendError> {
        if self.unreachable.contains(&to) {
            return Err(SendError::NoSuchActor(to));
        }
        self.sent.push((to, msg));
        Ok(())
    }
    fn publish(&mut self, topic: &str, msg: Msg) {
        self.published.push((topic.to_string(), msg));
    }
    fn subscribe(&mut self, topic: &str) {
        self.subscribed.push(topic.to_string());
    }
    fn timer(&mut self, after: Duration, msg: Msg) -> TimerId {
        self.timers.push((self.now.after(after), msg));
        TimerId(self.timers.len() as u64)
    }
    fn cancel_timer(&mut self, _id: TimerId) {}
    fn spawn(&mut self, behavior: Box<dyn Behavior<Msg>>) -> Addr {
        self.spawned.push(behavior);
        Addr::new(self.me.host, tessera_runtime::addr::FIRST_DYNAMIC_ACTOR + self.spawned.len() as u64)
    }
    fn start_worker(&mut self, _spec: WorkerSpec<Msg>) -> WorkerId {
        WorkerId(1)
    }
    fn submit(&mut self, _worker: WorkerId, job: Job<Msg>) -> Result<(), SendError> {
        self.jobs.push(job);
        Ok(())
    }
    fn stop_worker(&mut self, _worker: WorkerId) {}
    fn notifier(&self) -> Notifier<Msg> {
        let notified = self.notified.clone();
        Notifier::new(move |msg| {
            if let Ok(mut v) = notified.lock() {
                v.push(msg);
            }
        })
    }
    fn stop(&mut self) {
        self.stopped = true;
    }
}
