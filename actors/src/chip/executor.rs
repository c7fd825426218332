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
    /// simulated chips) and posts `KvStaged` part-way through it, stamped at model time.
    fn step(&mut self, step: u64, plan: &StepPlan, ctx: &mut dyn JobCtx<Msg>) -> StepOutcome;

    /// Reads KV another chip staged and writes it into this chip's cache. Through `ctx`
    /// a simulated chip declares the transfer's model time (the link model's); a real
    /// one takes as long as the read does.
    fn install(&mut self, job: &KvInstall, ctx: &mut dyn JobCtx<Msg>) -> Result<(), String>;
}

/// One layer's positions of one sequence, from a prefill chip's staging region into
/// this chip's cache.
#[derive(Debug, Clone)]
pub struct KvInstall {
    pub layer: usize,
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
    /// This chip's cache slot for every position of the hand-off (shared by its
    /// layers' jobs); [`KvInstall::dst_slots`] is this job's part.
    pub slots: Arc<[i32]>,
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
