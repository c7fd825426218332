//! Model parallelism on the data plane: which part of a model one chip holds (a
//! [`Shard`]: a pipeline stage's contiguous layers and, within the stage, one
//! tensor-parallel rank's attention heads and FFN columns) and the all-reduce that joins
//! the ranks of a stage ([`AllReduce`]: [`LibraryGroup`], the kernel library's own
//! collectives where it has them (ABI 1.4), else [`LocalGroup`], Tessera's host sum).
//!
//! Tensor parallelism splits Q/K/V and gate/up by rows (each rank its heads and FFN
//! columns) and O/down by columns, so each rank's O and down produce a partial sum of
//! the hidden state; the all-reduce adds the partials in rank order, which every rank
//! then holds identically. Splits are uneven where the counts do not divide (9 heads over
//! 2 ranks), and land on the weights' block boundaries (a Q4_1 row splits every 32
//! values), so a rank's blocks are byte-for-byte the whole model's.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::config::ModelConfig;
use crate::device::{Communicator, Device, View};
use crate::error::{BackendError, Result};
use crate::loader::KernelLibrary;

/// The part of a model one chip holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The pipeline stage's layers (a contiguous range of the model's).
    pub layers: Range<usize>,
    /// This chip's rank among the stage's tensor-parallel chips, `0..tp_size`.
    pub tp_rank: usize,
    pub tp_size: usize,
}

impl Shard {
    /// The whole model on one chip.
    pub fn whole(config: &ModelConfig) -> Shard {
        Shard { layers: 0..config.num_layers, tp_rank: 0, tp_size: 1 }
    }

    /// Whether this shard holds the model's first layer (and so embeds tokens).
    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    /// Whether this shard holds the model's last layer (and so ends the forward pass).
    pub fn is_last(&self, config: &ModelConfig) -> bool {
        self.layers.end == config.num_layers
    }

    /// Whether this shard computes logits: the last stage's rank 0.
    pub fn computes_logits(&self, config: &ModelConfig) -> bool {
        self.is_last(config) && self.tp_rank == 0
    }

    /// Checks the shard against `config`: a non-empty layer range inside the model, a
    /// rank inside its group, at least one KV head per rank.
    pub fn check(&self, config: &ModelConfig) -> Result<()> {
        let bad = |what: String| Err(BackendError::Shard(what));
        if self.layers.is_empty() || self.layers.end > config.num_layers {
            return bad(format!("layers {:?} are not a stage of a {}-layer model", self.layers, config.num_layers));
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return bad(format!("rank {} is not in a tensor-parallel group of {}", self.tp_rank, self.tp_size));
        }
        if self.tp_size > config.num_kv_heads {
            return bad(format!(
                "tensor parallelism of {} needs at least as many KV heads ({} here): every rank holds one or more",
                self.tp_size, config.num_kv_heads
            ));
        }
        Ok(())
    }

    /// This rank's heads: its KV heads and the query heads that share them.
    pub fn heads(&self, config: &ModelConfig) -> ShardHeads {
        let kv = split(config.num_kv_heads, self.tp_size, self.tp_rank);
        let group = config.num_heads / config.num_kv_heads.max(1);
        ShardHeads { q: kv.start * group..kv.end * group, kv }
    }

    /// This rank's FFN columns, split in units of `unit` values (the down projection's
    /// block size) so that every rank's part of a row is whole blocks.
    pub fn ffn(&self, config: &ModelConfig, unit: usize) -> Result<Range<usize>> {
        let inter = config.intermediate_size;
        if self.tp_size == 1 {
            return Ok(0..inter);
        }
        let unit = unit.max(1);
        if !inter.is_multiple_of(unit) || inter / unit < self.tp_size {
            return Err(BackendError::Shard(format!(
                "the FFN's {inter} columns do not split over {} ranks in whole blocks of {unit}",
                self.tp_size
            )));
        }
        let units = split(inter / unit, self.tp_size, self.tp_rank);
        Ok(units.start * unit..units.end * unit)
    }
}

/// A rank's query and KV heads (ranges of head indices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardHeads {
    pub q: Range<usize>,
    pub kv: Range<usize>,
}

/// Part `rank` of `n` items over `parts`: balanced, the larger parts last.
pub fn split(n: usize, parts: usize, rank: usize) -> Range<usize> {
    let parts = parts.max(1);
    rank * n / parts..(rank + 1) * n / parts
}

