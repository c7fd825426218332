use super::*;
use crate::kv::BlockState;
use crate::msg::PriorityClass;
use std::collections::{BTreeMap, HashSet};
use tessera_actor_core::HostId;

fn limits(max_batch_tokens: usize, max_batch_seqs: usize, block_size: usize) -> BatcherLimits {
    BatcherLimits { max_batch_tokens, max_batch_seqs, block_size, max_context: 1024 }
}

/// A request whose prompt shares no block with another request's (prefix reuse aside).
fn seq(id: u64, prompt: usize, max_new: usize) -> SeqRequest {
    let mut s = seq_of(id, (0..prompt as u32).map(|t| t % 50 + 3).collect(), max_new);
    if let Some(first) = s.tokens.first_mut() {
        *first = 100 + id as u32;
    }
    s
}

fn seq_of(id: u64, tokens: Vec<u32>, max_new: usize) -> SeqRequest {
    SeqRequest {
        request_id: id,
        req: Addr::new(HostId(0), 1000 + id),
        tokens,
        generated: 0,
        max_new_tokens: max_new,
        sampling: SamplingSpec { stop_token_ids: vec![2], ..SamplingSpec::greedy() },
        delivery: Delivery::Stream,
        forks: Vec::new(),
        cache_salt: None,
        share: Default::default(),
    }
}

/// (request id, start position, chunk length, samples) of each planned sequence.
type Shape = Vec<(u64, usize, usize, bool)>;

fn shape(plan: &StepPlan) -> Shape {
    plan.seqs.iter().map(|s| (s.request_id, s.start_pos, s.tokens.len(), s.sample)).collect()
}

fn pool(blocks: usize) -> KvPool {
    pool_of(blocks, 4)
}

fn pool_of(blocks: usize, block_size: usize) -> KvPool {
    KvPool::new(Addr::new(HostId(0), 16), blocks, block_size)
}

/// Samples token 7 for every sequence that asked.
fn run_step(b: &mut Batcher, p: &mut KvPool) -> (Shape, Vec<Emitted>) {
    let plan = b.plan(p).expect("a step");
    let sampled: Vec<(u64, u32)> = plan.seqs.iter().filter(|s| s.sample).map(|s| (s.request_id, 7)).collect();
    (shape(&plan), b.complete(&sampled, &[], p))
}

#[test]
fn plans_chunked_prefill_then_decode_first() {
    let mut b = Batcher::new(limits(8, 4, 4), vec![]);
    let mut p = pool(32);
    b.enqueue(seq(1, 10, 3));
    b.enqueue(seq(2, 3, 3));
    // (expected step shapes: (id, start, len, sample))
    let expected: Vec<Shape> = vec![
        vec![(1, 0, 8, false)],                  // budget 8: a chunk of request 1's prompt
        vec![(1, 8, 2, true), (2, 0, 3, true)],  // rest of 1, then 2 joins the batch
        vec![(1, 10, 1, true), (2, 3, 1, true)], // both decode
        vec![(1, 11, 1, true), (2, 4, 1, true)],
    ];
    for (i, want) in expected.iter().enumerate() {
        let (got, _) = run_step(&mut b, &mut p);
        assert_eq!(&got, want, "step {i}");
    }
    assert!(!b.has_work(), "both reached max_new_tokens = 3");
    assert_eq!(p.used(), 0, "finished requests free every block");
}

/// Every block the cached tokens fill is sealed with its chained hash (the last, partly
/// filled block is still being written), chunk boundaries notwithstanding.
#[test]
fn full_blocks_are_sealed_with_chained_hashes_as_prefill_chunks_fill_them() {
    let mut b = Batcher::new(limits(6, 4, 4), vec![]);
    let mut p = pool(8);
    let s = seq(1, 10, 3);
    let prompt = s.tokens.clone();
    b.enqueue(s);
    let states = |b: &mut Batcher, p: &KvPool| -> Vec<BlockState> {
        let table = b.block_table(1).unwrap_or_default();
        let refs = table.iter().map(|&slot| BlockRef { chip: Addr::new(HostId(0), 16), slot, generation: 0 });
        refs.map(|r| p.state(r).unwrap()).collect()
    };
    let h0 = chained_block_hash(None, &prompt[0..4]);
    let h1 = chained_block_hash(Some(h0), &prompt[4..8]);
    let sealed = |hash| BlockState::Sealed { hash, refs: 1 };
    let writing = BlockState::Writing { owner: 1 };
    // Chunks of 6 and 4 tokens: block 1 is filled across the chunk boundary.
    run_step(&mut b, &mut p);
    assert_eq!(states(&mut b, &p), vec![sealed(h0), writing]);
    run_step(&mut b, &mut p);
    assert_eq!(states(&mut b, &p), vec![sealed(h0), sealed(h1), writing]);
    assert_eq!(
        p.find(h1),
        b.block_table(1).map(|t| BlockRef { chip: Addr::new(HostId(0), 16), slot: t[1], generation: 0 })
    );
    while b.has_work() {
        run_step(&mut b, &mut p);
    }
    // 10 prompt + 2 generated tokens (the last sampled one is never written): 3 full blocks.
    assert_eq!((p.used(), p.cached()), (0, 3), "a finished request releases its blocks; the sealed ones stay cached");
    assert!(p.find(h0).is_some() && p.find(h1).is_some());
}

