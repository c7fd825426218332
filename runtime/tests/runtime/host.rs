//! The real-time host: delivery, timers, spawning, topics, mailboxes and workers.

use serde::{Deserialize, Serialize};
use std::time::Duration;
use tessera_runtime::actor::{Behavior, Effects, Job, JobCtx, Message, SendError, WorkerSpec};
use tessera_runtime::host::Host;
use tessera_runtime::{Addr, HostId};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum T {
    Ping { n: u32, reply_to: Addr },
    Pong { n: u32 },
    Go,
    Fired { label: String },
    News { text: String },
    Computed { value: u64 },
    Ready,
    Panicked { why: String },
}

impl Message for T {
    fn kind(&self) -> &'static str {
        "t"
    }
}

const WAIT: Duration = Duration::from_secs(5);

/// Answers pings; stops after the third.
struct Ponger {
    seen: u32,
}

impl Behavior<T> for Ponger {
    fn name(&self) -> &'static str {
        "ponger"
    }
    fn handle(&mut self, msg: T, fx: &mut dyn Effects<T>) {
        if let T::Ping { n, reply_to } = msg {
            fx.send(reply_to, T::Pong { n }).unwrap();
            self.seen += 1;
            if self.seen == 3 {
                fx.stop();
            }
        }
    }
}

#[test]
fn messages_arrive_in_order_and_a_stopped_actor_is_unreachable() {
    let host = Host::<T>::start(HostId(0)).unwrap();
    let ponger = host.spawn(Box::new(Ponger { seen: 0 }));
    let mut mb = host.mailbox();
    for n in 0..3 {
        host.send(ponger, T::Ping { n, reply_to: mb.addr() }).unwrap();
    }
    for n in 0..3 {
        assert_eq!(mb.recv_blocking(WAIT), Some(T::Pong { n }));
    }
    // After its third ping the actor stopped: sends now fail instead of vanishing.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match host.send(ponger, T::Ping { n: 9, reply_to: mb.addr() }) {
            Err(SendError::NoSuchActor(a)) => {
                assert_eq!(a, ponger);
                break;
            }
            _ if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            other => panic!("the stopped actor still accepts messages: {other:?}"),
        }
    }
    let addr = mb.addr();
    drop(mb);
    assert_eq!(host.send(addr, T::Go), Err(SendError::NoSuchActor(addr)), "a dropped mailbox unregisters");
    host.shutdown();
}

/// Sets two timers, cancels one, spawns a child and publishes.
struct Timers {
    out: Addr,
}

impl Behavior<T> for Timers {
    fn name(&self) -> &'static str {
        "timers"
    }
    fn on_start(&mut self, fx: &mut dyn Effects<T>) {
        let start = fx.now();
        let cancelled = fx.timer(Duration::from_millis(10), T::Fired { label: "cancelled".into() });
        fx.timer(Duration::from_millis(30), T::Fired { label: "kept".into() });
        fx.cancel_timer(cancelled);
        assert!(fx.now() >= start);
    }
    fn handle(&mut self, msg: T, fx: &mut dyn Effects<T>) {
        if let T::Fired { label } = msg {
            fx.send(self.out, T::Fired { label }).unwrap();
            fx.publish("news", T::News { text: "timer fired".into() });
        }
    }
}

#[test]
fn timers_fire_once_unless_cancelled_and_topics_reach_subscribers() {
    let host = Host::<T>::start(HostId(3)).unwrap();
    let mut out = host.mailbox();
    let mut news = host.mailbox();
    host.subscribe(&news, "news");
    host.spawn(Box::new(Timers { out: out.addr() }));
    assert_eq!(out.recv_blocking(WAIT), Some(T::Fired { label: "kept".into() }));
    assert_eq!(news.recv_blocking(WAIT), Some(T::News { text: "timer fired".into() }));
    assert_eq!(out.recv_blocking(Duration::from_millis(100)), None, "the cancelled timer never fires");
    host.shutdown();
}

/// Owns a worker whose state is a counter; the third job panics.
struct Computer {
    out: Addr,
    worker: Option<tessera_runtime::actor::WorkerId>,
    jobs: u64,
}