/// A stage's layer ranges for `counts` layers each, in order.
pub fn stage_ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect()
}

/// Sums a buffer over the ranks of a tensor-parallel group.
pub trait AllReduce {
    /// Replaces the `len` f32 values at `buf` on `device` with their sum over every rank
    /// of the group, added in rank order, so every rank ends with the same bits.
    fn all_reduce(&mut self, device: &Device, buf: View<'_>, len: usize) -> Result<()>;

    /// Ends every wait of the group, now and later: a rank that failed calls it so the
    /// others stop waiting for it.
    fn abort(&self, why: &str);
}

/// Which all-reduce joins the ranks of a stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Collectives {
    /// The kernel library's own (ABI 1.4) where every rank's device is of one library
    /// that has them; Tessera's host all-reduce otherwise.
    #[default]
    Library,
    /// Tessera's host all-reduce ([`LocalGroup`]) always.
    Host,
}

/// The members of one group of `ranks` (rank order), and the name of the all-reduce
/// they use. `lib` is the library of every rank's device, where they share one.
pub fn group(
    lib: Option<&Arc<KernelLibrary>>,
    ranks: usize,
    choice: Collectives,
) -> Result<(Vec<Box<dyn AllReduce + Send>>, &'static str)> {
    match lib {
        Some(lib) if choice == Collectives::Library && lib.has_collectives() => {
            Ok((boxed(LibraryGroup::new(lib, ranks)?), "library"))
        }
        _ => Ok((boxed(LocalGroup::new(ranks)), "host")),
    }
}

/// A group's members as trait objects.
pub fn boxed<G: AllReduce + Send + 'static>(members: Vec<G>) -> Vec<Box<dyn AllReduce + Send>> {
    members.into_iter().map(|g| Box::new(g) as Box<dyn AllReduce + Send>).collect()
}

/// The all-reduce of a kernel library's collectives (ABI 1.4's
/// `tk_all_reduce_sum_f32`): the library sums the ranks' buffers where they are, in
/// rank order, so the bits equal [`LocalGroup`]'s.
pub struct LibraryGroup {
    comm: Arc<Communicator>,
    /// Why a rank aborted the group: the ABI's abort carries no reason, so the ranks
    /// whose wait it ends report this one.
    aborted: Arc<Mutex<Option<String>>>,
    rank: usize,
}

impl LibraryGroup {
    /// The `ranks` members of one group, rank order.
    pub fn new(lib: &Arc<KernelLibrary>, ranks: usize) -> Result<Vec<LibraryGroup>> {
        let comm = Arc::new(Communicator::new(lib, ranks)?);
        let aborted = Arc::new(Mutex::new(None));
        Ok((0..ranks).map(|rank| LibraryGroup { comm: comm.clone(), aborted: aborted.clone(), rank }).collect())
    }
}

impl AllReduce for LibraryGroup {
    fn all_reduce(&mut self, device: &Device, buf: View<'_>, len: usize) -> Result<()> {
        device.all_reduce_sum(&self.comm, self.rank, buf, len, ALL_REDUCE_TIMEOUT).map_err(|e| {
            match self.aborted.lock().unwrap_or_else(|p| p.into_inner()).as_deref() {
                Some(why) => BackendError::Shard(format!("all-reduce aborted: {why}")),
                None => e,
            }
        })
    }

    fn abort(&self, why: &str) {
        self.aborted.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(|| why.to_string());
        self.comm.abort();
    }
}

/// How long a rank waits for the others at an all-reduce before the step fails: a rank
/// that died must not stall the stage forever.
pub const ALL_REDUCE_TIMEOUT: Duration = Duration::from_secs(30);

/// The all-reduce of ranks in one process (one thread per rank): each rank's partial
/// goes to a shared slot, and each rank adds the slots in rank order. A rank that
/// fails calls [`LocalGroup::abort`], so the others' waits end with an error.
pub struct LocalGroup {
    shared: Arc<GroupState>,
    rank: usize,
    sum: Vec<f32>,
}

struct GroupState {
    ranks: usize,
    inner: Mutex<GroupInner>,
    changed: Condvar,
}

struct GroupInner {
    slots: Vec<Vec<f32>>,
    /// Ranks arrived at the current phase.
    arrived: usize,
    /// Phases completed (each all-reduce is two: gather, then release).
    phase: u64,
    aborted: Option<String>,
}