/// A prompt that starts with blocks the pool holds computes only the rest: blocks
/// cached after a finished request, or sealed by one still running; never the block of
/// its last token, which it must compute to sample.
#[test]
fn a_cached_prefix_is_reused_not_recomputed() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(16);
    let system: Vec<u32> = (10..22).collect(); // three full blocks
    let with = |tail: &[u32]| system.iter().chain(tail).copied().collect::<Vec<u32>>();
    b.enqueue(seq_of(1, with(&[40, 41]), 1));
    assert_eq!(run_step(&mut b, &mut p).0, vec![(1, 0, 14, true)]);
    assert_eq!(b.take_prefix_stats(), (14, 0), "nothing cached yet");
    assert_eq!((p.used(), p.cached()), (0, 3), "the three sealed blocks are cached");
    // Same system prompt, another question: 12 of 15 positions come from the cache.
    b.enqueue(seq_of(2, with(&[50, 51, 52]), 2));
    assert_eq!(run_step(&mut b, &mut p).0, vec![(2, 12, 3, true)]);
    assert_eq!(b.take_prefix_stats(), (15, 12), "12 of its 15 prompt positions reused");
    // While 2 runs, 3 shares its sealed blocks; 3's prompt is exactly the system prompt,
    // so its last block is computed again (its last token needs logits).
    b.enqueue(seq_of(3, system.clone(), 1));
    assert_eq!(run_step(&mut b, &mut p).0, vec![(2, 15, 1, true), (3, 8, 4, true)]);
    assert_eq!(p.used(), 0);
    // A different first block shares nothing, even with equal later blocks.
    let mut other = system.clone();
    other[0] = 99;
    b.enqueue(seq_of(4, other, 1));
    assert_eq!(run_step(&mut b, &mut p).0, vec![(4, 0, 12, true)]);
}

/// A tenant's salt keeps its cached blocks to sequences of the same salt: another
/// tenant's identical prompt computes everything (so it cannot time the first's
/// prompts), a sequence of the same salt reuses them, and so does the router's lookup.
#[test]
fn salted_prefixes_are_reused_only_under_the_same_salt() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(32);
    let prompt: Vec<u32> = (10..23).collect(); // three full blocks and one token
    let salted = |id, salt| SeqRequest { cache_salt: salt, ..seq_of(id, prompt.clone(), 1) };
    // (request, its salt, the first position it computes)
    let table: [(u64, Option<u64>, usize); 5] =
        [(1, Some(7), 0), (2, Some(8), 0), (3, None, 0), (4, Some(7), 12), (5, None, 12)];
    for (id, salt, start) in table {
        b.enqueue(salted(id, salt));
        assert_eq!(run_step(&mut b, &mut p).0, vec![(id, start, 13 - start, true)], "request {id}");
    }
    assert_eq!(p.cached(), 9, "three blocks for each of salts 7, 8 and none");
    let held = |salt| crate::kv::salted_prefix_hashes(&prompt, 4, salt).iter().all(|&h| p.find(h).is_some());
    assert!(held(Some(7)) && held(Some(8)) && held(None) && !held(Some(9)));
}

/// Reused blocks of a prefill for a decode chip are staged with the rest: the decode
/// chip needs every block.
#[test]
fn a_prefill_for_a_decode_chip_stages_its_reused_prefix_too() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(16);
    let prompt: Vec<u32> = (10..23).collect();
    b.enqueue(seq_of(1, prompt.clone(), 1));
    run_step(&mut b, &mut p);
    b.enqueue_prefill(seq_of(2, prompt, 1), 12);
    let plan = b.plan(&mut p).expect("a step");
    let s = &plan.seqs[0];
    assert_eq!((s.start_pos, s.tokens.len(), s.stage, s.stage_from), (8, 4, true, 0));
}

#[test]
fn new_requests_join_a_running_batch_after_decode_tokens() {
    let mut b = Batcher::new(limits(6, 8, 4), vec![]);
    let mut p = pool(32);
    b.enqueue(seq(1, 4, 10));
    run_step(&mut b, &mut p);
    b.enqueue(seq(2, 9, 10));
    let (got, _) = run_step(&mut b, &mut p);
    assert_eq!(got, vec![(1, 4, 1, true), (2, 0, 5, false)], "decode first, then a 5-token chunk of the new prompt");
}

/// Stall-free batching: while sequences decode, a step adds at most the cap's prompt
/// tokens; a step with nothing to decode takes the whole token budget again.
#[test]
fn a_mixed_prefill_cap_keeps_decoding_steps_short() {
    let mut b = Batcher::new(limits(16, 4, 4), vec![]);
    let mut p = pool(32);
    b.set_mixed_prefill_cap(Some(3));
    b.enqueue(seq(1, 4, 6));
    let expected: Vec<Shape> = vec![
        vec![(1, 0, 4, true)], // nothing decodes yet: the whole prompt
    ];
    for (i, want) in expected.iter().enumerate() {
        assert_eq!(&run_step(&mut b, &mut p).0, want, "step {i}");
    }
    b.enqueue(seq(2, 8, 2));
    let expected: Vec<Shape> = vec![
        vec![(1, 4, 1, true), (2, 0, 3, false)], // one decode, 3 prompt tokens
        vec![(1, 5, 1, true), (2, 3, 3, false)],
        vec![(1, 6, 1, true), (2, 6, 2, true)],
        vec![(1, 7, 1, true), (2, 8, 1, true)],
    ];
    for (i, want) in expected.iter().enumerate() {
        assert_eq!(&run_step(&mut b, &mut p).0, want, "mixed step {i}");
    }
    // Without the cap the same arrival takes the whole budget at once.
    b.set_mixed_prefill_cap(None);
    b.enqueue(seq(3, 8, 1));
    assert_eq!(run_step(&mut b, &mut p).0, vec![(1, 8, 1, true), (3, 0, 8, true)]);
}

