//! Running behaviors without threads or a wall clock.
//!
//! - [`TestFx`]: a recording [`Effects`] for unit tests of one behavior: a clock the
//!   test moves by hand, and every send, publication, timer and job kept for inspection.
//! - [`VirtualHost`]: many behaviors (on any number of simulated hosts) on one event
//!   queue ordered by (time, sequence number). Jobs run at once on the calling thread
//!   and complete at the model time they declare; cross-host messages take a fixed
//!   latency. The same behaviors, the same seed, the same inputs give the same
//!   [`VirtualHost::trace`], byte for byte: nothing here depends on wall time, thread
//!   scheduling or map iteration order. Behaviors record metrics with the `metrics`
//!   macros; a virtual host scopes every delivery to its own recorder
//!   ([`VirtualHost::with_recorder`]; none by default), so several simulated clusters in
//!   one process never mix their metrics, nor write into the process's.

use crate::actor::{Behavior, Effects, Job, JobCtx, Message, Moment, SendError, TimerId, WorkerId, WorkerSpec};
use crate::addr::{Addr, FIRST_DYNAMIC_ACTOR, HostId};
use std::any::Any;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

/// What a job did when run by hand: its result, its notifications (offset, message) in
/// the order posted, and the model time it declared.
pub struct JobRun<M> {
    pub result: M,
    pub notifications: Vec<(Duration, M)>,
    pub elapsed: Option<Duration>,
}

/// A [`JobCtx`] that records.
struct RecordingCtx<M> {
    notifications: Vec<(Duration, M)>,
    elapsed: Option<Duration>,
}

impl<M> JobCtx<M> for RecordingCtx<M> {
    fn elapse(&mut self, d: Duration) {
        self.elapsed = Some(d);
    }

    fn notify_at(&mut self, at: Duration, msg: M) {
        self.notifications.push((at, msg));
    }
}

/// Runs `job` on `state` on this thread, recording what it tells its host.
pub fn run_job<M>(job: Job<M>, state: &mut dyn Any) -> JobRun<M> {
    let mut ctx = RecordingCtx { notifications: Vec::new(), elapsed: None };
    let result = (job.run)(state, &mut ctx);
    JobRun { result, notifications: ctx.notifications, elapsed: ctx.elapsed }
}

/// A recording `Effects` for one behavior under test.
pub struct TestFx<M: Message> {
    pub me: Addr,
    pub now: Moment,
    pub sent: Vec<(Addr, M)>,
    pub published: Vec<(String, M)>,
    pub subscribed: Vec<String>,
    /// Timers not yet fired or cancelled: (id, due, message).
    pub timers: Vec<(TimerId, Moment, M)>,
    pub stopped: bool,
    /// Addresses whose sends fail with `NoSuchActor`.
    pub unreachable: Vec<Addr>,
    /// Behaviors spawned (not started).
    pub spawned: Vec<Box<dyn Behavior<M>>>,
    /// Jobs submitted to workers, not run: a test runs them (or not) with [`run_job`].
    pub jobs: Vec<Job<M>>,
    next_timer: u64,
}

impl<M: Message> TestFx<M> {
    pub fn new(me: Addr) -> TestFx<M> {
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
            next_timer: 0,
        }
    }

    /// Everything sent since the last call.
    pub fn take_sent(&mut self) -> Vec<(Addr, M)> {
        std::mem::take(&mut self.sent)
    }

    /// Moves the clock by `d`, delivering every timer that falls due, in (due, id) order.
    pub fn advance(&mut self, d: Duration, behavior: &mut dyn Behavior<M>) {
        let end = self.now.after(d);
        loop {
            let next = self
                .timers
                .iter()
                .enumerate()
                .filter(|(_, (_, due, _))| *due <= end)
                .min_by_key(|(_, (id, due, _))| (*due, id.0));
            let Some((i, _)) = next else { break };
            let (_, due, msg) = self.timers.remove(i);
            self.now = due;
            behavior.handle(msg, self);
        }
        self.now = end;
    }
}

