//! The real-time host: runs behaviors as actix actors on one actor thread, compute jobs
//! on worker threads, and reaches other hosts through the bus. Messages to actors on
//! this host never touch the bus. Behaviors record metrics into the process's global
//! recorder — one process is one host of one cluster — which the node installs (the
//! gateway's Prometheus exporter); the virtual host scopes them to its own instead.

use crate::actor::{Behavior, Effects, Job, JobCtx, Message, Moment, SendError, TimerId, WorkerId, WorkerSpec};
use crate::addr::{Addr, FIRST_DYNAMIC_ACTOR, HostId};
use crate::bus::{Bus, InboundFn};
use crate::codec::{self, Envelope, PROTOCOL_VERSION};
use actix::prelude::*;
use actix_rt::ArbiterHandle;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread;
use std::time::{Duration, Instant};

/// The address used for messages sent from outside any actor (HTTP handlers, tests).
pub const OUTSIDE_ACTOR: u64 = 0;

struct Deliver<M>(M);

impl<M: Message> actix::Message for Deliver<M> {
    type Result = ();
}

enum Local<M: Message> {
    Actor(actix::Addr<ActorCell<M>>),
    Mailbox(tokio::sync::mpsc::UnboundedSender<M>),
}

struct WorkerHandle<M> {
    jobs: std::sync::mpsc::Sender<Job<M>>,
    stop: Arc<AtomicBool>,
}

/// What every actor and worker thread of a host shares.
struct HostCore<M: Message> {
    host: HostId,
    epoch: Instant,
    next_actor: AtomicU64,
    next_worker: AtomicU64,
    next_timer: AtomicU64,
    local: RwLock<HashMap<u64, Local<M>>>,
    topics: RwLock<HashMap<String, Vec<u64>>>,
    workers: Mutex<HashMap<u64, WorkerHandle<M>>>,
    bus: OnceLock<Bus>,
    arbiter: ArbiterHandle,
}

impl<M: Message> HostCore<M> {
    fn now(&self) -> Moment {
        Moment(self.epoch.elapsed().as_nanos() as u64)
    }

    fn deliver_local(&self, to: Addr, msg: M) -> Result<(), SendError> {
        match self.local.read().get(&to.actor) {
            Some(Local::Actor(a)) if a.connected() => {
                a.do_send(Deliver(msg));
                Ok(())
            }
            Some(Local::Mailbox(tx)) => tx.send(msg).map_err(|_| SendError::NoSuchActor(to)),
            _ => Err(SendError::NoSuchActor(to)),
        }
    }

    fn send(&self, from: Addr, to: Addr, msg: M) -> Result<(), SendError> {
        if to.host == self.host {
            return self.deliver_local(to, msg);
        }
        let bus = self.bus.get().ok_or(SendError::Unreachable(to.host))?;
        let env = envelope(from, Some(to), None, &msg)?;
        bus.send(env).map_err(|e| map_bus_error(e, to.host))
    }

    fn publish(&self, from: Addr, topic: &str, msg: M) {
        if let Some(bus) = self.bus.get() {
            match envelope(from, None, Some(topic), &msg) {
                Ok(env) => {
                    if let Err(e) = bus.publish(env) {
                        tracing::debug!(topic, error = %e, "publication not queued on the bus");
                    }
                }
                Err(e) => tracing::warn!(topic, error = %e, "cannot encode a publication"),
            }
        }
        self.publish_local(topic, msg);
    }

    fn publish_local(&self, topic: &str, msg: M) {
        let subscribers = self.topics.read().get(topic).cloned().unwrap_or_default();
        for actor in subscribers {
            // A subscriber that stopped meanwhile simply misses it.
            let _ = self.deliver_local(Addr::new(self.host, actor), msg.clone());
        }
    }

    fn subscribe(&self, topic: &str, actor: u64) {
        let mut topics = self.topics.write();
        let subs = topics.entry(topic.to_string()).or_default();
        if !subs.contains(&actor) {
            subs.push(actor);
        }
    }