#[test]
fn stop_tokens_eos_and_length_finish() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![7]);
    let mut p = pool(32);
    b.enqueue(seq(1, 5, 10));
    let mut ignore = seq(2, 5, 2);
    ignore.sampling.ignore_eos = true;
    b.enqueue(ignore);
    let (_, out) = run_step(&mut b, &mut p);
    let finishes: Vec<(u64, Option<Finish>)> = out.iter().map(|e| (e.request_id, e.finish)).collect();
    assert_eq!(finishes, vec![(1, Some(Finish::Stop)), (2, None)], "7 is EOS unless ignore_eos");
    let (_, out) = run_step(&mut b, &mut p);
    assert_eq!(out[0].finish, Some(Finish::Length));
    assert_eq!(p.used(), 0);
}

#[test]
fn out_of_blocks_preempts_the_latest_arrival_and_recomputes_it() {
    let mut b = Batcher::new(limits(64, 8, 2), vec![]);
    let mut p = pool_of(4, 2);
    // Each fits alone (4 + 4 tokens = 4 blocks), as the chip's admission guarantees.
    b.enqueue(seq(1, 4, 4)); // 2 blocks
    b.enqueue(seq(2, 4, 4)); // 2 blocks: the pool is full
    run_step(&mut b, &mut p);
    assert_eq!(p.free(), 0);
    // Request 1 needs a third block for its 5th token: request 2 is preempted.
    let (got, _) = run_step(&mut b, &mut p);
    assert_eq!(got, vec![(1, 4, 1, true)], "and request 2 does not come straight back");
    assert_eq!((b.running(), b.waiting()), (1, 1));
    let mut steps = 0;
    while b.has_work() {
        run_step(&mut b, &mut p);
        steps += 1;
        assert!(steps < 100);
    }
    assert_eq!(p.used(), 0);
}

#[test]
fn abort_frees_blocks_and_drops_the_sampler() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    let mut p = pool(8);
    b.enqueue(seq(1, 6, 10));
    b.enqueue(seq(2, 6, 10));
    run_step(&mut b, &mut p);
    assert!(b.abort(1, &mut p).is_some());
    assert!(b.abort(1, &mut p).is_none());
    assert_eq!(p.used(), 2);
    let plan = b.plan(&mut p).unwrap();
    assert_eq!(plan.drop_samplers, vec![1]);
    assert_eq!(b.evict_all(Some(&mut p)).len(), 1);
    assert_eq!(p.used(), 0);
}

#[test]
fn replayed_sequences_skip_earlier_sampler_draws() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    let mut p = pool(8);
    let mut s = seq(1, 6, 4);
    s.generated = 3;
    b.enqueue(s);
    let plan = b.plan(&mut p).unwrap();
    assert_eq!(plan.seqs[0].new_sampler.as_ref().map(|n| n.skip), Some(3));
}

#[test]
fn prefill_for_a_decode_chip_stages_all_but_the_last_token_and_never_samples() {
    let mut b = Batcher::new(limits(8, 4, 4), vec![]);
    let mut p = pool(16);
    b.enqueue_prefill(seq(1, 13, 5), 12);
    // (start, len, sample, stage) of each step: chunks of the budget up to position 12.
    let mut steps = Vec::new();
    while let Some(plan) = b.plan(&mut p) {
        let s = &plan.seqs[0];
        steps.push((s.start_pos, s.tokens.len(), s.sample, s.stage, s.new_sampler.is_some()));
        let _ = b.complete(&[], &[], &mut p);
        if !b.take_prefilled().is_empty() {
            break;
        }
    }
    assert_eq!(steps, vec![(0, 8, false, true, false), (8, 4, false, true, false)]);
    assert_eq!(p.used(), 3, "the hand-off's blocks left the batcher, still held for the decode chip");
    assert!(!b.has_work());
}

#[test]
fn prefill_of_every_position_samples_the_first_token_then_leaves_with_its_blocks() {
    let mut b = Batcher::new(limits(8, 4, 4), vec![]);
    let mut p = pool(16);
    b.enqueue_prefill(seq(1, 13, 5), 13);
    // (start, len, sample, stage, new sampler) of each step, and what each emitted.
    let mut steps = Vec::new();
    let mut emitted = Vec::new();
    let mut left = Vec::new();
    while left.is_empty() {
        let plan = b.plan(&mut p).expect("a step");
        let s = &plan.seqs[0];
        steps.push((s.start_pos, s.tokens.len(), s.sample, s.stage, s.new_sampler.is_some()));
        let sampled: Vec<(u64, u32)> = plan.seqs.iter().filter(|s| s.sample).map(|s| (s.request_id, 7)).collect();
        emitted.extend(b.complete(&sampled, &[], &mut p).into_iter().map(|e| (e.tokens, e.finish)));
        left = b.take_prefilled();
    }
    assert_eq!(steps, vec![(0, 8, false, true, true), (8, 5, true, true, false)]);
    assert_eq!(emitted, vec![(vec![7], None)], "the first token, to the request");
    assert_eq!(left[0].blocks.len(), 4, "every position's blocks, held for the decode chip");
    assert!(!b.has_work());
    // The worker forgets its sampler at the next step.
    b.enqueue(seq(2, 4, 1));
    assert_eq!(b.plan(&mut p).expect("a step").drop_samplers, vec![1]);
}

#[test]
fn prefill_whose_first_token_ends_it_frees_its_blocks() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(16);
    b.enqueue_prefill(seq(1, 6, 1), 6);
    let (_, out) = run_step(&mut b, &mut p);
    assert_eq!(
        out.iter().map(|e| (e.tokens.clone(), e.finish)).collect::<Vec<_>>(),
        vec![(vec![7], Some(Finish::Length))]
    );
    assert!(b.take_prefilled().is_empty(), "nothing to hand over");
    assert_eq!(p.used(), 0);
}