impl<M: Message> Effects<M> for TestFx<M> {
    fn me(&self) -> Addr {
        self.me
    }
    fn now(&self) -> Moment {
        self.now
    }
    fn send(&mut self, to: Addr, msg: M) -> Result<(), SendError> {
        if self.unreachable.contains(&to) {
            return Err(SendError::NoSuchActor(to));
        }
        self.sent.push((to, msg));
        Ok(())
    }
    fn publish(&mut self, topic: &str, msg: M) {
        self.published.push((topic.to_string(), msg));
    }
    fn subscribe(&mut self, topic: &str) {
        self.subscribed.push(topic.to_string());
    }
    fn timer(&mut self, after: Duration, msg: M) -> TimerId {
        self.next_timer += 1;
        let id = TimerId(self.next_timer);
        self.timers.push((id, self.now.after(after), msg));
        id
    }
    fn cancel_timer(&mut self, id: TimerId) {
        self.timers.retain(|(t, _, _)| *t != id);
    }
    fn spawn(&mut self, behavior: Box<dyn Behavior<M>>) -> Addr {
        self.spawned.push(behavior);
        Addr::new(self.me.host, FIRST_DYNAMIC_ACTOR + self.spawned.len() as u64)
    }
    fn start_worker(&mut self, _spec: WorkerSpec<M>) -> WorkerId {
        WorkerId(1)
    }
    fn submit(&mut self, _worker: WorkerId, job: Job<M>) -> Result<(), SendError> {
        self.jobs.push(job);
        Ok(())
    }
    fn stop_worker(&mut self, _worker: WorkerId) {}
    fn stop(&mut self) {
        self.stopped = true;
    }
}

// ---- the virtual-time host ----

enum Event<M> {
    Start,
    Deliver(M),
    Timer(TimerId, M),
    /// A published message for each of these subscribers, in order, at one time: one
    /// queue entry instead of one per subscriber.
    Fanout(Vec<Addr>, M),
}

