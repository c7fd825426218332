//! What a chip's worker thread runs, as the chip behavior sees it: a `StepExecutor` that
//! runs step plans and KV installs, built on the worker by an `ExecutorFactory`. The real
//! one (a model on a device, with KV staging over the transfer engine) is an adapter,
//! `tessera-chip-executor`; tests and the simulator substitute their own.

use crate::batcher::StepPlan;
use crate::msg::{ChipInfo, KvFormatDesc, KvRegionDesc, Msg, StepOutcome};
use std::ops::Range;
use std::sync::Arc;
use tessera_actor_core::JobCtx;

/// Runs step plans and KV installs. Lives on a worker thread.
pub trait StepExecutor {
    /// Runs one step. Through `ctx` it declares the step's model time (emulated and
    /// simulated chips) and posts `KvStaged` part-way through it, stamped at model time:
    /// one per group of [`stage_groups`], when the group's last layer is staged.
    fn step(&mut self, step: u64, plan: &StepPlan, ctx: &mut dyn JobCtx<Msg>) -> StepOutcome;

    /// Reads KV another chip staged and writes it into this chip's cache. Through `ctx`
    /// a simulated chip declares the transfer's model time (the link model's); a real
    /// one takes as long as the read does.
    fn install(&mut self, job: &KvInstall, ctx: &mut dyn JobCtx<Msg>) -> Result<(), String>;
}

/// The groups of layers in which a prefill chip announces the KV it staged during a
/// step: one `KvStaged`, and so one `KvReady` and one install job on the decode chip,
/// per group. They halve: the first half of the layers, half of the rest, and so on down
/// to the last layer alone. A step's hand-off then takes about log2(L) + 1 messages
/// instead of L (6 for 32 layers, 7 for 80), while what the decode chip still has to read
/// once the prefill's last layer is done stays one layer, as with a message per layer.
pub fn stage_groups(num_layers: usize) -> impl Iterator<Item = Range<usize>> {
    let mut start = 0;
    std::iter::from_fn(move || {
        let rest = num_layers.checked_sub(start).filter(|&rest| rest > 0)?;
        let group = start..start + (rest / 2).max(1);
        start = group.end;
        Some(group)
    })
}

/// Some layers' positions of one sequence, from a prefill chip's staging region into
/// this chip's cache.
#[derive(Debug, Clone)]
pub struct KvInstall {
    pub layers: Range<usize>,
    pub positions: Range<usize>,
    pub region: Arc<KvRegionDesc>,
    /// How the prefill chip stores its blocks.
    pub format: Arc<KvFormatDesc>,
    /// The prefill chip's block table (shared by the hand-off's messages and jobs);
    /// [`KvInstall::src_blocks`] is this job's part.
    pub src_table: Arc<[u32]>,
    pub src_range: Range<usize>,
    /// The position the first of `src_blocks` starts at.
    pub first_pos: usize,
    /// This chip's cache slot for every position of the hand-off (shared by all its
    /// jobs); [`KvInstall::dst_slots`] is this job's part.
    pub slots: Arc<[i32]>,
    /// P's grant to read those blocks over tcp (a secured cluster's).
    pub capability: Option<crate::msg::KvCapability>,
}

impl KvInstall {
    /// The prefill chip's blocks holding `positions`, in order.
    pub fn src_blocks(&self) -> &[u32] {
        self.src_table.get(self.src_range.clone()).unwrap_or_default()
    }

    /// This chip's cache slot for each of `positions`; empty if the slots do not
    /// cover them.
    pub fn dst_slots(&self) -> &[i32] {
        self.slots.get(self.positions.clone()).unwrap_or_default()
    }
}

/// Builds a chip's executor on its worker thread.
pub type ExecutorFactory = std::sync::Arc<dyn Fn() -> Result<(Box<dyn StepExecutor>, ChipInfo), String> + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::stage_groups;

    #[test]
    fn stage_groups_halve_down_to_the_last_layer_alone() {
        let groups = |n| stage_groups(n).map(|g| (g.start, g.end)).collect::<Vec<_>>();
        assert_eq!(groups(32), vec![(0, 16), (16, 24), (24, 28), (28, 30), (30, 31), (31, 32)]);
        assert_eq!(groups(30), vec![(0, 15), (15, 22), (22, 26), (26, 28), (28, 29), (29, 30)]);
        assert_eq!(groups(3), vec![(0, 1), (1, 2), (2, 3)]);
        assert_eq!(groups(1), vec![(0, 1)]);
        assert!(groups(0).is_empty());
        for n in 1..200 {
            let g = groups(n);
            assert!(g.windows(2).all(|w| w[0].1 == w[1].0 && w[0].1 - w[0].0 >= w[1].1 - w[1].0), "{n}: {g:?}");
            assert_eq!((g[0].0, g[g.len() - 1]), (0, (n - 1, n)), "{n}");
            assert!(g.len() <= n.ilog2() as usize + 2, "{n}: {} groups", g.len());
        }
    }
}