#[test]
fn prefilled_blocks_are_handed_over_intact() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(16);
    b.enqueue_prefill(seq(1, 13, 5), 12);
    let plan = b.plan(&mut p).expect("a step");
    assert_eq!(plan.seqs[0].block_table.len(), 3);
    assert_eq!(b.block_table(1), Some(plan.seqs[0].block_table.clone()));
    let done = b.take_prefilled();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].blocks.iter().map(|b| b.slot).collect::<Vec<_>>(), plan.seqs[0].block_table.to_vec());
    assert_eq!(p.used(), 3, "held until the decode chip acknowledges");
    for blk in done[0].blocks.iter().copied() {
        p.release(blk).expect("release");
    }
    assert_eq!(p.used(), 0);
}

#[test]
fn received_sequence_waits_for_its_kv_then_samples_from_the_last_prompt_token() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(8);
    let slots = b.admit_received(seq(1, 10, 3), 9, &mut p).expect("blocks fit");
    assert_eq!(slots.len(), 9);
    assert_eq!(p.used(), 3, "ceil(9 / 4) blocks reserved at once");
    assert!(b.plan(&mut p).is_none(), "not runnable before its KV is in");
    assert!(b.mark_received(1, None, &mut p));
    let (got, out) = run_step(&mut b, &mut p);
    assert_eq!(got, vec![(1, 9, 1, true)], "only the last prompt token runs here");
    assert_eq!(out.len(), 1);
    let (got, _) = run_step(&mut b, &mut p);
    assert_eq!(got, vec![(1, 10, 1, true)]);
}

#[test]
fn received_sequence_decodes_from_the_prefill_chips_first_token() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(8);
    b.admit_received(seq(1, 8, 3), 8, &mut p).expect("blocks fit");
    assert_eq!(p.used(), 2);
    assert!(b.plan(&mut p).is_none(), "not runnable before its KV and first token are in");
    assert!(b.mark_received(1, Some(9), &mut p));
    let plan = b.plan(&mut p).expect("a step");
    let s = &plan.seqs[0];
    assert_eq!((s.start_pos, s.tokens.to_vec(), s.sample), (8, vec![9], true), "the first token runs at position 8");
    assert_eq!(s.new_sampler.as_ref().map(|n| n.skip), Some(1), "one draw was the prefill chip's");
    let out = b.complete(&[(1, 7)], &[], &mut p);
    assert_eq!(out[0].finish, None);
    let (_, out) = run_step(&mut b, &mut p);
    assert_eq!(out[0].finish, Some(Finish::Length), "3 tokens in all, the prefill chip's first included");
    assert_eq!(p.used(), 0);
}

#[test]
fn received_sequence_refused_when_blocks_do_not_fit_and_freed_on_abort() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(2);
    assert!(b.admit_received(seq(1, 10, 3), 9, &mut p).is_none(), "needs 3 blocks of 2");
    assert_eq!(p.used(), 0, "all or nothing");
    assert!(b.admit_received(seq(2, 5, 3), 0, &mut p).is_none(), "nothing prefilled");
    assert!(b.admit_received(seq(3, 5, 3), 6, &mut p).is_none(), "more positions than tokens");
    b.admit_received(seq(4, 6, 3), 5, &mut p).expect("fits");
    assert_eq!(p.used(), 2);
    b.abort(4, &mut p);
    assert_eq!(p.used(), 0);
}

#[test]
fn preemption_drops_a_prefill_for_a_decode_chip_instead_of_deadlocking() {
    // Request 1 decodes here; request 2 is a prefill for a decode chip. Blocks run out
    // with 2 half-way: 1 takes 2's blocks, and 2 is handed back (not recomputed here,
    // since a decode chip may be reading the blocks it had).
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(3);
    b.enqueue(seq(1, 4, 8));
    assert_eq!(run_step(&mut b, &mut p).0, vec![(1, 0, 4, true)]);
    b.enqueue_prefill(seq(2, 9, 1), 8);
    assert_eq!(run_step(&mut b, &mut p).0, vec![(1, 4, 1, true), (2, 0, 4, false)]);
    for pos in 5..8 {
        assert_eq!(run_step(&mut b, &mut p).0, vec![(1, pos, 1, true)], "2 waits for blocks");
    }
    assert!(b.take_dropped().is_empty());
    assert_eq!(run_step(&mut b, &mut p).0, vec![(1, 8, 1, true)], "1 needs a third block: 2's");
    assert_eq!(b.take_dropped(), vec![(2, Addr::new(HostId(0), 1002))]);
    assert!(!b.contains(2));
    assert_eq!(p.used(), 3, "request 1 holds all three blocks");
}

/// The admission check the chip and the local engine share: a table of sequences and
/// the refusal each gets (a model of 100 tokens and a context of 32, a pool of 8 blocks
/// of 4).
#[test]
fn admission_refuses_what_can_never_run_here() {
    let b = Batcher::new(BatcherLimits { max_context: 32, ..limits(64, 8, 4) }, vec![]);
    let with = |tokens: Vec<u32>, max_new: usize| SeqRequest { tokens, max_new_tokens: max_new, ..seq(1, 0, 0) };
    let cases: Vec<(SeqRequest, Result<(), Inadmissible>)> = vec![
        (with(vec![1, 2, 3], 10), Ok(())),
        (with(vec![], 4), Err(Inadmissible::EmptyPrompt)),
        (with(vec![1, 100, 2], 4), Err(Inadmissible::OutOfVocabulary { token: 100, vocab_size: 100 })),
        (with(vec![5; 32], 1), Err(Inadmissible::NoRoomInContext { tokens: 32, max_context: 32 })),
        // 31 + 1 tokens fill the context: exactly the pool's 8 blocks.
        (with(vec![5; 31], 1), Ok(())),
        // max_tokens is clamped to the context: 20 + 30 tokens still need 8 blocks.
        (with(vec![5; 20], 30), Ok(())),
        (with(vec![5; 20], usize::MAX), Ok(())),
    ];
    for (s, want) in cases {
        let got = admissible(&s, 100, 32, b.blocks_to_finish(&s), 8);
        assert_eq!(got, want, "{} prompt tokens, max_new {}", s.tokens.len(), s.max_new_tokens);
    }
    // A pool too small for the whole request.
    let s = with(vec![5; 10], 12);
    let err = admissible(&s, 100, 32, b.blocks_to_finish(&s), 5).unwrap_err();
    assert_eq!(err, Inadmissible::TooFewBlocks { prompt: 10, new: 12, need: 6, num_blocks: 5 });
    assert_eq!(
        err.to_string(),
        "10 prompt tokens + 12 new tokens need 6 KV blocks but the cache holds 5: lower max_tokens"
    );
}