/// An event's place in the queue: small, so that the heap moves 24 bytes per swap
/// rather than a whole message; the event itself waits in [`World::events`].
struct Queued {
    at: Moment,
    seq: u64,
    slot: usize,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Queued {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// A worker of the virtual host: its state, its owner, when it is next free.
struct VirtualWorker<M> {
    owner: Addr,
    state: Box<dyn Any>,
    on_panic: Box<dyn Fn(String) -> M + Send>,
    free_at: Moment,
}

/// The events by (time, sequence number): a heap, and beside it a FIFO of the events due
/// at the moment they were queued (messages between actors of one host, a job's result
/// that took no time): many of them, kept out of the heap's log-time work. Both hold
/// their events in (time, sequence) order (the clock never goes back and numbers only
/// grow), so taking the lesser of their firsts takes the events in the heap's order.
#[derive(Default)]
struct EventQueue {
    heap: BinaryHeap<Reverse<Queued>>,
    now: std::collections::VecDeque<Queued>,
}

impl EventQueue {
    fn push(&mut self, q: Queued, now: Moment) {
        if q.at == now { self.now.push_back(q) } else { self.heap.push(Reverse(q)) }
    }

    /// Whether the FIFO's first comes before the heap's.
    fn now_first(&self) -> bool {
        match (self.now.front(), self.heap.peek()) {
            (Some(a), Some(Reverse(b))) => a < b,
            (first, _) => first.is_some(),
        }
    }

    fn peek(&self) -> Option<&Queued> {
        if self.now_first() { self.now.front() } else { self.heap.peek().map(|Reverse(q)| q) }
    }

    fn pop(&mut self) -> Option<Queued> {
        if self.now_first() { self.now.pop_front() } else { self.heap.pop().map(|Reverse(q)| q) }
    }
}

/// Actors are looked up at every event: a multiply-xor hash of the address (fixed, so
/// runs are reproducible; nothing iterates these tables in an order that matters).
type AddrHash = BuildHasherDefault<AddrHasher>;

#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u16(&mut self, n: u16) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Everything but the behaviors themselves (so a behavior can run while the rest is
/// borrowed as its `Effects`).
struct World<M> {
    now: Moment,
    seq: u64,
    queue: EventQueue,
    /// The queued events by slot: (to, event).
    events: slab::Slab<(Addr, Event<M>)>,
    /// The rest of a fan-out being delivered: (its time and sequence number, subscriber,
    /// message), delivered before anything else.
    fanning: std::collections::VecDeque<(Moment, u64, Addr, M)>,
    /// Actors alive (started or about to start).
    alive: HashSet<Addr, AddrHash>,
    topics: BTreeMap<String, BTreeSet<Addr>>,
    cancelled: BTreeSet<TimerId>,
    next_timer: u64,
    next_actor: BTreeMap<HostId, u64>,
    workers: BTreeMap<u64, VirtualWorker<M>>,
    next_worker: u64,
    /// Behaviors spawned during the current delivery, installed after it.
    spawned: Vec<(Addr, Box<dyn Behavior<M>>)>,
    /// Hosts taken down: their actors neither receive nor send.
    down: BTreeSet<HostId>,
    latency: Duration,
    trace: Vec<String>,
    delivered: u64,
}

impl<M: Message> World<M> {
    fn push(&mut self, at: Moment, to: Addr, event: Event<M>) {
        self.seq += 1;
        let slot = self.events.insert((to, event));
        self.queue.push(Queued { at, seq: self.seq, slot }, self.now);
    }

    fn delay(&self, from: Addr, to: Addr) -> Duration {
        if from.host == to.host { Duration::ZERO } else { self.latency }
    }
}

/// The `Effects` of one actor while it handles one event.
struct VirtualFx<'a, M> {
    me: Addr,
    world: &'a mut World<M>,
    stop: bool,
}

/// A job's context on the virtual host: notifications are queued at their model time.
struct VirtualJobCtx<'a, M> {
    started: Moment,
    owner: Addr,
    world: &'a mut World<M>,
    elapsed: Duration,
}

impl<M: Message> JobCtx<M> for VirtualJobCtx<'_, M> {
    fn elapse(&mut self, d: Duration) {
        self.elapsed = d;
    }

    fn notify_at(&mut self, at: Duration, msg: M) {
        let (started, owner) = (self.started, self.owner);
        self.world.push(started.after(at), owner, Event::Deliver(msg));
    }
}