    fn unregister(&self, actor: u64) {
        self.local.write().remove(&actor);
        for subs in self.topics.write().values_mut() {
            subs.retain(|&a| a != actor);
        }
    }

    /// A frame from the bus: decode the payload and hand it to its local recipients.
    fn on_frame(&self, env: Envelope) {
        let msg: M = match codec::decode_payload(&env.payload) {
            Ok(m) => m,
            Err(e) => {
                metrics::counter!("tessera_bus_frames_dropped_total", "reason" => "payload").increment(1);
                tracing::warn!(from = %env.from, kind = %env.kind, error = %e, "dropped a frame whose payload does not decode");
                return;
            }
        };
        match (env.to, env.topic) {
            (Some(to), _) if to.host == self.host => {
                if self.deliver_local(to, msg).is_err() {
                    metrics::counter!("tessera_runtime_messages_dropped_total", "reason" => "no_such_actor")
                        .increment(1);
                    tracing::debug!(%to, kind = %env.kind, "dropped a message for an actor that is gone");
                }
            }
            (None, Some(topic)) => self.publish_local(&topic, msg),
            _ => {
                metrics::counter!("tessera_bus_frames_dropped_total", "reason" => "misaddressed").increment(1);
                tracing::warn!(from = %env.from, kind = %env.kind, "dropped a frame addressed to another host");
            }
        }
    }

    fn start_worker(self: &Arc<Self>, owner: Addr, spec: WorkerSpec<M>) -> WorkerId {
        let id = self.next_worker.fetch_add(1, Ordering::Relaxed);
        let (jobs, rx) = std::sync::mpsc::channel::<Job<M>>();
        let stop = Arc::new(AtomicBool::new(false));
        self.workers.lock().insert(id, WorkerHandle { jobs, stop: stop.clone() });
        let core = Arc::downgrade(self);
        let WorkerSpec { name, init, on_panic } = spec;
        let report = move |core: &Weak<HostCore<M>>, msg: M| {
            if let Some(core) = core.upgrade() {
                // The owner may have stopped; then nobody is waiting for the result.
                let _ = core.deliver_local(owner, msg);
            }
        };
        let forget = move |core: &Weak<HostCore<M>>| {
            if let Some(core) = core.upgrade() {
                core.workers.lock().remove(&id);
            }
        };
        let spawned = thread::Builder::new().name(name.clone()).spawn(move || {
            let mut state = match catch_unwind(AssertUnwindSafe(init)) {
                Ok(Ok((state, ready))) => {
                    report(&core, ready);
                    state
                }
                Ok(Err(failed)) => {
                    forget(&core);
                    report(&core, failed);
                    return;
                }
                Err(panic) => {
                    forget(&core);
                    report(&core, on_panic(panic_message(panic.as_ref())));
                    return;
                }
            };
            while let Ok(job) = rx.recv() {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                let label = job.label;
                let mut ctx = PacedJob { started: Instant::now(), declared: None, owner, core: &core };
                match catch_unwind(AssertUnwindSafe(|| (job.run)(state.as_mut(), &mut ctx))) {
                    Ok(msg) => {
                        // Model time: the one place a job's declared duration is waited out.
                        if let Some(d) = ctx.declared {
                            sleep_until(ctx.started + d);
                        }
                        report(&core, msg)
                    }
                    Err(panic) => {
                        let text = panic_message(panic.as_ref());
                        tracing::error!(worker = %name, job = label, panic = %text, "a compute job panicked; the worker stops");
                        forget(&core);
                        report(&core, on_panic(text));
                        return;
                    }
                }
            }
        });
        if let Err(e) = spawned {
            self.workers.lock().remove(&id);
            tracing::error!(error = %e, "cannot start a worker thread");
        }
        WorkerId(id)
    }

    fn submit(&self, worker: WorkerId, job: Job<M>) -> Result<(), SendError> {
        let workers = self.workers.lock();
        let handle = workers.get(&worker.0).ok_or(SendError::NoSuchActor(Addr::new(self.host, 0)))?;
        handle.jobs.send(job).map_err(|_| SendError::NoSuchActor(Addr::new(self.host, 0)))
    }