/// Under pressure the cache gives up a prefix's last blocks first: what is left still
/// starts at the prompt's beginning and is reused.
#[test]
fn eviction_keeps_the_leading_blocks_of_a_cached_prefix() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(4);
    let system: Vec<u32> = (10..22).collect(); // three full blocks
    b.enqueue(seq_of(1, system.iter().copied().chain([40]).collect(), 1));
    run_step(&mut b, &mut p);
    assert_eq!(p.cached(), 3);
    // A request of its own takes two blocks: one free, one evicted from the cache.
    b.enqueue(seq(2, 5, 1));
    run_step(&mut b, &mut p);
    assert_eq!(p.cached(), 2 + 1, "two of the prefix's blocks and one of request 2's");
    b.enqueue(seq_of(3, system.iter().copied().chain([50]).collect(), 1));
    assert_eq!(run_step(&mut b, &mut p).0, vec![(3, 8, 5, true)], "the first two blocks are still reused");
}

/// A whole response: its first token goes at once, the rest in groups of
/// `Delivery::GROUP`, and whatever is held goes with the finish; a streamed one beside
/// it gets every token as sampled. Together they carry every token, in order.
#[test]
fn whole_responses_send_the_first_token_then_groups_then_the_rest_at_the_end() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    let mut p = pool(64);
    let n = 2 * Delivery::GROUP + 5;
    b.enqueue(SeqRequest { delivery: Delivery::Whole, sampling: SamplingSpec::greedy(), ..seq(1, 5, n) });
    b.enqueue(SeqRequest { sampling: SamplingSpec::greedy(), ..seq(2, 5, n) });
    let mut sent: BTreeMap<u64, Vec<(usize, bool)>> = BTreeMap::new();
    for _ in 0..n {
        let (_, out) = run_step(&mut b, &mut p);
        for e in out {
            sent.entry(e.request_id).or_default().push((e.tokens.len(), e.finish.is_some()));
        }
    }
    let g = Delivery::GROUP;
    assert_eq!(sent[&1], vec![(1, false), (g, false), (g, false), (4, true)]);
    assert_eq!(sent[&2].len(), n, "a streamed response: one message per token");
    assert!(sent[&2].iter().all(|&(len, _)| len == 1));
    assert_eq!(p.used(), 0);
}

/// A request of `prompt` tokens with siblings 11, 12 forked after its prompt (seeds 5, 6).
fn forking(prompt: usize, max_new: usize) -> SeqRequest {
    let fork =
        |request_id: u64, seed| Fork { request_id, req: Addr::new(HostId(0), 1000 + request_id), seed: Some(seed) };
    SeqRequest { forks: vec![fork(11, 5), fork(12, 6)], ..seq(1, prompt, max_new) }
}

/// Samples a token per sampler: 7 for the sequence itself, 8, 9… for its forks.
fn sample_all(plan: &StepPlan) -> Vec<(u64, u32)> {
    plan.seqs.iter().flat_map(|s| s.samplers().zip(7..)).collect()
}

#[test]
fn forks_share_the_prompt_blocks_and_copy_the_partial_last_one() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    let mut p = pool(16);
    b.enqueue(forking(10, 3)); // blocks: 2 full, 1 holding 2 prompt tokens
    let plan = b.plan(&mut p).expect("a step");
    assert_eq!(shape(&plan), vec![(1, 0, 10, true)], "the prompt is computed once");
    let forks: Vec<(u64, Option<u64>)> =
        plan.seqs[0].forks.iter().map(|f| (f.request_id, f.new_sampler.spec.seed)).collect();
    assert_eq!(forks, vec![(11, Some(5)), (12, Some(6))], "each fork samples with its own seed");
    let last = plan.seqs[0].block_table[2];
    assert_eq!(plan.copies.len(), 2);
    assert!(plan.copies.iter().all(|&(src, dst)| src == last && dst != last), "{:?}", plan.copies);
    assert_eq!(p.used(), 5, "3 blocks for the prompt, a copy of the last for each fork");

    let emitted = b.complete(&sample_all(&plan), &[], &mut p);
    let firsts: Vec<(u64, Vec<u32>)> = emitted.iter().map(|e| (e.request_id, e.tokens.clone())).collect();
    assert_eq!(firsts, vec![(1, vec![7]), (11, vec![8]), (12, vec![9])]);
    assert_eq!(emitted[1].req, Addr::new(HostId(0), 1011), "a fork's tokens go to its own request");

    // Then three sequences decode, each writing position 10 into its own last block.
    let plan = b.plan(&mut p).expect("a step");
    assert_eq!(shape(&plan), vec![(1, 10, 1, true), (11, 10, 1, true), (12, 10, 1, true)]);
    assert!(plan.copies.is_empty() && plan.seqs.iter().all(|s| s.forks.is_empty() && s.new_sampler.is_none()));
    let tables: Vec<&[u32]> = plan.seqs.iter().map(|s| &s.block_table[..]).collect();
    assert!(tables.iter().all(|t| t[..2] == tables[0][..2]), "the full blocks are shared: {tables:?}");
    let lasts: HashSet<u32> = tables.iter().map(|t| t[2]).collect();
    assert_eq!(lasts.len(), 3, "the partial block is each one's own: {tables:?}");
    assert_eq!(plan.seqs[1].tokens[..], [8], "the fork continues from its own first token");
    b.complete(&sample_all(&plan), &[], &mut p);
    while b.has_work() {
        let plan = b.plan(&mut p).expect("a step");
        b.complete(&sample_all(&plan), &[], &mut p);
    }
    assert_eq!(p.used(), 0, "every block is freed once all three end");
}