impl<M: Message> Effects<M> for VirtualFx<'_, M> {
    fn me(&self) -> Addr {
        self.me
    }
    fn now(&self) -> Moment {
        self.world.now
    }
    fn send(&mut self, to: Addr, msg: M) -> Result<(), SendError> {
        if self.world.down.contains(&to.host) {
            return Err(SendError::Unreachable(to.host));
        }
        if to.host == self.me.host && !self.world.alive.contains(&to) {
            return Err(SendError::NoSuchActor(to));
        }
        let at = self.world.now.after(self.world.delay(self.me, to));
        self.world.push(at, to, Event::Deliver(msg));
        Ok(())
    }
    fn publish(&mut self, topic: &str, msg: M) {
        // Subscribers on this host hear it now, the others after the bus latency.
        let (mut here, mut there) = (Vec::new(), Vec::new());
        for &to in self.world.topics.get(topic).into_iter().flatten() {
            if self.world.down.contains(&to.host) {
                continue;
            }
            if self.world.delay(self.me, to).is_zero() { here.push(to) } else { there.push(to) }
        }
        let now = self.world.now;
        let later = now.after(self.world.latency);
        if !here.is_empty() {
            self.world.push(now, self.me, Event::Fanout(here, msg.clone()));
        }
        if !there.is_empty() {
            self.world.push(later, self.me, Event::Fanout(there, msg));
        }
    }
    fn subscribe(&mut self, topic: &str) {
        self.world.topics.entry(topic.to_string()).or_default().insert(self.me);
    }
    fn timer(&mut self, after: Duration, msg: M) -> TimerId {
        self.world.next_timer += 1;
        let id = TimerId(self.world.next_timer);
        let at = self.world.now.after(after);
        self.world.push(at, self.me, Event::Timer(id, msg));
        id
    }
    fn cancel_timer(&mut self, id: TimerId) {
        self.world.cancelled.insert(id);
    }
    fn spawn(&mut self, behavior: Box<dyn Behavior<M>>) -> Addr {
        let next = self.world.next_actor.entry(self.me.host).or_insert(FIRST_DYNAMIC_ACTOR);
        let addr = Addr::new(self.me.host, *next);
        *next += 1;
        self.world.alive.insert(addr);
        self.world.push(self.world.now, addr, Event::Start);
        self.world.spawned.push((addr, behavior));
        addr
    }
    fn start_worker(&mut self, spec: WorkerSpec<M>) -> WorkerId {
        self.world.next_worker += 1;
        let id = self.world.next_worker;
        let WorkerSpec { init, on_panic, .. } = spec;
        let now = self.world.now;
        match catch_unwind(AssertUnwindSafe(init)) {
            Ok(Ok((state, ready))) => {
                self.world.workers.insert(id, VirtualWorker { owner: self.me, state, on_panic, free_at: now });
                self.world.push(now, self.me, Event::Deliver(ready));
            }
            Ok(Err(failed)) => self.world.push(now, self.me, Event::Deliver(failed)),
            Err(panic) => self.world.push(now, self.me, Event::Deliver(on_panic(panic_text(panic.as_ref())))),
        }
        WorkerId(id)
    }
    fn submit(&mut self, worker: WorkerId, job: Job<M>) -> Result<(), SendError> {
        let Some(w) = self.world.workers.get_mut(&worker.0) else {
            return Err(SendError::NoSuchActor(self.me));
        };
        // Jobs run in submission order: this one starts when the worker is free. Its
        // state is lent to the job (the worker keeps its place in the map: no node of
        // the map moves).
        let started = w.free_at.max(self.world.now);
        let owner = w.owner;
        let mut state = std::mem::replace(&mut w.state, Box::new(()));
        let mut ctx = VirtualJobCtx { started, owner, world: &mut *self.world, elapsed: Duration::ZERO };
        let run = job.run;
        match catch_unwind(AssertUnwindSafe(|| run(state.as_mut(), &mut ctx))) {
            Ok(result) => {
                let done = started.after(ctx.elapsed);
                if let Some(w) = self.world.workers.get_mut(&worker.0) {
                    w.state = state;
                    w.free_at = done;
                }
                self.world.push(done, owner, Event::Deliver(result));
            }
            Err(panic) => {
                // The worker stops, as a real one does: its state may be half-updated.
                if let Some(w) = self.world.workers.remove(&worker.0) {
                    let msg = (w.on_panic)(panic_text(panic.as_ref()));
                    self.world.push(started, owner, Event::Deliver(msg));
                }
            }
        }
        Ok(())
    }
    fn stop_worker(&mut self, worker: WorkerId) {
        self.world.workers.remove(&worker.0);
    }
    fn stop(&mut self) {
        self.stop = true;
    }
}

fn panic_text(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Many behaviors on one deterministic event queue; see the module doc.
pub struct VirtualHost<M: Message> {
    /// `None` while the behavior handles an event (it is taken out to run beside the
    /// world it borrows as its effects).
    behaviors: HashMap<Addr, Option<Box<dyn Behavior<M>>>, AddrHash>,
    world: World<M>,
    record: bool,
    recorder: Arc<dyn metrics::Recorder + Send + Sync>,
    /// Per message kind: deliveries and the wall time their handlers took (when kept).
    profile: Option<BTreeMap<&'static str, KindProfile>>,
}

/// Deliveries of one message kind and the wall time their handlers took: where a
/// simulation's time goes. The counts are deterministic; the times are not.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KindProfile {
    pub delivered: u64,
    pub wall: Duration,
}