impl Behavior<T> for Computer {
    fn name(&self) -> &'static str {
        "computer"
    }
    fn on_start(&mut self, fx: &mut dyn Effects<T>) {
        self.worker = Some(fx.start_worker(WorkerSpec {
            name: "test-worker".into(),
            init: Box::new(|| Ok((Box::new(100u64) as Box<dyn std::any::Any>, T::Ready))),
            on_panic: Box::new(|why| T::Panicked { why }),
        }));
    }
    fn handle(&mut self, msg: T, fx: &mut dyn Effects<T>) {
        match msg {
            T::Ready | T::Computed { .. } => {
                if let T::Computed { value } = msg {
                    fx.send(self.out, T::Computed { value }).unwrap();
                }
                self.jobs += 1;
                let n = self.jobs;
                let job = Job {
                    label: "add",
                    run: Box::new(move |state: &mut dyn std::any::Any, _: &mut dyn JobCtx<T>| {
                        let counter = state.downcast_mut::<u64>().expect("the worker's state is a u64");
                        assert!(n < 3, "job {n} fails on purpose");
                        *counter += n;
                        T::Computed { value: *counter }
                    }),
                };
                fx.submit(self.worker.unwrap(), job).unwrap();
            }
            T::Panicked { why } => {
                fx.send(self.out, T::Panicked { why }).unwrap();
                // The worker is gone: more jobs are refused.
                let refused = fx.submit(self.worker.unwrap(), Job { label: "late", run: Box::new(|_, _| T::Go) });
                assert!(refused.is_err());
            }
            _ => {}
        }
    }
}

#[test]
fn worker_jobs_keep_state_and_a_panic_comes_back_as_a_message() {
    let host = Host::<T>::start(HostId(1)).unwrap();
    let mut out = host.mailbox();
    host.spawn(Box::new(Computer { out: out.addr(), worker: None, jobs: 0 }));
    assert_eq!(out.recv_blocking(WAIT), Some(T::Computed { value: 101 }));
    assert_eq!(out.recv_blocking(WAIT), Some(T::Computed { value: 103 }));
    match out.recv_blocking(WAIT) {
        Some(T::Panicked { why }) => assert!(why.contains("job 3 fails on purpose"), "{why}"),
        other => panic!("expected the panic report, got {other:?}"),
    }
    host.shutdown();
}

#[test]
fn a_message_for_another_host_without_a_bus_is_unreachable() {
    let host = Host::<T>::start(HostId(0)).unwrap();
    let elsewhere = Addr::new(HostId(7), 16);
    assert_eq!(host.send(elsewhere, T::Go), Err(SendError::Unreachable(HostId(7))));
    host.shutdown();
}

/// A job that declares model time: its notification and its result are held back until
/// their model times have passed (the real host's pacing), never delivered early.
struct Paced {
    out: Addr,
}

impl Behavior<T> for Paced {
    fn name(&self) -> &'static str {
        "paced"
    }
    fn on_start(&mut self, fx: &mut dyn Effects<T>) {
        let worker = fx.start_worker(WorkerSpec {
            name: "paced-worker".into(),
            init: Box::new(|| Ok((Box::new(()) as Box<dyn std::any::Any>, T::Ready))),
            on_panic: Box::new(|why| T::Panicked { why }),
        });
        let job = Job {
            label: "paced",
            run: Box::new(|_: &mut dyn std::any::Any, ctx: &mut dyn JobCtx<T>| {
                ctx.notify_at(Duration::from_millis(60), T::News { text: "layer".into() });
                ctx.elapse(Duration::from_millis(150));
                T::Computed { value: 1 }
            }),
        };
        fx.submit(worker, job).unwrap();
    }
    fn handle(&mut self, msg: T, fx: &mut dyn Effects<T>) {
        if msg != T::Ready {
            fx.send(self.out, msg).unwrap();
        }
    }
}

#[test]
fn a_job_s_declared_model_time_is_waited_out_by_the_host() {
    let host = Host::<T>::start(HostId(2)).unwrap();
    let mut out = host.mailbox();
    let started = std::time::Instant::now();
    host.spawn(Box::new(Paced { out: out.addr() }));
    assert_eq!(out.recv_blocking(WAIT), Some(T::News { text: "layer".into() }));
    assert!(started.elapsed() >= Duration::from_millis(60), "the notification came before its model time");
    assert_eq!(out.recv_blocking(WAIT), Some(T::Computed { value: 1 }));
    assert!(started.elapsed() >= Duration::from_millis(150), "the result came before its model time");
    host.shutdown();
}