#[test]
fn forks_of_a_prompt_that_fills_its_blocks_copy_nothing() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    let mut p = pool(16);
    b.enqueue(forking(8, 2));
    let plan = b.plan(&mut p).expect("a step");
    assert!(plan.copies.is_empty());
    assert_eq!(plan.seqs[0].forks.len(), 2);
    b.complete(&sample_all(&plan), &[], &mut p);
    assert_eq!(p.used(), 2, "the two full blocks, shared");
    let plan = b.plan(&mut p).expect("a step");
    let news: HashSet<u32> = plan.seqs.iter().map(|s| s.block_table[2]).collect();
    assert_eq!((plan.seqs.len(), news.len(), p.used()), (3, 3, 5), "each takes a new block for position 8");
    b.complete(&sample_all(&plan), &[], &mut p);
    assert_eq!(p.used(), 0);
}

#[test]
fn forks_without_blocks_for_their_copies_route_on_their_own() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    let mut p = pool(4);
    b.enqueue(forking(10, 3)); // 3 blocks; 1 left, two forks
    let plan = b.plan(&mut p).expect("a step");
    assert!(plan.seqs[0].forks.is_empty() && plan.copies.is_empty());
    let unforked: Vec<u64> = b.take_unforked().into_iter().map(|(id, _)| id).collect();
    assert_eq!(unforked, vec![11, 12]);
    let emitted = b.complete(&sample_all(&plan), &[], &mut p);
    assert_eq!(emitted.len(), 1, "only the sequence itself samples");
}

#[test]
fn a_sequence_aborted_mid_step_frees_its_forks_copies() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    let mut p = pool(16);
    b.enqueue(forking(10, 3));
    let plan = b.plan(&mut p).expect("a step");
    assert_eq!(p.used(), 5);
    assert!(b.abort(1, &mut p).is_some());
    assert_eq!(p.used(), 0, "the prompt's blocks and both copies are freed");
    assert!(b.complete(&sample_all(&plan), &[], &mut p).is_empty(), "nobody is left to sample");
    assert!(!b.has_work());
}

#[test]
fn a_replayed_sequence_forks_nothing() {
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    let mut p = pool(16);
    b.enqueue(SeqRequest { generated: 2, ..forking(10, 3) });
    let plan = b.plan(&mut p).expect("a step");
    assert!(plan.seqs[0].forks.is_empty() && plan.copies.is_empty() && b.take_unforked().is_empty());
}

/// A decode step shares the block table of the step before it while no block was added,
/// and carries a new one, equal to the sequence's blocks, when one was; a sequence that
/// lost its blocks and got others gets its own table, not the old one.
#[test]
fn decode_steps_share_the_block_table_until_a_block_is_added() {
    let mut b = Batcher::new(limits(64, 4, 4), vec![]);
    let mut p = pool(16);
    b.enqueue(seq(1, 6, 20));
    let mut tables: Vec<Arc<[u32]>> = Vec::new();
    for _ in 0..6 {
        let plan = b.plan(&mut p).expect("a step");
        let table = plan.seqs[0].block_table.clone();
        assert_eq!(Some(table.clone()), b.block_table(1), "the table is the sequence's blocks");
        tables.push(table);
        let _ = b.complete(&sample_all(&plan), &[], &mut p);
    }
    // Prompt of 6 in blocks of 4: the prefill (positions 0..6) holds 2 blocks; decode
    // positions 6 and 7 fit them, position 8 takes a third block.
    let shared: Vec<bool> = tables.windows(2).map(|w| Arc::ptr_eq(&w[0], &w[1])).collect();
    assert_eq!(shared, vec![true, true, false, true, true]);
    assert_eq!(tables[3].len(), 3);

    // Aborted and enqueued again: new blocks, a table built for them.
    let old = tables[5].clone();
    assert!(b.abort(1, &mut p).is_some());
    b.enqueue(seq(1, 6, 20));
    let plan = b.plan(&mut p).expect("a step");
    assert!(!Arc::ptr_eq(&plan.seqs[0].block_table, &old));
    assert_eq!(Some(plan.seqs[0].block_table.clone()), b.block_table(1));
}

fn of_class(s: SeqRequest, tenant: u32, weight: u32, class: PriorityClass) -> SeqRequest {
    SeqRequest { share: TenantShare { tenant, weight, class }, ..s }
}

/// Runs the batcher dry; returns the requests in the order they started and the
/// requests each finished one after (every request must finish: none is lost).
fn drain(b: &mut Batcher, p: &mut KvPool, requests: usize) -> Vec<u64> {
    let mut started = Vec::new();
    let mut finished = HashSet::new();
    for _ in 0..10_000 {
        if !b.has_work() {
            break;
        }
        let plan = b.plan(p).expect("a step while there is work");
        for s in plan.seqs.iter().filter(|s| s.start_pos == 0) {
            started.push(s.request_id);
        }
        let sampled: Vec<(u64, u32)> = plan.seqs.iter().filter(|s| s.sample).map(|s| (s.request_id, 7)).collect();
        for e in b.complete(&sampled, &[], p) {
            if e.finish.is_some() {
                assert!(finished.insert(e.request_id), "request {} finished twice", e.request_id);
            }
        }
    }
    assert_eq!(finished.len(), requests, "every request finishes");
    assert_eq!(p.used(), 0, "the pool is all free after");
    started
}