impl<M: Message> Default for VirtualHost<M> {
    fn default() -> Self {
        VirtualHost::new(Duration::ZERO)
    }
}

impl<M: Message> VirtualHost<M> {
    /// A host whose messages between simulated hosts take `latency`.
    pub fn new(latency: Duration) -> VirtualHost<M> {
        VirtualHost {
            behaviors: HashMap::default(),
            world: World {
                now: Moment(0),
                seq: 0,
                queue: EventQueue::default(),
                events: slab::Slab::new(),
                fanning: std::collections::VecDeque::new(),
                alive: HashSet::default(),
                topics: BTreeMap::new(),
                cancelled: BTreeSet::new(),
                next_timer: 0,
                next_actor: BTreeMap::new(),
                workers: BTreeMap::new(),
                next_worker: 0,
                spawned: Vec::new(),
                down: BTreeSet::new(),
                latency,
                trace: Vec::new(),
                delivered: 0,
            },
            record: true,
            recorder: Arc::new(metrics::NoopRecorder),
            profile: None,
        }
    }

    /// Records the behaviors' metrics (and their jobs') into `recorder`.
    pub fn with_recorder(mut self, recorder: Arc<dyn metrics::Recorder + Send + Sync>) -> Self {
        self.recorder = recorder;
        self
    }

    /// Count deliveries and time handlers per message kind ([`VirtualHost::profile`]).
    pub fn with_profile(mut self, profile: bool) -> Self {
        self.profile = profile.then(BTreeMap::new);
        self
    }

