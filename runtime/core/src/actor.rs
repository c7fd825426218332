//! The sans-IO actor model. A behavior is a plain state machine: it reacts to one
//! message at a time and acts on the world only through [`Effects`], so the same code
//! runs on the real-time host (`tessera-runtime`) and on a virtual-time host (the
//! [`testkit`](crate::testkit), the simulator). A behavior never reads the wall clock,
//! spawns threads, sleeps or does I/O itself.
//!
//! Model time is an effect: a compute [`Job`] tells its host, through its [`JobCtx`],
//! how much model time it took and when its mid-job notifications are due. The real
//! host waits until then (that is all an emulated chip's pacing is); the virtual host
//! moves its clock instead.

use crate::addr::{Addr, HostId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::any::Any;
use std::fmt;
use std::time::Duration;

/// A point in a host's time: nanoseconds since the host started (wall clock on the
/// real-time host, virtual in a simulation). Only comparable within one host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Moment(pub u64);

impl Moment {
    /// Time from `earlier` to `self`; zero if `earlier` is later.
    pub fn since(self, earlier: Moment) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    pub fn after(self, d: Duration) -> Moment {
        Moment(self.0.saturating_add(d.as_nanos().min(u64::MAX as u128) as u64))
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 * 1e-9
    }
}

/// The one message type of an actor system: every behavior of a cluster speaks it, so
/// any actor can reach any other across hosts. `kind` names the variant on the wire.
pub trait Message: Serialize + DeserializeOwned + Clone + Send + fmt::Debug + 'static {
    fn kind(&self) -> &'static str;
}

/// An actor's logic.
pub trait Behavior<M: Message>: Send + 'static {
    /// Called once, before the first message.
    fn on_start(&mut self, _fx: &mut dyn Effects<M>) {}

    fn handle(&mut self, msg: M, fx: &mut dyn Effects<M>);

    /// A short name for logs.
    fn name(&self) -> &'static str;
}

/// Why a message could not be handed over. Delivery is asynchronous: `Ok` means the
/// message was queued, not that it was handled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The bus queue towards that host is full: back off or go elsewhere.
    #[error("the bus queue to {0} is full")]
    Full(HostId),
    /// No route to that host (unknown, or its connection is gone).
    #[error("{0} is unreachable")]
    Unreachable(HostId),
    /// The address names no live actor on this host.
    #[error("no actor at {0}")]
    NoSuchActor(Addr),
    /// The message could not be encoded for the bus.
    #[error("cannot encode the message: {0}")]
    Encode(String),
}

/// A compute worker: one OS thread that owns state a behavior must not hold (a device,
/// its model, its KV cache) and runs jobs on it, one at a time, in submission order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u64);

/// State owned by a worker thread; jobs downcast it to what they expect.
pub type WorkerState = Box<dyn Any>;

/// Runs on a new worker thread: the worker's state and the message that tells the owner
/// it is ready, or the message reporting failure.
pub type WorkerInit<M> = Box<dyn FnOnce() -> Result<(WorkerState, M), M> + Send>;

/// How to start a worker.
pub struct WorkerSpec<M> {
    pub name: String,
    pub init: WorkerInit<M>,
    /// The message the owner gets if a job panics. The worker then stops: its state may
    /// be half-updated, so only a fresh start is safe.
    pub on_panic: Box<dyn Fn(String) -> M + Send>,
}

/// A job's body: gets the worker's state and its context, returns the result message.
pub type JobFn<M> = Box<dyn FnOnce(&mut dyn Any, &mut dyn JobCtx<M>) -> M + Send>;

/// What a running job tells its host besides its result. Offsets are model time since
/// the job started.
pub trait JobCtx<M> {
    /// The job takes `d` of model time (an emulated or simulated chip's step). The
    /// real host delivers the result no earlier than `d` after the job started; the
    /// virtual host delivers it exactly then. A job that never calls this took what the
    /// real host measured, and no time on the virtual host.
    fn elapse(&mut self, d: Duration);

    /// Posts `msg` to the job's owner `at` after the job started (e.g. "layer 3 of this
    /// step is staged"). The real host blocks the job until then; the virtual host
    /// stamps it then.
    fn notify_at(&mut self, at: Duration, msg: M);
}

/// A unit of compute: runs on the worker's thread, its result comes back as a message
/// to the actor that submitted it.
pub struct Job<M> {
    pub label: &'static str,
    pub run: JobFn<M>,
}

/// An identifier for a pending timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerId(pub u64);

/// Everything a behavior may do to the world.
pub trait Effects<M: Message> {
    /// This actor's address.
    fn me(&self) -> Addr;

    /// The host's clock.
    fn now(&self) -> Moment;

    /// Queues `msg` for `to` (on this host or another).
    fn send(&mut self, to: Addr, msg: M) -> Result<(), SendError>;

    /// Broadcasts `msg` to every subscriber of `topic` on every host, best effort.
    fn publish(&mut self, topic: &str, msg: M);

    /// Delivers this host's and other hosts' publications on `topic` to this actor.
    fn subscribe(&mut self, topic: &str);

    /// Delivers `msg` to this actor after `after`.
    fn timer(&mut self, after: Duration, msg: M) -> TimerId;

    fn cancel_timer(&mut self, id: TimerId);

    /// Starts another actor on this host.
    fn spawn(&mut self, behavior: Box<dyn Behavior<M>>) -> Addr;

    /// Starts a worker owned by this actor; its ready (or failure) message follows.
    fn start_worker(&mut self, spec: WorkerSpec<M>) -> WorkerId;

    /// Queues a job on a worker. Fails if the worker has stopped.
    fn submit(&mut self, worker: WorkerId, job: Job<M>) -> Result<(), SendError>;

    /// Stops a worker after its current job; queued jobs are dropped.
    fn stop_worker(&mut self, worker: WorkerId);

    /// Stops this actor after the current message.
    fn stop(&mut self);
}