    fn stop_worker(&self, worker: WorkerId) {
        if let Some(handle) = self.workers.lock().remove(&worker.0) {
            handle.stop.store(true, Ordering::Release);
        }
    }

    fn spawn(self: &Arc<Self>, id: Option<u64>, behavior: Box<dyn Behavior<M>>) -> Addr {
        let actor = id.unwrap_or_else(|| self.next_actor.fetch_add(1, Ordering::Relaxed));
        let me = Addr::new(self.host, actor);
        let core = self.clone();
        let addr = ActorCell::start_in_arbiter(&self.arbiter, move |ctx: &mut Context<ActorCell<M>>| {
            // Registered before `started` too, so on_start may already message itself.
            core.local.write().insert(actor, Local::Actor(ctx.address()));
            ActorCell { me, core, behavior: Some(behavior), timers: HashMap::new(), stopping: false }
        });
        // And right away, so the caller can message it at once (messages queue until it
        // starts). If it already stopped, the entry is disconnected and sends fail.
        self.local.write().insert(actor, Local::Actor(addr));
        me
    }
}

/// Sleeps the calling (worker) thread until `due`.
fn sleep_until(due: Instant) {
    if let Some(wait) = due.checked_duration_since(Instant::now()) {
        thread::sleep(wait);
    }
}

/// A job's context on the real-time host: declared model time is waited out on the
/// worker thread (a job that declares none took what it measured); a notification is
/// posted once its model time has come.
struct PacedJob<'a, M: Message> {
    started: Instant,
    declared: Option<Duration>,
    owner: Addr,
    core: &'a Weak<HostCore<M>>,
}

impl<M: Message> JobCtx<M> for PacedJob<'_, M> {
    fn elapse(&mut self, d: Duration) {
        self.declared = Some(d);
    }

    fn notify_at(&mut self, at: Duration, msg: M) {
        sleep_until(self.started + at);
        if let Some(core) = self.core.upgrade() {
            // The owner may have stopped; then nobody is waiting for it.
            let _ = core.deliver_local(self.owner, msg);
        }
    }
}

fn envelope<M: Message>(from: Addr, to: Option<Addr>, topic: Option<&str>, msg: &M) -> Result<Envelope, SendError> {
    let payload = codec::encode_payload(msg).map_err(|e| SendError::Encode(e.to_string()))?;
    Ok(Envelope {
        v: PROTOCOL_VERSION,
        from,
        to,
        topic: topic.map(str::to_string),
        kind: msg.kind().to_string(),
        corr: 0,
        payload,
    })
}

fn map_bus_error(e: crate::bus::SendError, host: HostId) -> SendError {
    match e {
        crate::bus::SendError::Full { .. } => SendError::Full(host),
        crate::bus::SendError::Encode(e) => SendError::Encode(e.to_string()),
        _ => SendError::Unreachable(host),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// One behavior as an actix actor.
struct ActorCell<M: Message> {
    me: Addr,
    core: Arc<HostCore<M>>,
    behavior: Option<Box<dyn Behavior<M>>>,
    timers: HashMap<u64, SpawnHandle>,
    stopping: bool,
}

impl<M: Message> ActorCell<M> {
    fn run(&mut self, ctx: &mut Context<Self>, f: impl FnOnce(&mut dyn Behavior<M>, &mut dyn Effects<M>)) {
        let Some(mut behavior) = self.behavior.take() else { return };
        let mut fx = CellEffects { me: self.me, core: &self.core, ctx, timers: &mut self.timers, stop: false };
        f(behavior.as_mut(), &mut fx);
        let stop = fx.stop;
        self.behavior = Some(behavior);
        if stop && !self.stopping {
            self.stopping = true;
            ctx.stop();
        }
    }
}

impl<M: Message> Actor for ActorCell<M> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.run(ctx, |b, fx| b.on_start(fx));
    }

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        self.core.unregister(self.me.actor);
    }
}

