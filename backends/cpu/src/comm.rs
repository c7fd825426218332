//! The collectives of ABI 1.4: a communicator joins the tensor-parallel ranks of one
//! stage, each a device of this library driven by its own host thread, and
//! [`Comm::all_reduce_sum`] sums a buffer over them in place.
//!
//! Every device's memory is host memory, so the sum needs no staging copies: each rank
//! publishes its buffer, then rank `r` reduces part `r` of the values — reading that
//! part of every rank's buffer, adding in rank order, and writing the sum back into
//! every rank's buffer — and the ranks wait for each other once more. The parts are
//! disjoint, so no two ranks ever touch the same value; every value is added in rank
//! order, so the bits equal a host sum `r0 + r1 + ...` however the work is split. It is
//! a reduce-scatter and an all-gather done in one pass over shared memory.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{KernelError, Result};
use crate::invalid;

/// One group of ranks.
pub struct Comm {
    ranks: usize,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// Each rank's buffer (address of `count` f32) in the current call.
    bufs: Vec<(usize, usize)>,
    /// Ranks arrived at the current phase.
    arrived: usize,
    /// Phases completed (each call is two: publish, then done).
    phase: u64,
    aborted: Option<String>,
}

/// Part `rank` of `n` values over `parts`: balanced, contiguous.
fn part(n: usize, parts: usize, rank: usize) -> std::ops::Range<usize> {
    rank * n / parts..(rank + 1) * n / parts
}

