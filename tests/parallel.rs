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
use tessera_backends::shard::{AllReduce, Collectives, LibraryGroup, LocalGroup, boxed};
use tessera_backends::synth::SynthArch;
use tessera_chip_executor::local::{EngineConfig, LocalEngine};

use crate::common::{TempCkpt, device, tokens};

const BLOCK: usize = 8;

/// An instance of `counts` layers per stage, `tp` ranks per stage, each device under
/// `memory_limit_bytes` (0: none).
fn spec(dir: &Path, counts: &[usize], tp: usize, memory_limit_bytes: u64) -> InstanceSpec {
    spec_with(dir, counts, tp, memory_limit_bytes, Collectives::Library)
}

fn spec_with(
    dir: &Path,
    counts: &[usize],
    tp: usize,
    memory_limit_bytes: u64,
    collectives: Collectives,
) -> InstanceSpec {
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
        collectives,
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

/// The stages' ranks join through the CPU library's collectives (ABI 1.4) by default,
/// and the host's all-reduce gives the same tokens: both add the ranks in rank order.
#[test]
fn tensor_parallel_ranks_join_through_the_librarys_collectives_or_the_hosts_alike() {
    use tessera_backends::instance::ShardedModel;
    let ckpt = TempCkpt::tiny("collectives", SynthArch::Llama, 8, None, 1);
    let lib = ShardedModel::load(&spec(ckpt.path(), &[2, 2], 2, 0)).expect("instance");
    assert_eq!(lib.all_reduce(), ["library", "library"]);
    drop(lib);
    let host = spec_with(ckpt.path(), &[2, 2], 2, 0, Collectives::Host);
    assert_eq!(ShardedModel::load(&host).expect("instance").all_reduce(), ["host", "host"]);
    let one = ShardedModel::load(&spec(ckpt.path(), &[1, 3], 1, 0)).expect("instance");
    assert_eq!(one.all_reduce(), ["none", "none"]);
    drop(one);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| tokens(9 + 5 * i, 70 + i as u64, 1024)).collect();
    let want = sharded(&host, &prompts, 10);
    assert_eq!(
        sharded(&spec(ckpt.path(), &[4], 2, 0), &prompts, 10),
        sharded(&spec_with(ckpt.path(), &[4], 2, 0, Collectives::Host), &prompts, 10)
    );
    assert_eq!(sharded(&spec(ckpt.path(), &[2, 2], 2, 0), &prompts, 10), want);
}