impl<M: Message> Handler<Deliver<M>> for ActorCell<M> {
    type Result = ();

    fn handle(&mut self, Deliver(msg): Deliver<M>, ctx: &mut Context<Self>) {
        if !self.stopping {
            // How long each behavior takes over each kind of message (the router's
            // decision time is its `route`): measured here, as behaviors read no clock.
            let (kind, started) = (msg.kind(), std::time::Instant::now());
            let mut actor = "";
            self.run(ctx, |b, fx| {
                actor = b.name();
                b.handle(msg, fx)
            });
            metrics::histogram!("tessera_actor_handle_seconds", "actor" => actor, "message" => kind)
                .record(started.elapsed().as_secs_f64());
        }
    }
}

struct CellEffects<'a, M: Message> {
    me: Addr,
    core: &'a Arc<HostCore<M>>,
    ctx: &'a mut Context<ActorCell<M>>,
    timers: &'a mut HashMap<u64, SpawnHandle>,
    stop: bool,
}

impl<M: Message> Effects<M> for CellEffects<'_, M> {
    fn me(&self) -> Addr {
        self.me
    }

    fn now(&self) -> Moment {
        self.core.now()
    }

    fn send(&mut self, to: Addr, msg: M) -> Result<(), SendError> {
        self.core.send(self.me, to, msg)
    }

    fn publish(&mut self, topic: &str, msg: M) {
        self.core.publish(self.me, topic, msg);
    }

    fn subscribe(&mut self, topic: &str) {
        self.core.subscribe(topic, self.me.actor);
    }

    fn timer(&mut self, after: Duration, msg: M) -> TimerId {
        let id = self.core.next_timer.fetch_add(1, Ordering::Relaxed);
        let handle = self.ctx.run_later(after, move |cell, ctx| {
            cell.timers.remove(&id);
            if !cell.stopping {
                cell.run(ctx, |b, fx| b.handle(msg, fx));
            }
        });
        self.timers.insert(id, handle);
        TimerId(id)
    }

    fn cancel_timer(&mut self, id: TimerId) {
        if let Some(handle) = self.timers.remove(&id.0) {
            self.ctx.cancel_future(handle);
        }
    }

    fn spawn(&mut self, behavior: Box<dyn Behavior<M>>) -> Addr {
        self.core.spawn(None, behavior)
    }

    fn start_worker(&mut self, spec: WorkerSpec<M>) -> WorkerId {
        self.core.start_worker(self.me, spec)
    }

    fn submit(&mut self, worker: WorkerId, job: Job<M>) -> Result<(), SendError> {
        self.core.submit(worker, job)
    }

    fn stop_worker(&mut self, worker: WorkerId) {
        self.core.stop_worker(worker);
    }

    fn stop(&mut self) {
        self.stop = true;
    }
}

/// Messages for an address that is not an actor: an HTTP handler, a test. Dropping it
/// unregisters the address, so later sends to it fail with `NoSuchActor`.
pub struct Mailbox<M: Message> {
    addr: Addr,
    rx: tokio::sync::mpsc::UnboundedReceiver<M>,
    core: Weak<HostCore<M>>,
}

impl<M: Message> Mailbox<M> {
    pub fn addr(&self) -> Addr {
        self.addr
    }

    pub async fn recv(&mut self) -> Option<M> {
        self.rx.recv().await
    }

    /// Waits at most `timeout` for the next message.
    pub fn recv_blocking(&mut self, timeout: Duration) -> Option<M> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.rx.try_recv() {
                Ok(m) => return Some(m),
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => return None,
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) if Instant::now() >= deadline => return None,
                Err(_) => thread::sleep(Duration::from_millis(1)),
            }
        }
    }
}

impl<M: Message> Drop for Mailbox<M> {
    fn drop(&mut self) {
        if let Some(core) = self.core.upgrade() {
            core.unregister(self.addr.actor);
        }
    }
}