impl Comm {
    pub fn new(ranks: usize) -> Result<Comm> {
        if ranks == 0 {
            return Err(invalid!("a communicator needs at least one rank"));
        }
        let state = State { bufs: vec![(0, 0); ranks], arrived: 0, phase: 0, aborted: None };
        Ok(Comm { ranks, state: Mutex::new(state), changed: Condvar::new() })
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails every waiting and later call with `why` (the first reason is kept).
    pub fn abort(&self, why: &str) {
        let mut s = self.lock();
        s.aborted.get_or_insert_with(|| why.to_string());
        self.changed.notify_all();
    }

    fn aborted(why: &str) -> KernelError {
        KernelError::Internal(format!("the communicator was aborted: {why}"))
    }

    /// Waits until every rank has arrived at this phase, or the group is aborted, or
    /// `deadline` passes (which aborts the group).
    fn barrier<'a>(
        &'a self,
        mut s: MutexGuard<'a, State>,
        rank: usize,
        deadline: Instant,
    ) -> Result<MutexGuard<'a, State>> {
        if let Some(why) = &s.aborted {
            return Err(Self::aborted(why));
        }
        let phase = s.phase;
        s.arrived += 1;
        if s.arrived == self.ranks {
            s.arrived = 0;
            s.phase += 1;
            self.changed.notify_all();
            return Ok(s);
        }
        loop {
            if let Some(why) = &s.aborted {
                return Err(Self::aborted(why));
            }
            if s.phase != phase {
                return Ok(s);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = format!("rank {rank} waited longer than its timeout for the others");
                s.aborted.get_or_insert_with(|| why.clone());
                self.changed.notify_all();
                return Err(Self::aborted(&why));
            }
            s = self.changed.wait_timeout(s, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Rank `rank`'s part of summing `count` f32 at `addr` over every rank.
    ///
    /// # Safety
    /// `addr` must be valid for reads and writes of `count` aligned f32 until the call
    /// returns, and nothing else may access that memory meanwhile (the rank's own thread
    /// is inside this call; other ranks touch it only through this communicator).
    pub unsafe fn all_reduce_sum(&self, rank: usize, addr: usize, count: usize, timeout: Duration) -> Result<()> {
        if rank >= self.ranks {
            return Err(invalid!("rank {rank} is not in a communicator of {} ranks", self.ranks));
        }
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        s.bufs[rank] = (addr, count);
        s = self.barrier(s, rank, deadline)?;
        if s.bufs.iter().any(|&(_, c)| c != count) {
            let counts: Vec<usize> = s.bufs.iter().map(|&(_, c)| c).collect();
            let why = format!("the ranks sum different counts {counts:?}");
            s.aborted.get_or_insert_with(|| why.clone());
            self.changed.notify_all();
            return Err(invalid!("tk_all_reduce_sum_f32 of {count} values: {why}"));
        }
        let bufs: Vec<usize> = s.bufs.iter().map(|&(a, _)| a).collect();
        drop(s);

        let mine = part(count, self.ranks, rank);
        if !mine.is_empty() {
            let len = mine.len();
            let at = |a: usize| (a as *mut f32).wrapping_add(mine.start);
            // SAFETY: every rank's buffer holds `count` f32 (its owner passed the same
            // count, checked above) and stays valid until its owner returns, which is
            // after the barrier below; this rank alone touches the values in `mine`
            // of every buffer, so these slices alias nothing anyone else uses.
            let mut sum: Vec<f32> = unsafe { std::slice::from_raw_parts(at(bufs[0]), len) }.to_vec();
            for &b in &bufs[1..] {
                // SAFETY: as above.
                let other = unsafe { std::slice::from_raw_parts(at(b), len) };
                for (s, x) in sum.iter_mut().zip(other) {
                    *s += x;
                }
            }
            for &b in &bufs {
                // SAFETY: as above; the read slices of this buffer are no longer used.
                unsafe { std::slice::from_raw_parts_mut(at(b), len) }.copy_from_slice(&sum);
            }
        }

        // No rank returns (and so reuses its buffer) before every part is written.
        let s = self.lock();
        self.barrier(s, rank, deadline).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Sums `inputs` (one vector per rank) through a communicator, one thread per rank.
    fn reduce(comm: &Arc<Comm>, inputs: Vec<Vec<f32>>) -> Vec<Result<Vec<f32>>> {
        let threads: Vec<_> = inputs
            .into_iter()
            .enumerate()
            .map(|(rank, mut v)| {
                let comm = comm.clone();
                std::thread::spawn(move || {
                    // SAFETY: `v` lives on this thread until the call returns.
                    unsafe { comm.all_reduce_sum(rank, v.as_mut_ptr() as usize, v.len(), Duration::from_secs(5)) }
                        .map(|()| v)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_ends_with_the_rank_order_sum() {
        for (ranks, n) in [(1, 5), (2, 7), (3, 1), (3, 1000), (4, 3)] {
            let comm = Arc::new(Comm::new(ranks).unwrap());
            let inputs: Vec<Vec<f32>> =
                (0..ranks).map(|r| (0..n).map(|i| ((i * 7 + r * 13) % 17) as f32 * 0.1 - 0.7).collect()).collect();
            let mut want = inputs[0].clone();
            for v in &inputs[1..] {
                for (w, x) in want.iter_mut().zip(v) {
                    *w += x;
                }
            }
            for _ in 0..3 {
                for got in reduce(&comm, inputs.clone()) {
                    let got = got.unwrap();
                    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{ranks} x {n}");
                }
            }
        }
    }

    #[test]
    fn mismatched_counts_fail_every_rank_and_an_abort_ends_waits() {
        let comm = Arc::new(Comm::new(2).unwrap());
        let got = reduce(&comm, vec![vec![1.0; 4], vec![1.0; 3]]);
        assert!(got.iter().all(|r| r.as_ref().unwrap_err().to_string().contains("different counts [4, 3]")), "{got:?}");

        let comm = Arc::new(Comm::new(2).unwrap());
        let waiter = {
            let comm = comm.clone();
            std::thread::spawn(move || {
                let mut v = vec![1.0f32; 4];
                // SAFETY: `v` lives on this thread until the call returns.
                unsafe { comm.all_reduce_sum(0, v.as_mut_ptr() as usize, 4, Duration::from_secs(30)) }
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        comm.abort("rank 1 died");
        let e = waiter.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("aborted: rank 1 died"), "{e}");
    }

    #[test]
    fn a_rank_left_alone_times_out_and_aborts_the_group() {
        let comm = Comm::new(2).unwrap();
        let mut v = vec![1.0f32; 2];
        // SAFETY: `v` outlives the call.
        let e = unsafe { comm.all_reduce_sum(1, v.as_mut_ptr() as usize, 2, Duration::from_millis(30)) }.unwrap_err();
        assert!(e.to_string().contains("rank 1 waited longer"), "{e}");
        // SAFETY: as above.
        let e = unsafe { comm.all_reduce_sum(0, v.as_mut_ptr() as usize, 2, Duration::from_secs(1)) }.unwrap_err();
        assert!(e.to_string().contains("aborted"), "{e}");
    }
}