    /// Deliveries and handler wall time per message kind, if kept.
    pub fn profile(&self) -> Option<&BTreeMap<&'static str, KindProfile>> {
        self.profile.as_ref()
    }

    /// Keep (default) or skip the trace of every delivery (long runs skip it).
    pub fn with_trace(mut self, record: bool) -> Self {
        self.record = record;
        self
    }

    /// Starts `behavior` at `addr` (a well-known address); it starts at the current time.
    pub fn spawn_at(&mut self, addr: Addr, behavior: Box<dyn Behavior<M>>) -> Addr {
        self.world.alive.insert(addr);
        let now = self.world.now;
        self.world.push(now, addr, Event::Start);
        self.behaviors.insert(addr, Some(behavior));
        addr
    }

    /// Starts `behavior` at the next dynamic address of `host`.
    pub fn spawn(&mut self, host: HostId, behavior: Box<dyn Behavior<M>>) -> Addr {
        let next = self.world.next_actor.entry(host).or_insert(FIRST_DYNAMIC_ACTOR);
        let addr = Addr::new(host, *next);
        *next += 1;
        self.spawn_at(addr, behavior)
    }

    /// Delivers `msg` to `to` at `at` (from outside any actor).
    pub fn send_at(&mut self, at: Moment, to: Addr, msg: M) {
        self.world.push(at.max(self.world.now), to, Event::Deliver(msg));
    }

    /// Takes `host` down now: its actors and workers are gone, nothing reaches it.
    pub fn kill_host(&mut self, host: HostId) {
        self.world.down.insert(host);
        let gone: Vec<Addr> = self.behaviors.keys().filter(|a| a.host == host).copied().collect();
        for addr in gone {
            self.behaviors.remove(&addr);
            self.world.alive.remove(&addr);
        }
        self.world.workers.retain(|_, w| w.owner.host != host);
        for subs in self.world.topics.values_mut() {
            subs.retain(|a| a.host != host);
        }
        let at = self.world.now;
        self.world.trace.push(format!("{} host {} down", at.0, host.0));
    }

    pub fn now(&self) -> Moment {
        self.world.now
    }

    /// Is an actor at `addr` alive?
    pub fn is_alive(&self, addr: Addr) -> bool {
        self.behaviors.contains_key(&addr)
    }

    /// The behavior at `addr`, for inspection between steps.
    pub fn behavior(&self, addr: Addr) -> Option<&dyn Behavior<M>> {
        self.behaviors.get(&addr).and_then(|b| b.as_deref())
    }

    /// Messages delivered so far.
    pub fn delivered(&self) -> u64 {
        self.world.delivered
    }

    /// One line per delivery: `time seq to kind message`, in delivery order.
    pub fn trace(&self) -> &[String] {
        &self.world.trace
    }

    /// Processes the next event; `false` when the queue is empty.
    pub fn step(&mut self) -> bool {
        let recorder = self.recorder.clone();
        metrics::with_local_recorder(recorder.as_ref(), || self.deliver_next())
    }

    fn deliver_next(&mut self) -> bool {
        let (at, seq, to, event) = match self.world.fanning.pop_front() {
            Some((at, seq, to, msg)) => (at, seq, to, Event::Deliver(msg)),
            None => {
                let Some(q) = self.world.queue.pop() else { return false };
                match self.world.events.remove(q.slot) {
                    (_, Event::Fanout(subscribers, msg)) => {
                        if let Some((&last, rest)) = subscribers.split_last() {
                            for &to in rest {
                                self.world.fanning.push_back((q.at, q.seq, to, msg.clone()));
                            }
                            self.world.fanning.push_back((q.at, q.seq, last, msg));
                        }
                        self.world.now = q.at;
                        return true;
                    }
                    (to, event) => (q.at, q.seq, to, event),
                }
            }
        };
        self.world.now = at;
        let Some(mut behavior) = self.behaviors.get_mut(&to).and_then(Option::take) else {
            return true; // to an actor that is gone: dropped, as on a real host
        };
        let mut fx = VirtualFx { me: to, world: &mut self.world, stop: false };
        match event {
            Event::Start => {
                if self.record {
                    fx.world.trace.push(format!("{} {seq} {to} start {}", at.0, behavior.name()));
                }
                behavior.on_start(&mut fx);
            }
            Event::Timer(id, _) if fx.world.cancelled.remove(&id) => {}
            // Expanded into its deliveries when it left the queue.
            Event::Fanout(..) => {}
            Event::Deliver(msg) | Event::Timer(_, msg) => {
                fx.world.delivered += 1;
                if self.record {
                    fx.world.trace.push(format!("{} {seq} {to} {} {:?}", at.0, msg.kind(), msg));
                }
                match self.profile.as_mut() {
                    Some(profile) => {
                        let kind = msg.kind();
                        let started = std::time::Instant::now();
                        behavior.handle(msg, &mut fx);
                        let entry = profile.entry(kind).or_default();
                        entry.delivered += 1;
                        entry.wall += started.elapsed();
                    }
                    None => behavior.handle(msg, &mut fx),
                }
            }
        }
        let stop = fx.stop;
        for (addr, b) in std::mem::take(&mut self.world.spawned) {
            self.behaviors.insert(addr, Some(b));
        }
        if stop {
            self.behaviors.remove(&to);
            self.world.alive.remove(&to);
            for subs in self.world.topics.values_mut() {
                subs.remove(&to);
            }
        } else if let Some(place) = self.behaviors.get_mut(&to) {
            *place = Some(behavior);
        }
        true
    }

    /// Runs events until the queue is empty or the clock passes `until`.
    pub fn run_until(&mut self, until: Moment) {
        while self.next_at().is_some_and(|at| at <= until) {
            self.step();
        }
        self.world.now = self.world.now.max(until);
    }

    /// When the next event is due: the rest of a fan-out now, else the queue's first.
    fn next_at(&self) -> Option<Moment> {
        match self.world.fanning.front() {
            Some((at, ..)) => Some(*at),
            None => self.world.queue.peek().map(|next| next.at),
        }
    }

    /// Runs until `done` holds (checked after each event) or the clock passes `limit`;
    /// returns whether `done` held.
    pub fn run_while(&mut self, limit: Moment, mut done: impl FnMut(&VirtualHost<M>) -> bool) -> bool {
        loop {
            if done(self) {
                return true;
            }
            match self.next_at() {
                Some(at) if at <= limit => {
                    self.step();
                }
                _ => return done(self),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    enum T {
        Ping(u32),
        Ready,
        Done(u32),
        Layer(u32),
        Tick,
    }

    impl Message for T {
        fn kind(&self) -> &'static str {
            match self {
                T::Ping(_) => "ping",
                T::Ready => "ready",
                T::Done(_) => "done",
                T::Layer(_) => "layer",
                T::Tick => "tick",
            }
        }
    }

    /// Records (time, message) of everything it gets; forwards pings to `peer` once.
    struct Echo {
        peer: Option<Addr>,
        log: std::sync::Arc<std::sync::Mutex<Vec<(u64, T)>>>,
    }

    impl Behavior<T> for Echo {
        fn name(&self) -> &'static str {
            "echo"
        }
        fn handle(&mut self, msg: T, fx: &mut dyn Effects<T>) {
            if let (T::Ping(n), Some(peer)) = (&msg, self.peer) {
                let _ = fx.send(peer, T::Ping(n + 1));
            }
            self.log.lock().unwrap().push((fx.now().0, msg));
        }
    }

    #[test]
    fn cross_host_messages_take_the_latency_and_order_is_time_then_sequence() {
        let log = std::sync::Arc::default();
        let mut vh: VirtualHost<T> = VirtualHost::new(Duration::from_millis(5));
        let a = vh.spawn(HostId(0), Box::new(Echo { peer: None, log: std::sync::Arc::clone(&log) }));
        let b = vh.spawn(HostId(1), Box::new(Echo { peer: Some(a), log: std::sync::Arc::clone(&log) }));
        vh.send_at(Moment(1_000_000), b, T::Ping(1));
        vh.send_at(Moment(1_000_000), a, T::Ping(10));
        vh.run_until(Moment(100_000_000));
        let log = log.lock().unwrap().clone();
        // (time ns, message): b's forward reaches a 5 ms later.
        assert_eq!(log, vec![(1_000_000, T::Ping(1)), (1_000_000, T::Ping(10)), (6_000_000, T::Ping(2))]);
    }

    /// Subscribes to "t"; on a ping, publishes a `Done` on it and sends itself a tick.
    struct Publisher {
        log: std::sync::Arc<std::sync::Mutex<Vec<(u64, Addr, T)>>>,
    }

    impl Behavior<T> for Publisher {
        fn name(&self) -> &'static str {
            "publisher"
        }
        fn on_start(&mut self, fx: &mut dyn Effects<T>) {
            fx.subscribe("t");
        }
        fn handle(&mut self, msg: T, fx: &mut dyn Effects<T>) {
            if let T::Ping(n) = msg {
                fx.publish("t", T::Done(n));
                let _ = fx.send(fx.me(), T::Tick);
            }
            self.log.lock().unwrap().push((fx.now().0, fx.me(), msg));
        }
    }

    #[test]
    fn a_publication_reaches_local_subscribers_now_and_remote_ones_after_the_latency_in_order() {
        let log = std::sync::Arc::default();
        let mut vh: VirtualHost<T> = VirtualHost::new(Duration::from_millis(5)).with_profile(true);
        let mut spawn = |host| vh.spawn(HostId(host), Box::new(Publisher { log: std::sync::Arc::clone(&log) }));
        let (a0, a1, b0, c0) = (spawn(0), spawn(0), spawn(1), spawn(2));
        vh.send_at(Moment(1_000_000), a0, T::Ping(7));
        // Host 2 goes down first: its subscriber hears nothing.
        vh.run_until(Moment(0));
        vh.kill_host(HostId(2));
        vh.run_until(Moment(100_000_000));
        let got: Vec<(u64, Addr, T)> = log.lock().unwrap().clone();
        let ms = |m: u64| m * 1_000_000;
        // The publisher's own host in subscription order, before the tick it sent after
        // publishing; the other host 5 ms later.
        let want = vec![
            (ms(1), a0, T::Ping(7)),
            (ms(1), a0, T::Done(7)),
            (ms(1), a1, T::Done(7)),
            (ms(1), a0, T::Tick),
            (ms(6), b0, T::Done(7)),
        ];
        assert_eq!(got, want);
        assert!(!got.iter().any(|(_, a, _)| *a == c0));
        let profile = vh.profile().cloned().unwrap_or_default();
        assert_eq!(profile.get("done").map(|p| p.delivered), Some(3));
        assert_eq!(vh.delivered(), 5);
    }

    /// Starts a worker, submits two jobs that declare model time, and cancels a timer.
    struct Worker {
        log: std::sync::Arc<std::sync::Mutex<Vec<(u64, T)>>>,
        worker: Option<WorkerId>,
    }

    impl Behavior<T> for Worker {
        fn name(&self) -> &'static str {
            "worker"
        }
        fn on_start(&mut self, fx: &mut dyn Effects<T>) {
            let spec = WorkerSpec {
                name: "w".into(),
                init: Box::new(|| Ok((Box::new(0u32) as Box<dyn Any>, T::Ready))),
                on_panic: Box::new(|_| T::Done(0)),
            };
            self.worker = Some(fx.start_worker(spec));
            let cancelled = fx.timer(Duration::from_millis(1), T::Tick);
            fx.cancel_timer(cancelled);
            fx.timer(Duration::from_millis(2), T::Tick);
        }
        fn handle(&mut self, msg: T, fx: &mut dyn Effects<T>) {
            if msg == T::Ready
                && let Some(w) = self.worker
            {
                for n in 1..=2u32 {
                    let job = Job {
                        label: "step",
                        run: Box::new(move |state: &mut dyn Any, ctx: &mut dyn JobCtx<T>| {
                            let count = state.downcast_mut::<u32>().expect("u32 state");
                            *count += n;
                            ctx.notify_at(Duration::from_millis(3), T::Layer(n));
                            ctx.elapse(Duration::from_millis(10));
                            T::Done(*count)
                        }),
                    };
                    fx.submit(w, job).expect("submit");
                }
            }
            self.log.lock().unwrap().push((fx.now().0, msg));
        }
    }

    #[test]
    fn jobs_complete_at_their_model_time_one_after_another_and_cancelled_timers_stay_quiet() {
        let log = std::sync::Arc::default();
        let mut vh: VirtualHost<T> = VirtualHost::default();
        vh.spawn(HostId(0), Box::new(Worker { log: std::sync::Arc::clone(&log), worker: None }));
        vh.run_until(Moment(1_000_000_000));
        let ms = |m: u64| m * 1_000_000;
        let want = vec![
            (0, T::Ready),
            (ms(2), T::Tick),
            (ms(3), T::Layer(1)),
            (ms(10), T::Done(1)),
            // The second job starts when the first is done.
            (ms(13), T::Layer(2)),
            (ms(20), T::Done(3)),
        ];
        assert_eq!(*log.lock().unwrap(), want);
    }

    #[test]
    fn test_fx_timers_are_unique_and_cancellable() {
        let mut fx: TestFx<T> = TestFx::new(Addr::new(HostId(0), 1));
        let a = fx.timer(Duration::from_millis(5), T::Tick);
        let b = fx.timer(Duration::from_millis(5), T::Ping(1));
        assert_ne!(a, b);
        fx.cancel_timer(a);
        let log = std::sync::Arc::default();
        let mut echo = Echo { peer: None, log: std::sync::Arc::clone(&log) };
        fx.advance(Duration::from_millis(10), &mut echo);
        assert_eq!(*log.lock().unwrap(), vec![(5_000_000, T::Ping(1))]);
    }
}