/// A running host: its actor thread and everything on it.
pub struct Host<M: Message> {
    core: Arc<HostCore<M>>,
    system: actix::System,
    thread: Option<thread::JoinHandle<()>>,
}

impl<M: Message> Host<M> {
    /// Starts the actor thread of host `host`.
    pub fn start(host: HostId) -> std::io::Result<Host<M>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = thread::Builder::new().name(format!("tessera-actors-{}", host.0)).spawn(move || {
            let system = actix::System::new();
            // The receiver waits right below; if it is gone there is nobody to serve.
            let _ = tx.send((actix::System::current(), actix::Arbiter::current()));
            system.run().ok();
        })?;
        let (system, arbiter) = rx.recv().map_err(|_| std::io::Error::other("the actor thread did not start"))?;
        let core = Arc::new(HostCore {
            host,
            epoch: Instant::now(),
            next_actor: AtomicU64::new(FIRST_DYNAMIC_ACTOR),
            next_worker: AtomicU64::new(1),
            next_timer: AtomicU64::new(1),
            local: RwLock::new(HashMap::new()),
            topics: RwLock::new(HashMap::new()),
            workers: Mutex::new(HashMap::new()),
            bus: OnceLock::new(),
            arbiter,
        });
        Ok(Host { core, system, thread: Some(thread) })
    }

    pub fn id(&self) -> HostId {
        self.core.host
    }

    /// Connects this host to the others. Frames from the bus go to `inbound()`.
    pub fn attach_bus(&self, bus: Bus) {
        if self.core.bus.set(bus).is_err() {
            tracing::warn!("a bus is already attached to this host");
        }
    }

    /// The callback to give the bus: decodes frames and delivers them here.
    pub fn inbound(&self) -> InboundFn {
        let core = Arc::downgrade(&self.core);
        Arc::new(move |env: Envelope| {
            if let Some(core) = core.upgrade() {
                core.on_frame(env);
            }
        })
    }

    /// Starts `behavior` under a fresh address.
    pub fn spawn(&self, behavior: Box<dyn Behavior<M>>) -> Addr {
        self.core.spawn(None, behavior)
    }

    /// Starts `behavior` under a well-known id (below `FIRST_DYNAMIC_ACTOR`).
    pub fn spawn_at(&self, actor: u64, behavior: Box<dyn Behavior<M>>) -> Addr {
        debug_assert!(actor < FIRST_DYNAMIC_ACTOR && actor != OUTSIDE_ACTOR);
        self.core.spawn(Some(actor), behavior)
    }

    /// A fresh address whose messages arrive in the returned mailbox.
    pub fn mailbox(&self) -> Mailbox<M> {
        let actor = self.core.next_actor.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.core.local.write().insert(actor, Local::Mailbox(tx));
        Mailbox { addr: Addr::new(self.core.host, actor), rx, core: Arc::downgrade(&self.core) }
    }

    /// Sends from outside any actor.
    pub fn send(&self, to: Addr, msg: M) -> Result<(), SendError> {
        self.core.send(Addr::new(self.core.host, OUTSIDE_ACTOR), to, msg)
    }

    /// Sends from the given mailbox's address, so replies come back to it.
    pub fn send_from(&self, from: &Mailbox<M>, to: Addr, msg: M) -> Result<(), SendError> {
        self.core.send(from.addr, to, msg)
    }

    /// Subscribes a mailbox to a topic.
    pub fn subscribe(&self, mailbox: &Mailbox<M>, topic: &str) {
        self.core.subscribe(topic, mailbox.addr.actor);
    }

    pub fn now(&self) -> Moment {
        self.core.now()
    }

    /// Live actors and mailboxes on this host.
    pub fn actor_count(&self) -> usize {
        self.core.local.read().len()
    }

    /// Stops every actor and the actor thread. Workers finish their current job.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        for handle in self.core.workers.lock().drain().map(|(_, h)| h) {
            handle.stop.store(true, Ordering::Release);
        }
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.core.local.write().clear();
    }
}

impl<M: Message> Drop for Host<M> {
    fn drop(&mut self) {
        self.stop();
    }
}