/// Under KV pressure the victim is the lowest class's latest arrival: the batch-class
/// request goes though it came first, and comes back once the interactive one is done.
#[test]
fn out_of_blocks_preempts_the_lower_class_first() {
    use PriorityClass::{Batch, Interactive};
    let mut b = Batcher::new(limits(64, 8, 2), vec![]);
    let mut p = pool_of(4, 2);
    b.enqueue(of_class(seq(1, 4, 4), 1, 1, Batch));
    b.enqueue(of_class(seq(2, 4, 4), 0, 1, Interactive));
    run_step(&mut b, &mut p);
    assert_eq!(p.free(), 0);
    // Request 2 needs a third block: request 1, of the lower class, is preempted.
    let (got, _) = run_step(&mut b, &mut p);
    assert_eq!(got, vec![(2, 4, 1, true)]);
    assert_eq!(b.take_preemptions(), Preemptions { kv: 1, priority: 0, fair: 0 });
    // Request 1 recomputes from the start once there is room; both finish.
    assert_eq!(drain(&mut b, &mut p, 2), vec![1]);
}

/// A waiting sequence of a higher class takes the blocks of running lower-class ones
/// to start at once, rather than wait for them to finish.
#[test]
fn a_waiting_higher_class_preempts_running_lower_classes_to_start() {
    use PriorityClass::{Batch, Interactive, Standard};
    let mut b = Batcher::new(limits(64, 8, 2), vec![]);
    let mut p = pool_of(6, 2);
    b.enqueue(of_class(seq(1, 4, 2), 1, 1, Batch)); // 2 blocks, 3 at most
    b.enqueue(of_class(seq(2, 4, 2), 1, 1, Standard)); // 2 blocks, 3 at most
    run_step(&mut b, &mut p);
    b.enqueue(of_class(seq(3, 6, 2), 0, 1, Interactive)); // 3 blocks
    // Two blocks free, three wanted: the batch request gives its two up.
    let (got, _) = run_step(&mut b, &mut p);
    assert_eq!(got, vec![(2, 4, 1, true), (3, 0, 6, true)]);
    assert_eq!(b.take_preemptions(), Preemptions { kv: 0, priority: 1, fair: 0 });
    // Request 2 ended in that step (its second token); 3, then 1 again, finish after.
    assert_eq!(drain(&mut b, &mut p, 2), vec![1]);
}

/// Tenants of one class start in fair-queuing order, not arrival order: a light tenant
/// arriving behind a flood starts next; with weights, service follows them.
#[test]
fn waiting_sequences_start_in_weighted_fair_order() {
    use PriorityClass::Standard;
    let pace = Pace { prefill_s_per_token: 1e-3, decode_step_s: 1e-2, decode_s_per_seq: 1e-3 };
    // (weights of tenants 0 and 1, arrivals as (request id, tenant), the start order)
    type Case = ((u32, u32), Vec<(u64, u32)>, Vec<u64>);
    let cases: [Case; 3] = [
        // One at a time: tenant 1's two requests, behind four of tenant 0's, alternate
        // with tenant 0's from the second start on.
        ((1, 1), vec![(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1)], vec![1, 5, 2, 6, 3, 4]),
        // Weight 2 against 1: two of tenant 0's for each of tenant 1's.
        ((2, 1), vec![(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1), (7, 1)], vec![1, 5, 2, 3, 6, 4, 7]),
        // A single tenant is served first come first served.
        ((1, 1), vec![(1, 0), (2, 0), (3, 0)], vec![1, 2, 3]),
    ];
    for ((w0, w1), arrivals, want) in cases {
        let mut b = Batcher::new(limits(64, 1, 4), vec![]);
        b.set_pace(pace);
        let mut p = pool(64);
        let n = arrivals.len();
        for (id, tenant) in arrivals {
            let weight = if tenant == 0 { w0 } else { w1 };
            b.enqueue(of_class(seq(id, 8, 4), tenant, weight, Standard));
        }
        assert_eq!(drain(&mut b, &mut p, n), want, "weights {w0}:{w1}");
        // Each request is charged its 8 prompt tokens and 3 decode steps at the pace.
        let per_request = 8.0 * 1e-3 + 3.0 * 1e-2;
        for (tenant, seconds) in b.take_service() {
            let requests = want.iter().filter(|&&id| (id >= 5) == (tenant == 1)).count() as f64;
            assert!((seconds - requests * per_request).abs() < 1e-9, "tenant {tenant}: {seconds} s");
        }
    }
}

/// A tenant running nothing takes a sequence's room from a tenant running more than its
/// share of the batch, the most-served one's latest; a tenant at its share takes none.
#[test]
fn a_tenant_under_its_share_preempts_one_over_it_to_start() {
    use PriorityClass::Standard;
    let mut b = Batcher::new(limits(64, 3, 2), vec![]);
    let mut p = pool_of(12, 2);
    for id in 1..=3 {
        b.enqueue(of_class(seq(id, 4, 4), 0, 1, Standard)); // 2 blocks, 4 at most
    }
    run_step(&mut b, &mut p);
    assert_eq!(b.running(), 3, "the batch is full of tenant 0's");
    b.enqueue(of_class(seq(4, 4, 4), 1, 1, Standard));
    let (got, _) = run_step(&mut b, &mut p);
    assert!(got.contains(&(4, 0, 4, true)), "tenant 1 starts at once: {got:?}");
    assert!(!got.iter().any(|s| s.0 == 3), "tenant 0's latest waits: {got:?}");
    assert_eq!(b.take_preemptions(), Preemptions { kv: 0, priority: 0, fair: 1 });
    // Tenant 0, over its share, takes nothing back from tenant 1 meanwhile; request 3
    // resumes (from its cached prefix) and all four finish.
    drain(&mut b, &mut p, 4);
    assert_eq!(b.take_preemptions().fair, 0);
}