impl LocalGroup {
    /// The `ranks` members of one group, rank order.
    pub fn new(ranks: usize) -> Vec<LocalGroup> {
        let shared = Arc::new(GroupState {
            ranks,
            inner: Mutex::new(GroupInner { slots: vec![Vec::new(); ranks], arrived: 0, phase: 0, aborted: None }),
            changed: Condvar::new(),
        });
        (0..ranks).map(|rank| LocalGroup { shared: shared.clone(), rank, sum: Vec::new() }).collect()
    }

    /// Waits until every rank has arrived at this phase.
    fn barrier<'a>(
        &self,
        shared: &'a GroupState,
        mut g: MutexGuard<'a, GroupInner>,
    ) -> Result<MutexGuard<'a, GroupInner>> {
        let phase = g.phase;
        g.arrived += 1;
        if g.arrived == shared.ranks {
            g.arrived = 0;
            g.phase += 1;
            shared.changed.notify_all();
            return Ok(g);
        }
        loop {
            if let Some(why) = &g.aborted {
                return Err(BackendError::Shard(format!("all-reduce aborted: {why}")));
            }
            if g.phase != phase {
                return Ok(g);
            }
            let (guard, wait) = shared.changed.wait_timeout(g, ALL_REDUCE_TIMEOUT).unwrap_or_else(|p| p.into_inner());
            g = guard;
            if wait.timed_out() && g.phase == phase {
                let why = format!("rank {} waited {ALL_REDUCE_TIMEOUT:?} for the others", self.rank);
                g.aborted.get_or_insert(why);
                shared.changed.notify_all();
            }
        }
    }
}

impl AllReduce for LocalGroup {
    fn all_reduce(&mut self, device: &Device, buf: View<'_>, len: usize) -> Result<()> {
        let part: Vec<f32> = device.read_vec(buf, len)?;
        let shared = self.shared.clone();
        let mut g = shared.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.slots[self.rank] = part;
        g = self.barrier(&shared, g)?;
        if g.slots.iter().any(|s| s.len() != len) {
            let lens: Vec<usize> = g.slots.iter().map(Vec::len).collect();
            g.aborted.get_or_insert_with(|| format!("the ranks reduce different lengths {lens:?}"));
            self.shared.changed.notify_all();
            return Err(BackendError::Shard(format!("all-reduce of {len} values: the ranks sent {lens:?}")));
        }
        let mut sum = std::mem::take(&mut self.sum);
        sum.clear();
        sum.extend_from_slice(&g.slots[0]);
        for slot in &g.slots[1..] {
            for (s, x) in sum.iter_mut().zip(slot) {
                *s += x;
            }
        }
        // No rank refills its slot before every rank has added them all.
        let released = self.barrier(&shared, g).map(drop);
        let written = released.and_then(|()| device.write(buf, &sum));
        self.sum = sum;
        written
    }

    fn abort(&self, why: &str) {
        let mut g = self.shared.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.aborted.get_or_insert_with(|| why.to_string());
        self.shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    // One part is a table row like the others: the whole range in a one-element list.
    #[allow(clippy::single_range_in_vec_init)]
    fn splits_are_balanced_contiguous_and_cover_everything() {
        let table: [(usize, usize, &[Range<usize>]); 4] =
            [(9, 2, &[0..4, 4..9]), (3, 2, &[0..1, 1..3]), (8, 4, &[0..2, 2..4, 4..6, 6..8]), (4, 1, &[0..4])];
        for (n, parts, want) in table {
            let got: Vec<_> = (0..parts).map(|r| split(n, parts, r)).collect();
            assert_eq!(got, want, "{n} over {parts}");
        }
        assert_eq!(stage_ranges(&[1, 3, 2]), vec![0..1, 1..4, 4..6]);
    }

    #[test]
    fn ffn_splits_land_on_block_boundaries_or_are_refused() {
        let json = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 352,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}"#;
        let c = ModelConfig::from_json(json, std::path::Path::new("config.json")).unwrap();
        let shard = |rank| Shard { layers: 0..1, tp_rank: rank, tp_size: 2 };
        assert_eq!(shard(0).ffn(&c, 1).unwrap(), 0..176);
        assert_eq!(shard(1).ffn(&c, 32).unwrap(), 160..352, "11 blocks of 32: 5 and 6");
        let e = shard(0).ffn(&c, 256).unwrap_err().to_string();
        assert!(e.contains("352 columns do not split over 2 ranks in whole blocks of 256"), "{e}");
    }
}
