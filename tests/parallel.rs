//! Model parallelism: a model instance across several devices — pipeline stages of
//! unequal layer counts, tensor-parallel ranks, both — generates the greedy tokens of
//! the whole model on one device, on the builtin tiny model and on the shared SmolLM2
//! GGUF file, and leaves its KV pool all-free; a model too large for one device's
//! memory limit is served by an instance of two such devices.

use std::path::{Path, PathBuf};

use tessera_backends::device::DeviceConfig;
use tessera_backends::dtype::DType;
use tessera_backends::instance::{InstanceSpec, ShardDevice};
use tessera_backends::kv::KvCacheConfig;
use tessera_backends::kv_format::KvLayout;
use tessera_backends::model::{LoadOptions, Model};
use tessera_backends::sampling::SamplingParams;
use tessera_backends::synth::SynthArch;
use tessera_chip_executor::local::{EngineConfig, LocalEngine};

use crate::common::{TempCkpt, device, tokens};

const BLOCK: usize = 8;

/// An instance of `counts` layers per stage, `tp` ranks per stage, each device under
/// `memory_limit_bytes` (0: none).
fn spec(dir: &Path, counts: &[usize], tp: usize, memory_limit_bytes: u64) -> InstanceSpec {
    let device = |s: usize, r: usize| ShardDevice {
        label: format!("stage{s}-rank{r}"),
        kernel_lib: None,
        device: DeviceConfig { threads: 1, memory_limit_bytes, ..Default::default() },
    };
    InstanceSpec {
        model_dir: dir.to_path_buf(),
        options: LoadOptions::default(),
        stages: InstanceSpec::stages_of(counts, tp, device),
        block_size: BLOCK,
        kv_dtype: DType::F32,
        kv_layout: KvLayout::HeadMajor,
        default_kv_bytes: 16 << 20,
        max_blocks: 256,
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens, ignore_eos: true, ..Default::default() }
}

/// Every prompt's greedy tokens, run together (so steps hold several sequences and the
/// pipeline cuts them into micro-batches), and the pool all-free after.
fn run(mut engine: LocalEngine, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    for (id, p) in prompts.iter().enumerate() {
        engine.add_request(id as u64, p, greedy(max_tokens)).expect("admitted");
    }
    let mut done = engine.run_to_completion().expect("generation");
    done.sort_by_key(|c| c.id);
    assert_eq!(engine.pool().free(), engine.pool().capacity(), "every KV block is free again");
    done.into_iter().map(|c| c.tokens).collect()
}

fn whole(dir: &Path, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let model = Model::load(dir, device(), None).expect("load");
    let kv = KvCacheConfig { block_size: BLOCK, num_blocks: 256, dtype: DType::F32 };
    run(LocalEngine::new(model, kv, EngineConfig::default()).expect("engine"), prompts, max_tokens)
}

fn sharded(spec: &InstanceSpec, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let engine = LocalEngine::instance(spec, EngineConfig::default()).unwrap_or_else(|e| panic!("instance: {e}"));
    run(engine, prompts, max_tokens)
}

/// The instance shapes of the acceptance: 2 stages, 3 stages of unequal layer counts,
/// TP=2, and 2 stages of TP=2.
fn shapes(layers: usize) -> Vec<(Vec<usize>, usize)> {
    let a = (layers / 5).max(1);
    vec![
        (vec![1, layers - 1], 1),
        (vec![a, layers - 3 * a, 2 * a], 1),
        (vec![layers], 2),
        (vec![layers / 2, layers - layers / 2], 2),
    ]
}

#[test]
fn pipeline_and_tensor_parallel_instances_generate_the_whole_models_greedy_tokens() {
    let ckpt = TempCkpt::tiny("parallel", SynthArch::Llama, 7, None, 1);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| tokens(5 + 7 * i, 40 + i as u64, 1024)).collect();
    let want = whole(ckpt.path(), &prompts, 12);
    for (counts, tp) in shapes(4) {
        let got = sharded(&spec(ckpt.path(), &counts, tp, 0), &prompts, 12);
        assert_eq!(got, want, "stages {counts:?} x tp {tp}");
    }
}

fn smollm2() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Some(path);
    }
    eprintln!("skipped: {} is not there", path.display());
    None
}

