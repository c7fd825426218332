//! The actor contract every Tessera behavior is written against — `Behavior`,
//! `Effects`, `Addr`, `Moment`, `Message`, workers and jobs that declare model time —
//! and a testkit: a recording `Effects` for unit tests and a deterministic virtual-time
//! host that runs many behaviors on one event queue.
//!
//! It must not depend on actix, ZeroMQ, tokio or any I/O: `actors` builds against it
//! alone, and the simulator runs the same behaviors on its virtual clock.
#![forbid(unsafe_code)]

pub mod actor;
pub mod addr;
pub mod testkit;

pub use actor::{Behavior, Effects, Job, JobCtx, Message, Moment, SendError, TimerId, WorkerId, WorkerSpec};
pub use addr::{Addr, FIRST_DYNAMIC_ACTOR, HostId};