/// The library's all-reduce and the host's end with the same bits on every rank, for
/// 2 and 3 ranks and sizes that do not divide evenly; a rank that fails ends the
/// others' waits through the library's abort.
#[test]
fn the_librarys_all_reduce_adds_in_rank_order_like_the_hosts() {
    use tessera_backends::device::Device;
    use tessera_backends::loader::KernelLibrary;
    let lib = KernelLibrary::load_default().expect("CPU kernel library");
    assert!(lib.has_collectives(), "the CPU library speaks ABI 1.4's collectives");
    let reduce = |groups: Vec<Box<dyn AllReduce + Send>>, n: usize| -> Vec<Vec<u32>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, mut g)| {
                    let lib = &lib;
                    scope.spawn(move || {
                        let dev = Device::open(lib, &DeviceConfig { threads: 1, ..Default::default() }).unwrap();
                        let data: Vec<f32> = (0..n).map(|i| ((i * 31 + rank * 17) % 23) as f32 * 0.37 - 3.1).collect();
                        let buf = dev.upload(&data).unwrap();
                        g.all_reduce(&dev, buf.view(), n).unwrap();
                        let out: Vec<f32> = dev.read_vec(buf.view(), n).unwrap();
                        out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    for (ranks, n) in [(2, 1), (2, 577), (3, 5), (3, 4096)] {
        let host = reduce(boxed(LocalGroup::new(ranks)), n);
        let native = reduce(boxed(LibraryGroup::new(&lib, ranks).unwrap()), n);
        assert!(host.iter().all(|r| *r == host[0]), "every rank holds the same sum");
        assert_eq!(native, host, "{ranks} ranks, {n} values");
    }

    let mut groups = LibraryGroup::new(&lib, 2).unwrap();
    let survivor = groups.remove(0);
    let failed = groups.remove(0);
    let started = std::time::Instant::now();
    let waiter = std::thread::spawn({
        let lib = lib.clone();
        move || {
            let mut g = survivor;
            let dev = Device::open(&lib, &DeviceConfig { threads: 1, ..Default::default() }).unwrap();
            let buf = dev.upload(&[1.0f32; 8]).unwrap();
            g.all_reduce(&dev, buf.view(), 8).map_err(|e| e.to_string())
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    failed.abort("rank 1 failed");
    let e = waiter.join().unwrap().expect_err("the survivor's wait ends with an error");
    assert!(e.contains("aborted"), "{e}");
    assert!(started.elapsed() < tessera_backends::shard::ALL_REDUCE_TIMEOUT);
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
    // One prompt at a time, as `tessera generate` runs it: on a CPU whose quantized
    // kernels take another path for a batch of several sequences than for one (AVX2),
    // a batched step's logits differ in their last bits from one sequence's, and a
    // near-tie may flip; a pipeline's micro-batches hold one sequence each here.
    for prompt in &prompts {
        let one = std::slice::from_ref(prompt);
        let want = whole(&path, one, 8);
        for (counts, tp) in shapes(30) {
            let got = sharded(&spec(&path, &counts, tp, 0), one, 8);
            assert_eq!(got, want, "stages {counts:?} x tp {tp}");
        }
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
    // Whichever the next step meets first: the stopped worker, or its group aborted.
    let e = m.forward(&chunk).expect_err("the instance is down").to_string();
    assert!(e.contains("stopped") || e.contains("all-reduce aborted"), "{e}");
}

/// A stage on another host: a stage server (here on a loopback port, as another host's
/// node runs it) loads stage 1 as a part of the instance; the instance sends it each
/// micro-batch's activations over the link and gets the logits back. Greedy tokens
/// equal the whole model's, the pool ends all-free; when the link breaks mid-run (the
/// stage's host dies), the step fails naming the link and the instance stays down.
#[test]
fn a_stage_on_another_host_runs_over_its_link_and_a_broken_link_downs_the_instance() {
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};
    use tessera_backends::instance::{RemoteStage, ShardedModel};
    use tessera_backends::model::{LogitsWanted, SeqChunk};
    use tessera_backends::stage_link::serve_connection;

    let ckpt = TempCkpt::tiny("remote-stage", SynthArch::Llama, 11, None, 1);
    let dir = ckpt.path().to_path_buf();
    // Serves `conns` connections; each server end is kept so the test can cut it.
    let server = |counts: Vec<usize>, tp: usize, conns: usize| {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let addr = listener.local_addr().unwrap();
        let ends = Arc::new(Mutex::new(Vec::new()));
        let (dir, kept) = (dir.clone(), ends.clone());
        let thread = std::thread::spawn(move || {
            let links: Vec<_> = (0..conns)
                .map(|_| {
                    let (stream, _) = listener.accept().expect("the instance connects");
                    kept.lock().unwrap().push(stream.try_clone().unwrap());
                    let (dir, counts) = (dir.clone(), counts.clone());
                    std::thread::spawn(move || {
                        let resolve = |instance: &str, stage: usize| {
                            assert_eq!(instance, "pp");
                            let mut one = spec(&dir, &counts, tp, 0);
                            one.stages = vec![one.stages.swap_remove(stage)];
                            Ok(one)
                        };
                        // Ends when the instance drops its link (or the test cuts it).
                        let _ = serve_connection(stream, &resolve, None);
                    })
                })
                .collect();
            for link in links {
                link.join().unwrap();
            }
        });
        (addr, ends, thread)
    };
    let remote_spec = |counts: &[usize], tp: usize, addr| {
        let mut s = spec(&dir, counts, tp, 0);
        for stage in &mut s.stages[1..] {
            stage.remote = Some(RemoteStage { addr, instance: "pp".into(), seal: None });
        }
        s
    };
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| tokens(7 + 4 * i, 90 + i as u64, 1024)).collect();
    let want = whole(&dir, &prompts, 10);
    for (counts, tp) in [(vec![1, 3], 1), (vec![2, 2], 2)] {
        let (addr, _, thread) = server(counts.clone(), tp, 1);
        let got = sharded(&remote_spec(&counts, tp, addr), &prompts, 10);
        assert_eq!(got, want, "stages {counts:?} x tp {tp}, stage 1 over the link");
        thread.join().unwrap();
    }

    // Three stages, the last two on the "other host", one link each; then cut.
    let (addr, ends, _thread) = server(vec![1, 2, 1], 1, 2);
    let mut m = ShardedModel::load(&remote_spec(&[1, 2, 1], 1, addr)).expect("instance");
    assert_eq!(m.all_reduce(), ["none", "remote", "remote"]);
    let prompt = tokens(6, 3, 1024);
    let slots: Vec<i32> = (0..prompt.len() as i32).collect();
    let chunk =
        [SeqChunk { tokens: &prompt, start_pos: 0, block_table: &[0], slots: &slots, logits: LogitsWanted::Last }];
    let logits = m.forward(&chunk).expect("a step over two links");
    assert_eq!(logits.len(), m.config().vocab_size);
    let hook: Arc<tessera_backends::instance::LayerHook> = Arc::new(|_, _, _, _, _| Ok(()));
    let e = m.forward_observed(&chunk, Some(hook), &mut |_| Ok(())).expect_err("no KV staging over a link");
    assert!(e.to_string().contains("stage 1 is on another host"), "{e}");
    for end in ends.lock().unwrap().iter() {
        end.shutdown(std::net::Shutdown::Both).unwrap();
    }
    let e = m.forward(&chunk).expect_err("the link is cut").to_string();
    assert!(e.contains(&format!("stage 1 on {addr}")) && e.contains("stage link"), "{e}");
    let e = m.forward(&chunk).expect_err("the instance stays down").to_string();
    assert!(e.contains("stopped"), "{e}");
}