#[test]
fn instances_of_the_shared_smollm2_gguf_generate_its_greedy_tokens() {
    let Some(path) = smollm2() else { return };
    // "The capital of France is" and a second prompt, as SmolLM2's tokenizer reads them.
    let tok = tessera_backends::tokenizer::TextTokenizer::from_dir(&path).expect("tokenizer");
    let prompts: Vec<Vec<u32>> = ["The capital of France is", "Water boils at a temperature of"]
        .iter()
        .map(|p| tok.encode(p, true).expect("encode"))
        .collect();
    let want = whole(&path, &prompts, 8);
    for (counts, tp) in shapes(30) {
        let got = sharded(&spec(&path, &counts, tp, 0), &prompts, 8);
        assert_eq!(got, want, "stages {counts:?} x tp {tp}");
    }
}

#[test]
fn a_model_too_large_for_one_chip_is_served_by_two() {
    let ckpt = TempCkpt::tiny("too-large", SynthArch::Llama, 3, None, 1);
    let full = Model::load(ckpt.path(), device(), None).expect("load").weight_bytes();
    // Room for 60% of the weights and 1 MiB of KV and step buffers: half the model
    // fits, the whole does not.
    let limit = full * 6 / 10 + (1 << 20);
    assert!(limit < full, "the tiny model ({full} bytes) is larger than the limit");
    let lib = tessera_backends::loader::KernelLibrary::load_default().expect("library");
    let small = tessera_backends::device::Device::open(
        &lib,
        &DeviceConfig { threads: 1, memory_limit_bytes: limit, ..Default::default() },
    )
    .expect("device");
    let e = Model::load(ckpt.path(), small, None).err().expect("the whole model does not fit one chip").to_string();
    assert!(e.contains("memory") || e.contains("limit"), "{e}");
    let prompts = vec![tokens(9, 5, 1024)];
    let got = sharded(&spec(ckpt.path(), &[2, 2], 1, limit), &prompts, 10);
    assert_eq!(got, whole(ckpt.path(), &prompts, 10));
}

#[test]
fn instance_shapes_that_cannot_work_are_refused_clearly() {
    let ckpt = TempCkpt::tiny("bad-shapes", SynthArch::Llama, 1, None, 1);
    let cases: [(&[usize], usize, &str); 3] = [
        (&[1, 2], 1, "the stages cover layers 0..3 of a 4-layer model"),
        (&[2, 0, 2], 1, "stage 1 (layers 2..2, 1 devices) does not continue"),
        (&[4], 3, "tensor parallelism of 3 needs at least as many KV heads (2 here)"),
    ];
    for (counts, tp, want) in cases {
        let e = LocalEngine::instance(&spec(ckpt.path(), counts, tp, 0), EngineConfig::default())
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains(want), "{counts:?} x {tp}: {e}");
    }
}

/// A worker of one stage that panics mid-step (here: rank 1 of a TP=2 stage, in a
/// layer hook) fails the step at once rather than at the all-reduce's timeout, and the
/// instance answers every later step with an error naming the stop: the chip holding
/// it is down, and its supervisor restarts it.
#[test]
fn a_stage_worker_that_panics_fails_the_step_at_once_and_the_instance_stays_down() {
    use std::sync::Arc;
    use tessera_backends::instance::{LayerHook, ShardedModel};
    use tessera_backends::model::{LogitsWanted, SeqChunk};
    let ckpt = TempCkpt::tiny("panic", SynthArch::Llama, 5, None, 1);
    let mut m = ShardedModel::load(&spec(ckpt.path(), &[2, 2], 2, 0)).expect("instance");
    let prompt = tokens(6, 3, 1024);
    let slots: Vec<i32> = (0..prompt.len() as i32).collect();
    let chunk =
        [SeqChunk { tokens: &prompt, start_pos: 0, block_table: &[0], slots: &slots, logits: LogitsWanted::Last }];
    let hook: Arc<LayerHook> = Arc::new(|layer, _, heads, _, _| {
        if layer == 2 && heads.start > 0 {
            panic!("injected in layer 2's rank 1");
        }
        Ok(())
    });
    let started = std::time::Instant::now();
    let e = m.forward_observed(&chunk, Some(hook), &mut |_| Ok(())).expect_err("the step fails");
    assert!(e.to_string().contains("panicked: injected in layer 2's rank 1"), "{e}");
    assert!(started.elapsed() < tessera_backends::shard::ALL_REDUCE_TIMEOUT, "not by the all-reduce's timeout");
    let e = m.forward(&chunk).expect_err("the instance is down");
    assert!(e.to_string().contains("stopped"), "{e}");
}