/// Prompts part-way through their prefill and new arrivals share one fair order: a new
/// prompt of a tenant served less goes before a partial prompt of one served more (in
/// the same step, not a later one), while one tenant's partial prompt goes before its
/// own new one.
#[test]
fn a_new_prompt_of_a_tenant_served_less_goes_before_partial_prompts() {
    use PriorityClass::Standard;
    let pace = Pace { prefill_s_per_token: 1e-3, decode_step_s: 1e-2, decode_s_per_seq: 1e-3 };
    // (the new request's tenant, the second step's shape)
    let cases: [(u32, Shape); 2] = [
        // Tenant 1 arrives level with tenant 0 (VTC's lift); tenant 0's decode token in
        // this step puts it ahead, so tenant 1's prompt goes first, whole, and request
        // 2's prefill continues with what is left of the budget.
        (1, vec![(1, 4, 1, true), (3, 0, 8, true), (2, 8, 3, false)]),
        // The same arrival from tenant 0 waits behind its own partial prompt.
        (0, vec![(1, 4, 1, true), (2, 8, 11, false)]),
    ];
    for (tenant, want) in cases {
        let mut b = Batcher::new(limits(12, 8, 4), vec![]);
        b.set_pace(pace);
        let mut p = pool(64);
        b.enqueue(of_class(seq(1, 4, 4), 0, 1, Standard));
        b.enqueue(of_class(seq(2, 24, 4), 0, 1, Standard));
        let (got, _) = run_step(&mut b, &mut p);
        assert_eq!(got, vec![(1, 0, 4, true), (2, 0, 8, false)]);
        b.enqueue(of_class(seq(3, 8, 4), tenant, 1, Standard));
        let (got, _) = run_step(&mut b, &mut p);
        assert_eq!(got, want, "a new request of tenant {tenant}");
        drain(&mut b, &mut p, 3);
    }
}

/// On a chip shared by tenants a step computes prompt tokens up to the chip's roofline
/// knee (10 tokens here: the tokens computed in the time of one weights' read), so the
/// step in flight when another tenant's prompt comes is short; a chip of one tenant
/// batches as before.
#[test]
fn on_a_shared_chip_a_step_computes_prompt_tokens_up_to_the_knee() {
    use PriorityClass::Standard;
    let pace = Pace { prefill_s_per_token: 1e-3, decode_step_s: 1e-2, decode_s_per_seq: 1e-3 };
    // (shared, the first two steps)
    let cases: [(bool, [Shape; 2]); 2] = [
        (false, [vec![(1, 0, 24, true), (2, 0, 24, true)], vec![(1, 24, 1, true), (2, 24, 1, true)]]),
        (true, [vec![(1, 0, 10, false)], vec![(1, 10, 10, false)]]),
    ];
    for (shared, want) in cases {
        let mut b = Batcher::new(limits(64, 8, 4), vec![]);
        b.set_pace(pace);
        b.set_shared(shared);
        let mut p = pool(64);
        b.enqueue(of_class(seq(1, 24, 4), 0, 1, Standard));
        b.enqueue(of_class(seq(2, 24, 4), 0, 1, Standard));
        for (n, want) in want.iter().enumerate() {
            assert_eq!(&run_step(&mut b, &mut p).0, want, "shared {shared}, step {n}");
        }
        drain(&mut b, &mut p, 2);
        assert_eq!(p.free(), 64);
    }
}

/// A lone prompt (its tenant's only sequence on the chip, as a light tenant's beside a
/// flood) that comes first goes whole, past the knee, and the decodes of other tenants
/// that ran in the step before wait that one step: its first token comes as it would
/// alone. No decode waits two steps running: a second lone prompt right after takes the
/// flood's decodes along, and holds back the first light request's.
#[test]
fn a_lone_prompt_goes_whole_in_a_step_of_its_own_and_no_decode_waits_twice() {
    use PriorityClass::Standard;
    let mut b = Batcher::new(limits(64, 8, 4), vec![]);
    b.set_pace(Pace { prefill_s_per_token: 1e-3, decode_step_s: 1e-2, decode_s_per_seq: 1e-3 });
    b.set_shared(true);
    let mut p = pool(64);
    // The flood (tenant 0): two requests, decoding once their prompts are in.
    b.enqueue(of_class(seq(1, 8, 20), 0, 1, Standard));
    b.enqueue(of_class(seq(2, 8, 20), 0, 1, Standard));
    assert_eq!(run_step(&mut b, &mut p).0, vec![(1, 0, 8, true), (2, 0, 2, false)]);
    assert_eq!(run_step(&mut b, &mut p).0, vec![(1, 8, 1, true), (2, 2, 6, true)]);
    assert_eq!(run_step(&mut b, &mut p).0, vec![(1, 9, 1, true), (2, 8, 1, true)]);
    // Two light tenants' prompts of 24 tokens (past the knee) come at once.
    b.enqueue(of_class(seq(3, 24, 20), 1, 1, Standard));
    b.enqueue(of_class(seq(4, 24, 20), 2, 1, Standard));
    let steps: Vec<Shape> = (0..3).map(|_| run_step(&mut b, &mut p).0).collect();
    assert_eq!(
        steps,
        vec![
            vec![(3, 0, 24, true)],
            vec![(1, 10, 1, true), (2, 9, 1, true), (4, 0, 24, true)],
            vec![(1, 11, 1, true), (2, 10, 1, true), (3, 24, 1, true), (4, 24, 1, true)],
        ]
    );
    drain(&mut b, &mut p, 4);
    assert_eq!(p.free(), 64);
}
