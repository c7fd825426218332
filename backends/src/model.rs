//! The Llama-family executor: loads a checkpoint onto a `Device` and runs one batched
//! forward step over the paged KV cache. A step packs many sequences, each contributing
//! a chunk of new tokens (a prefill chunk or a single decode token), which is the shape
//! continuous batching needs.
//!
//! A step can be observed layer by layer (`forward_observed`): a prefill chip streams
//! each layer's KV to its decode chip as soon as that layer is in the cache, so decode
//! can begin before the whole prefill is done (DESIGN.md §6).

use std::ops::Range;
use std::path::Path;

use tessera_kernel_abi as abi;

use crate::compat::{CompatInfo, WeightsFingerprint};
use crate::config::{ModelConfig, RopeKind};
use crate::device::{AttnBatchView, Buffer, Device};
use crate::dtype::{DType, DTypeExt, GgmlType, GgmlTypeExt, Quantize};
use crate::error::{BackendError, Result};
use crate::kv::PagedKvCache;
use crate::mmap::Placement;
use crate::shard::{AllReduce, Shard};
use crate::weights::{Checkpoint, Part};

/// A linear layer's weight `[out_features, in_features]` and optional bias.
pub struct LinearWeights {
    pub w: Buffer,
    /// The weight's type on the device: the model's float dtype or a block format.
    pub ty: GgmlType,
    /// f32 when the weight is quantized (kernel ABI 1.2), else the model's dtype.
    pub bias: Option<Buffer>,
    pub out_features: usize,
    pub in_features: usize,
}

struct LayerWeights {
    input_norm: Buffer,
    q: LinearWeights,
    k: LinearWeights,
    v: LinearWeights,
    o: LinearWeights,
    post_norm: Buffer,
    gate: LinearWeights,
    up: LinearWeights,
    down: LinearWeights,
}

/// Which logits a sequence wants from a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LogitsWanted {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// The last token's row (the next token is sampled from it).
    Last,
    /// One row per new token (scoring, tests).
    All,
}

/// One sequence's part of a step: `tokens` are appended after the `start_pos` tokens
/// already cached; `slots` are their cache slots (`kv::slot_of` of `block_table`).
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    pub slots: &'a [i32],
    pub logits: LogitsWanted,
}

/// Step-sized device buffers, grown on demand and reused across steps.
#[derive(Default)]
struct Scratch {
    bufs: Vec<Option<Buffer>>,
}

const S_RESIDUAL: usize = 0;
const S_H: usize = 1;
const S_Q: usize = 2;
const S_K: usize = 3;
const S_V: usize = 4;
const S_ATTN: usize = 5;
const S_TMP: usize = 6;
const S_GATE: usize = 7;
const S_UP: usize = 8;
const S_ACT: usize = 9;
const S_IDS: usize = 10;
const S_POS: usize = 11;
const S_SLOTS: usize = 12;
const S_QSTART: usize = 13;
const S_CTX: usize = 14;
const S_TABLES: usize = 15;
const S_ROWS: usize = 16;
const S_LOGITS: usize = 17;
/// The last layer's context lengths and block tables of the sequences that want a
/// logits row (see `forward_observed`).
const S_LAST_CTX: usize = 18;
const S_LAST_TABLES: usize = 19;
const S_COUNT: usize = 20;

/// How a checkpoint's weights are put on the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// The float type of float weights (norms, and linear layers not quantized); `None`:
    /// as stored (f32 when the embedding is quantized).
    pub dtype: Option<DType>,
    /// Quantize float linear weights to this block format. The embedding and LM head
    /// are quantized to q8_0 under either choice, as llama.cpp keeps its output tensor
    /// at more bits than the rest. Tensors already quantized (GGUF) keep their format.
    pub quantize: Option<Quantize>,
}

/// What a pipeline stage past the first takes in place of token ids: the residual
/// stream the stage before it ends with, `hidden_size` f32 values per token.
#[derive(Debug, Clone, Copy)]
pub enum StageInput<'a> {
    Tokens,
    Hidden(&'a [f32]),
}

/// A loaded model on one device: the whole model, or one shard of it (a pipeline
/// stage's layers, a tensor-parallel rank's heads and FFN columns; see [`Shard`]).
pub struct Model {
    /// The whole model's config, whatever part of it is loaded.
    config: ModelConfig,
    shard: Shard,
    /// The config as this shard holds it: its layers, heads and FFN columns.
    local: ModelConfig,
    dtype: DType,
    device: Device,
    /// On the first stage, and on the last when the LM head is the tied embedding.
    embed: Option<Buffer>,
    embed_ty: GgmlType,
    layers: Vec<LayerWeights>,
    /// The norm after this shard's last layer: the model's final norm on the last
    /// stage, else the next stage's first input norm (its output is not used: the next
    /// stage norms the residual it receives itself).
    out_norm: Buffer,
    lm_head: Option<LinearWeights>,
    rope: abi::TkRope,
    weight_bytes: u64,
    decode_read_bytes: u64,
    param_count: u64,
    weights_fingerprint: u64,
    weight_format: String,
    scratch: Scratch,
}

/// Uploads checkpoint tensors, choosing each one's device type, counting bytes and
/// parameters and fingerprinting what it loads.
struct WeightLoader<'a> {
    ckpt: &'a Checkpoint,
    device: &'a Device,
    dtype: DType,
    quantize: Option<GgmlType>,
    /// Whether weights used as stored stay in the file's map (`TESSERA_MAP_WEIGHTS`).
    placement: Placement,
    bytes: u64,
    params: u64,
    fingerprint: WeightsFingerprint,
    /// The block formats loaded (sorted, distinct).
    formats: Vec<GgmlType>,
}

impl WeightLoader<'_> {
    /// Counts a tensor of the whole model in its fingerprint, whether or not this shard
    /// loads it, so every shard of one model fingerprints alike.
    fn account(&mut self, name: &str, shape: &[usize]) -> Result<()> {
        let entry = self.ckpt.get(name, shape)?;
        self.fingerprint.add(name, shape, self.ckpt.bytes(entry), entry.ty);
        Ok(())
    }

    /// A float tensor (norms, biases) in `dtype`, loaded when `part` is given.
    fn tensor(&mut self, name: &str, shape: &[usize], dtype: DType, part: Option<&Part>) -> Result<Option<Buffer>> {
        self.account(name, shape)?;
        part.map(|p| self.load(name, shape, dtype.ggml(), p)).transpose()
    }

    /// The device type of a weight matrix: quantized as stored, else in `quantize` when
    /// set and its rows are whole blocks, else in the float dtype.
    fn matrix_type(&self, name: &str, shape: [usize; 2], quantize: Option<GgmlType>) -> Result<GgmlType> {
        let stored = self.ckpt.get(name, &shape)?.ty;
        Ok(match quantize {
            _ if stored.is_quantized() => stored,
            Some(q) if q.row_bytes(shape[1]).is_some() => q,
            _ => self.dtype.ggml(),
        })
    }

    /// A weight matrix (see [`matrix_type`](Self::matrix_type)), loaded when `part` is given.
    fn matrix(
        &mut self,
        name: &str,
        shape: [usize; 2],
        quantize: Option<GgmlType>,
        part: Option<&Part>,
    ) -> Result<(Option<Buffer>, GgmlType)> {
        let ty = self.matrix_type(name, shape, quantize)?;
        if ty.is_quantized() {
            let lib = self.device.library();
            quantized_weights_supported(lib.abi_version(), lib.path(), name, ty)?;
            if let Err(at) = self.formats.binary_search(&ty) {
                self.formats.insert(at, ty);
            }
        }
        self.account(name, &shape)?;
        Ok((part.map(|p| self.load(name, &shape, ty, p)).transpose()?, ty))
    }

    /// Puts (part of) a tensor on the device, counting its bytes and parameters.
    fn load(&mut self, name: &str, shape: &[usize], ty: GgmlType, part: &Part) -> Result<Buffer> {
        let buf = self.ckpt.upload_part(self.device, name, shape, ty, self.placement, part)?;
        self.bytes += buf.len_bytes() as u64;
        let whole: usize = shape.iter().product();
        self.params += match part {
            Part::Whole => whole,
            Part::Rows(r) => whole / shape[0].max(1) * r.len(),
            Part::Cols(c) => whole / shape[shape.len() - 1].max(1) * c.len(),
        } as u64;
        Ok(buf)
    }

    /// A linear layer `[out_features, in_features]`, loaded (as `part`) when `part` is
    /// given: a row part keeps some outputs (and their bias), a column part some inputs.
    fn linear(
        &mut self,
        name: &str,
        out_features: usize,
        in_features: usize,
        bias: bool,
        quantize: Option<GgmlType>,
        part: Option<&Part>,
    ) -> Result<Option<LinearWeights>> {
        let (w, ty) = self.matrix(&format!("{name}.weight"), [out_features, in_features], quantize, part)?;
        let bias_dtype = if ty.is_quantized() { DType::F32 } else { self.dtype };
        let bias_part = part.map(|p| match p {
            Part::Rows(r) => Part::Rows(r.clone()),
            _ => Part::Whole,
        });
        let bias = if bias {
            self.tensor(&format!("{name}.bias"), &[out_features], bias_dtype, bias_part.as_ref())?
        } else {
            None
        };
        Ok(w.map(|w| {
            let (out_features, in_features) = match part {
                Some(Part::Rows(r)) => (r.len(), in_features),
                Some(Part::Cols(c)) => (out_features, c.len()),
                _ => (out_features, in_features),
            };
            LinearWeights { w, ty, bias, out_features, in_features }
        }))
    }
}

/// Refuses quantized weights on a kernel library older than ABI 1.2 (it would not know
/// their dtype codes).
fn quantized_weights_supported(version: (u32, u32), library: &Path, name: &str, ty: GgmlType) -> Result<()> {
    let (major, minor) = version;
    // Q5_K came with 1.5, the other block formats with 1.2.
    let needs = if ty == GgmlType::Q5K { abi::TK_ABI_MINOR_Q5_K } else { abi::TK_ABI_MINOR_QUANT };
    if (major, minor) >= (abi::TK_ABI_MAJOR, needs) {
        return Ok(());
    }
    Err(BackendError::KernelLibrary {
        library: library.to_path_buf(),
        reason: format!(
            "it speaks kernel ABI {major}.{minor}; {name} is {ty}, which needs {}.{needs} or newer",
            abi::TK_ABI_MAJOR,
        ),
    })
}

/// The block format of a load-time quantization.
pub fn quantize_format(q: Quantize) -> GgmlType {
    match q {
        Quantize::Q8_0 => GgmlType::Q8_0,
        Quantize::Q4_0 => GgmlType::Q4_0,
    }
}

impl LinearWeights {
    fn bytes(&self) -> u64 {
        (self.w.len_bytes() + self.bias.as_ref().map_or(0, Buffer::len_bytes)) as u64
    }
}

impl LayerWeights {
    /// Bytes a step reads of this layer.
    fn bytes(&self) -> u64 {
        let linears = [&self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down];
        linears.iter().map(|l| l.bytes()).sum::<u64>()
            + (self.input_norm.len_bytes() + self.post_norm.len_bytes()) as u64
    }
}

fn rope_params(config: &ModelConfig) -> abi::TkRope {
    let mut rope =
        abi::TkRope { theta: config.rope_theta, scaling: abi::TK_ROPE_NONE, factor: 1.0, ..Default::default() };
    match config.rope {
        RopeKind::None => {}
        RopeKind::Linear { factor } => {
            rope.scaling = abi::TK_ROPE_LINEAR;
            rope.factor = factor;
        }
        RopeKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            rope.scaling = abi::TK_ROPE_LLAMA3;
            rope.factor = factor;
            rope.low_freq_factor = low_freq_factor;
            rope.high_freq_factor = high_freq_factor;
            rope.original_max_position = original_max_position;
        }
    }
    rope
}

impl Model {
    /// Loads the checkpoint in `dir` onto `device`, with float weights as `dtype`
    /// (None = as stored). Every tensor is checked for presence, shape and dtype first.
    pub fn load(dir: &Path, device: Device, dtype: Option<DType>) -> Result<Model> {
        Model::load_with(dir, device, LoadOptions { dtype, quantize: None })
    }

    /// [`load`](Self::load) with every option.
    pub fn load_with(dir: &Path, device: Device, options: LoadOptions) -> Result<Model> {
        Model::load_shard(dir, device, options, None)
    }

    /// [`load_with`](Self::load_with) of one shard of the model (`None`: the whole). A
    /// shard loads its layers (its rank's part of each), the embedding when it is the
    /// first stage, and the final norm and LM head when it computes logits; its
    /// fingerprint and weight format are the whole model's, so it exchanges KV with a
    /// chip holding the whole model as that chip would.
    pub fn load_shard(dir: &Path, device: Device, options: LoadOptions, shard: Option<Shard>) -> Result<Model> {
        if !crate::gguf::is_model_file(dir) {
            std::fs::read_dir(dir).map_err(|e| BackendError::io(dir, e))?;
        }
        let config = ModelConfig::from_dir(dir)?;
        let shard = shard.unwrap_or_else(|| Shard::whole(&config));
        shard.check(&config)?;
        let ckpt = Checkpoint::open(dir)?;
        let (h, v) = (config.hidden_size, config.vocab_size);
        let dtype = match options.dtype {
            Some(d) => d,
            None => ckpt.get("model.embed_tokens.weight", &[v, h])?.ty.float().unwrap_or(DType::F32),
        };
        let quantize = options.quantize.map(quantize_format);
        // The embedding and LM head: never below 8 bits (see `LoadOptions::quantize`).
        let quantize_head = options.quantize.map(|_| GgmlType::Q8_0);
        let mut ld = WeightLoader {
            ckpt: &ckpt,
            device: &device,
            dtype,
            quantize,
            placement: Placement::from_env()?,
            bytes: 0,
            params: 0,
            fingerprint: WeightsFingerprint::new(),
            formats: Vec::new(),
        };
        let (hd, inter) = (config.head_dim, config.intermediate_size);
        let qd = config.num_heads * hd;
        let kvd = config.num_kv_heads * hd;
        // A rank's rows of Q/K/V and gate/up, its columns of O and down.
        let heads = shard.heads(&config);
        let down_ty = ld.matrix_type("model.layers.0.mlp.down_proj.weight", [h, inter], quantize)?;
        let ffn = shard.ffn(&config, down_ty.block_elements() as usize)?;
        let tp = shard.tp_size > 1;
        let rows = |r: &Range<usize>| if tp { Part::Rows(r.start * hd..r.end * hd) } else { Part::Whole };
        let (q_part, kv_part) = (rows(&heads.q), rows(&heads.kv));
        let o_part = if tp { Part::Cols(heads.q.start * hd..heads.q.end * hd) } else { Part::Whole };
        let (up_part, down_part) =
            if tp { (Part::Rows(ffn.clone()), Part::Cols(ffn.clone())) } else { (Part::Whole, Part::Whole) };
        let logits = shard.computes_logits(&config);
        let tied = config.tie_word_embeddings && !ckpt.contains("lm_head.weight");
        let whole = Part::Whole;
        let embed_part = (shard.is_first() || (logits && tied)).then_some(&whole);
        let (embed, embed_ty) = ld.matrix("model.embed_tokens.weight", [v, h], quantize_head, embed_part)?;
        let mut layers = Vec::with_capacity(shard.layers.len());
        let mut read = 0u64;
        let unloaded = |name: &str| BackendError::Shard(format!("tensor {name:?} was not loaded"));
        for i in 0..config.num_layers {
            let p = format!("model.layers.{i}");
            let here = shard.layers.contains(&i);
            let part = |part: &Part| here.then(|| part.clone());
            let (b, q) = (config.qkv_bias, ld.quantize);
            let input_norm = ld.tensor(&format!("{p}.input_layernorm.weight"), &[h], dtype, part(&whole).as_ref())?;
            let wq = ld.linear(&format!("{p}.self_attn.q_proj"), qd, h, b, q, part(&q_part).as_ref())?;
            let wk = ld.linear(&format!("{p}.self_attn.k_proj"), kvd, h, b, q, part(&kv_part).as_ref())?;
            let wv = ld.linear(&format!("{p}.self_attn.v_proj"), kvd, h, b, q, part(&kv_part).as_ref())?;
            let wo = ld.linear(&format!("{p}.self_attn.o_proj"), h, qd, false, q, part(&o_part).as_ref())?;
            let post_norm =
                ld.tensor(&format!("{p}.post_attention_layernorm.weight"), &[h], dtype, part(&whole).as_ref())?;
            let gate = ld.linear(&format!("{p}.mlp.gate_proj"), inter, h, false, q, part(&up_part).as_ref())?;
            let up = ld.linear(&format!("{p}.mlp.up_proj"), inter, h, false, q, part(&up_part).as_ref())?;
            let down = ld.linear(&format!("{p}.mlp.down_proj"), h, inter, false, q, part(&down_part).as_ref())?;
            if !here {
                continue;
            }
            let layer = LayerWeights {
                input_norm: input_norm.ok_or_else(|| unloaded(&p))?,
                q: wq.ok_or_else(|| unloaded(&p))?,
                k: wk.ok_or_else(|| unloaded(&p))?,
                v: wv.ok_or_else(|| unloaded(&p))?,
                o: wo.ok_or_else(|| unloaded(&p))?,
                post_norm: post_norm.ok_or_else(|| unloaded(&p))?,
                gate: gate.ok_or_else(|| unloaded(&p))?,
                up: up.ok_or_else(|| unloaded(&p))?,
                down: down.ok_or_else(|| unloaded(&p))?,
            };
            read += layer.bytes();
            layers.push(layer);
        }
        let last = shard.is_last(&config);
        let norm = ld.tensor("model.norm.weight", &[h], dtype, last.then_some(&whole))?;
        let out_norm = match norm {
            Some(norm) => norm,
            // The next stage's first input norm: loaded, not counted in the fingerprint
            // (that stage counts it).
            None => ld.load(
                &format!("model.layers.{}.input_layernorm.weight", shard.layers.end),
                &[h],
                dtype.ggml(),
                &whole,
            )?,
        };
        // Tied checkpoints may still ship an lm_head copy; use it if present.
        let lm_head =
            if tied { None } else { ld.linear("lm_head", v, h, false, quantize_head, logits.then_some(&whole))? };
        // A decode step reads every layer, the final norm and the LM head (the tied
        // embedding when there is none), plus one embedding row per token.
        read += out_norm.len_bytes() as u64;
        if logits {
            read += lm_head.as_ref().map_or(embed.as_ref().map_or(0, |e| e.len_bytes() as u64), LinearWeights::bytes);
        }
        let weight_format = if ld.formats.is_empty() {
            "float".to_owned()
        } else {
            ld.formats.iter().map(|t| t.lower_name()).collect::<Vec<_>>().join("+")
        };
        let (weight_bytes, param_count, weights_fingerprint) = (ld.bytes, ld.params, ld.fingerprint.finish());
        let rope = rope_params(&config);
        let mut local = config.clone();
        local.num_layers = shard.layers.len();
        local.num_heads = heads.q.len();
        local.num_kv_heads = heads.kv.len();
        local.intermediate_size = ffn.len();
        Ok(Model {
            config,
            shard,
            local,
            dtype,
            device,
            embed,
            embed_ty,
            layers,
            out_norm,
            lm_head,
            rope,
            weight_bytes,
            decode_read_bytes: read,
            param_count,
            weights_fingerprint,
            weight_format,
            scratch: Scratch::default(),
        })
    }

    /// The part of the model this one holds.
    pub fn shard(&self) -> &Shard {
        &self.shard
    }

    /// The config as this shard holds it (its layers, heads and FFN columns): what its
    /// KV cache is made for. The whole model's config for a whole model.
    pub fn shard_config(&self) -> &ModelConfig {
        &self.local
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The dtype the weights are held in on the device.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of weights resident on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Bytes of weights one decode step reads: every layer's weights and norms, the
    /// final norm and the LM head (or the tied embedding), in their device types. The
    /// embedding rows a step looks up are not counted (a few KiB).
    pub fn decode_read_bytes(&self) -> u64 {
        self.decode_read_bytes
    }

    /// The block formats of the weights on the device, sorted and joined by `+`
    /// (`q4_1+q8_0`), or `float` when none is quantized.
    pub fn weight_format(&self) -> &str {
        &self.weight_format
    }

    /// Parameters loaded (every tensor, embeddings and norms included; a tied LM head
    /// counted once). A forward step costs about `2 * config().linear_params()` FLOPs
    /// per token; this is what sizes memory traffic in a roofline model.
    pub fn param_count(&self) -> u64 {
        self.param_count
    }

    /// A fingerprint of the loaded tensors (see [`WeightsFingerprint`]).
    pub fn weights_fingerprint(&self) -> u64 {
        self.weights_fingerprint
    }

    /// What a peer chip must match to exchange KV with this one.
    pub fn compat_info(&self) -> CompatInfo {
        CompatInfo::from_config(&self.config)
            .with_weights(self.weights_fingerprint)
            .with_weight_format(&self.weight_format)
    }

    /// Grows the step buffers to hold `tokens` tokens, `seqs` sequences with tables of
    /// `table` entries, and `rows` logits rows.
    fn ensure_scratch(&mut self, tokens: usize, seqs: usize, table: usize, rows: usize) -> Result<()> {
        let c = &self.local;
        let (h, qd, kvd, i) =
            (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        let mut sizes = [0usize; S_COUNT];
        for (slot, per_token) in [
            (S_RESIDUAL, h),
            (S_H, h),
            (S_Q, qd),
            (S_K, kvd),
            (S_V, kvd),
            (S_ATTN, qd),
            (S_TMP, h),
            (S_GATE, i),
            (S_UP, i),
            (S_ACT, i),
            (S_IDS, 1),
            (S_POS, 1),
            (S_SLOTS, 1),
        ] {
            sizes[slot] = 4 * per_token * tokens;
        }
        sizes[S_QSTART] = 4 * (seqs + 1);
        sizes[S_CTX] = 4 * seqs;
        sizes[S_TABLES] = 4 * seqs * table.max(1);
        sizes[S_LAST_CTX] = sizes[S_CTX];
        sizes[S_LAST_TABLES] = sizes[S_TABLES];
        sizes[S_ROWS] = 4 * h * rows.max(1);
        sizes[S_LOGITS] = 4 * c.vocab_size * rows.max(1);
        let scratch = &mut self.scratch;
        scratch.bufs.resize_with(S_COUNT, || None);
        for (slot, &need) in sizes.iter().enumerate() {
            let fits = scratch.bufs[slot].as_ref().is_some_and(|b| b.len_bytes() >= need);
            if !fits {
                // Grow geometrically so a slowly growing batch does not reallocate every step.
                let have = scratch.bufs[slot].as_ref().map_or(0, |b| b.len_bytes());
                scratch.bufs[slot] = None;
                scratch.bufs[slot] = Some(self.device.alloc(need.max(have * 3 / 2))?);
            }
        }
        Ok(())
    }

    /// Runs one forward step over `batch` and returns the requested logits rows, in
    /// batch order, `vocab_size` floats each.
    pub fn forward(&mut self, kv: &PagedKvCache, batch: &[SeqChunk<'_>]) -> Result<Vec<f32>> {
        self.forward_observed(kv, batch, &mut |_, _| Ok(()))
    }

    /// [`forward`](Self::forward), calling `on_layer(li, device)` right after layer
    /// `li`'s K and V of this step are in `kv` (before its attention runs), so the
    /// observer can stage them (e.g. `PagedKvCache::read_blocks`) while later layers
    /// compute. Device copies are ordered after the ops already issued, so a read from
    /// the observer sees the layer's new KV. An error from the observer ends the step
    /// with that error; layers before it keep the KV they wrote.
    pub fn forward_observed(
        &mut self,
        kv: &PagedKvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut dyn FnMut(usize, &Device) -> Result<()>,
    ) -> Result<Vec<f32>> {
        if self.shard != Shard::whole(&self.config) {
            return Err(BackendError::Shard(format!(
                "a forward pass of the whole model on a shard of layers {:?}, rank {} of {}",
                self.shard.layers, self.shard.tp_rank, self.shard.tp_size
            )));
        }
        self.forward_stage(kv, batch, StageInput::Tokens, on_layer, None)
    }

    /// One forward step of this shard. The first stage embeds the batch's tokens; a
    /// later one takes the residual stream of the stage before (`input`). The batch's
    /// chunks are the whole step's either way (positions, slots and logits wanted), and
    /// `kv` holds this shard's layers (`on_layer` gets the shard's own layer index).
    /// Tensor-parallel ranks join their O and down projections' partial sums through
    /// `reduce`, each rank calling this with the same batch. Returns the logits rows
    /// wanted on the shard that computes logits, the residual stream (`hidden_size` f32
    /// values per token) on a stage before the last, and nothing on the last stage's
    /// other ranks.
    pub fn forward_stage(
        &mut self,
        kv: &PagedKvCache,
        batch: &[SeqChunk<'_>],
        input: StageInput<'_>,
        on_layer: &mut dyn FnMut(usize, &Device) -> Result<()>,
        mut reduce: Option<&mut dyn AllReduce>,
    ) -> Result<Vec<f32>> {
        let c = self.local.clone();
        let f = kv.format();
        if (f.num_layers, f.num_kv_heads, f.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim) {
            return Err(BackendError::Request(format!(
                "the KV cache ({f}) was not made for this model ({} layers x {} kv heads x {} dims)",
                c.num_layers, c.num_kv_heads, c.head_dim
            )));
        }
        if (self.shard.tp_size > 1) != reduce.is_some() {
            return Err(BackendError::Shard(format!(
                "a rank of a tensor-parallel group of {} steps {} an all-reduce",
                self.shard.tp_size,
                if reduce.is_some() { "with" } else { "without" }
            )));
        }
        let num_seqs = batch.len();
        let total: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if num_seqs == 0 || total == 0 {
            return Err(BackendError::Request("a forward step needs at least one token".into()));
        }
        let bs = kv.config().block_size;
        let mut ids = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut slots = Vec::with_capacity(total);
        let mut query_start = Vec::with_capacity(num_seqs + 1);
        let mut ctx_lens = Vec::with_capacity(num_seqs);
        let mut rows = Vec::new();
        let max_blocks = batch.iter().map(|s| s.block_table.len()).max().unwrap_or(0);
        let mut tables = vec![0i32; num_seqs * max_blocks.max(1)];
        query_start.push(0i32);
        for (si, s) in batch.iter().enumerate() {
            let ctx = s.start_pos + s.tokens.len();
            if s.tokens.is_empty() || s.slots.len() != s.tokens.len() || s.block_table.len() * bs < ctx {
                return Err(BackendError::Request(format!(
                    "sequence {si} of the step: {} tokens, {} slots, {} blocks of {bs} for {ctx} positions",
                    s.tokens.len(),
                    s.slots.len(),
                    s.block_table.len()
                )));
            }
            if ctx > c.max_context {
                return Err(BackendError::Request(format!(
                    "sequence of {ctx} tokens exceeds the model's context of {}",
                    c.max_context
                )));
            }
            for (j, &t) in s.tokens.iter().enumerate() {
                if t as usize >= c.vocab_size {
                    return Err(BackendError::Request(format!(
                        "token id {t} is outside the vocabulary ({})",
                        c.vocab_size
                    )));
                }
                // A slot off the sequence's own blocks would overwrite another's KV.
                let pos = s.start_pos + j;
                let expected = s.block_table[pos / bs] as usize * bs + pos % bs;
                if s.slots[j] < 0 || s.slots[j] as usize != expected {
                    return Err(BackendError::Request(format!(
                        "sequence {si} of the step: slot {} for position {pos} is not in its block table (expected {expected})",
                        s.slots[j]
                    )));
                }
                ids.push(t as i32);
                positions.push((s.start_pos + j) as i32);
            }
            slots.extend_from_slice(s.slots);
            let first = query_start[si] as usize;
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => rows.push(first + s.tokens.len() - 1),
                LogitsWanted::All => rows.extend(first..first + s.tokens.len()),
            }
            query_start.push((first + s.tokens.len()) as i32);
            ctx_lens.push(ctx as i32);
            for (b, &blk) in s.block_table.iter().enumerate() {
                tables[si * max_blocks + b] = blk as i32;
            }
        }
        self.ensure_scratch(total, num_seqs, max_blocks, rows.len())?;
        let buf = |slot: usize| self.scratch.bufs[slot].as_ref().map(|b| b.view());
        let [
            Some(residual),
            Some(hbuf),
            Some(q),
            Some(k),
            Some(v),
            Some(attn),
            Some(tmp),
            Some(gate),
            Some(up),
            Some(act),
            Some(ids_b),
            Some(pos_b),
            Some(slots_b),
            Some(qs_b),
            Some(ctx_b),
            Some(tab_b),
            Some(rows_b),
            Some(logits_b),
            Some(last_ctx_b),
            Some(last_tab_b),
        ] = std::array::from_fn::<_, S_COUNT, _>(buf)
        else {
            return Err(BackendError::Request("scratch buffers were not allocated".into()));
        };
        let dev = &self.device;
        dev.write(ids_b, &ids)?;
        dev.write(pos_b, &positions)?;
        dev.write(slots_b, &slots)?;
        dev.write(qs_b, &query_start)?;
        dev.write(ctx_b, &ctx_lens)?;
        dev.write(tab_b, &tables)?;
        // Past the last layer's K and V only the rows whose logits are wanted matter.
        // Where each sequence wants at most its last row, the rest of that layer (its
        // attention, o projection and MLP: 90% of the bench model's layer weights) runs
        // on those rows alone, each as a one-token decode query over its whole context.
        // A 178-token prompt of the bench model then does 6.4% fewer FLOPs (1,428 ->
        // 1,343 ms). A step that wants no row stops after the last layer's K and V.
        let last_stage = self.shard.is_last(&self.config);
        let narrow_last = last_stage
            && rows.len() < total
            && batch.iter().all(|s| s.tokens.len() == 1 || !matches!(s.logits, LogitsWanted::All));
        if narrow_last && !rows.is_empty() {
            let kept: Vec<usize> = (0..num_seqs).filter(|&si| batch[si].logits != LogitsWanted::None).collect();
            let ctx: Vec<i32> = kept.iter().map(|&si| ctx_lens[si]).collect();
            let tab: Vec<i32> = kept.iter().flat_map(|&si| &tables[si * max_blocks..][..max_blocks]).copied().collect();
            dev.write(last_ctx_b, &ctx)?;
            dev.write(last_tab_b, &tab)?;
        }
        let t = total as u32;
        let (h, nh, nkv, hd) = (c.hidden_size as u32, c.num_heads as u32, c.num_kv_heads as u32, c.head_dim as u32);
        let eps = c.rms_norm_eps;
        let dt = self.dtype;
        let lin = |out, x, w: &LinearWeights, m: u32| {
            dev.linear(
                out,
                x,
                w.w.view(),
                w.ty,
                w.bias.as_ref().map(|b| b.view()),
                m,
                w.out_features as u32,
                w.in_features as u32,
            )
        };
        let all_decode = batch.iter().all(|s| s.tokens.len() == 1);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        match (input, &self.embed) {
            (StageInput::Tokens, Some(embed)) if self.shard.is_first() => {
                dev.embedding(residual, embed.view(), self.embed_ty, ids_b, t, h, c.vocab_size as u32)?
            }
            (StageInput::Hidden(hidden), _) if !self.shard.is_first() && hidden.len() == total * c.hidden_size => {
                dev.write(residual, hidden)?
            }
            (StageInput::Hidden(hidden), _) if !self.shard.is_first() => {
                return Err(BackendError::Shard(format!(
                    "the stage of layers {:?} got {} hidden values for {total} tokens of {}",
                    self.shard.layers,
                    hidden.len(),
                    c.hidden_size
                )));
            }
            _ => {
                return Err(BackendError::Shard(format!(
                    "the stage of layers {:?} takes {}",
                    self.shard.layers,
                    if self.shard.is_first() { "tokens" } else { "the stage before's hidden states" }
                )));
            }
        }
        dev.rms_norm(hbuf, residual, self.layers[0].input_norm.view(), dt, t, h, eps)?;
        for (li, layer) in self.layers.iter().enumerate() {
            lin(q, hbuf, &layer.q, t)?;
            lin(k, hbuf, &layer.k, t)?;
            lin(v, hbuf, &layer.v, t)?;
            dev.apply_rotary_pos_emb(q, k, pos_b, t, nh, nkv, hd, &self.rope)?;
            let cache = kv.layer_view(li);
            dev.fill_kv_cache(&cache, k, v, slots_b, t)?;
            on_layer(li, dev)?;
            // The rows this layer carries on with.
            let mut m = t;
            if narrow_last && li + 1 == self.layers.len() {
                if rows.is_empty() {
                    break;
                }
                // Gathered to the front in place: row `dst` comes from row `rows[dst]`
                // >= dst, which no earlier copy wrote.
                for (buf, width) in [(q, c.num_heads * c.head_dim), (residual, c.hidden_size)] {
                    for (dst, &src) in rows.iter().enumerate().filter(|(d, s)| d != *s) {
                        dev.copy(buf.offset_by(dst * width * 4), buf.offset_by(src * width * 4), width * 4)?;
                    }
                }
                m = rows.len() as u32;
                dev.paged_decode_attention(attn, q, &cache, last_tab_b, last_ctx_b, m, max_blocks as u32, nh, scale)?;
            } else if all_decode {
                dev.paged_decode_attention(
                    attn,
                    q,
                    &cache,
                    tab_b,
                    ctx_b,
                    num_seqs as u32,
                    max_blocks as u32,
                    nh,
                    scale,
                )?;
            } else {
                let ab = AttnBatchView {
                    num_seqs: num_seqs as u32,
                    max_blocks_per_seq: max_blocks as u32,
                    query_start: qs_b,
                    context_lens: ctx_b,
                    block_tables: tab_b,
                };
                dev.prefill_attention(attn, q, &cache, &ab, t, nh, scale)?;
            }
            lin(tmp, attn, &layer.o, m)?;
            if let Some(group) = reduce.as_deref_mut() {
                group.all_reduce(dev, tmp, m as usize * c.hidden_size)?;
            }
            dev.add_rms_norm(residual, tmp, layer.post_norm.view(), dt, hbuf, m, h, eps)?;
            lin(gate, hbuf, &layer.gate, m)?;
            lin(up, hbuf, &layer.up, m)?;
            dev.silu_and_mul(act, gate, up, m, c.intermediate_size as u32)?;
            lin(tmp, act, &layer.down, m)?;
            if let Some(group) = reduce.as_deref_mut() {
                group.all_reduce(dev, tmp, m as usize * c.hidden_size)?;
            }
            let next_norm = self.layers.get(li + 1).map_or(&self.out_norm, |l| &l.input_norm);
            dev.add_rms_norm(residual, tmp, next_norm.view(), dt, hbuf, m, h, eps)?;
        }
        if !last_stage {
            return dev.read_vec(residual, total * c.hidden_size);
        }
        if rows.is_empty() || !self.shard.computes_logits(&self.config) {
            return Ok(Vec::new());
        }
        let row_bytes = 4 * c.hidden_size;
        let (rows_in, r) = if rows.len() == total || narrow_last {
            (hbuf, rows.len() as u32)
        } else {
            for (dst, &src) in rows.iter().enumerate() {
                dev.copy(rows_b.offset_by(dst * row_bytes), hbuf.offset_by(src * row_bytes), row_bytes)?;
            }
            (rows_b, rows.len() as u32)
        };
        let vocab = c.vocab_size as u32;
        match (&self.lm_head, &self.embed) {
            (Some(head), _) => lin(logits_b, rows_in, head, r)?,
            (None, Some(embed)) => dev.linear(logits_b, rows_in, embed.view(), self.embed_ty, None, r, vocab, h)?,
            (None, None) => return Err(BackendError::Shard("the shard that computes logits has no LM head".into())),
        }
        dev.read_vec(logits_b, rows.len() * c.vocab_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_older_than_abi_1_2_is_refused_quantized_weights() {
        let lib = Path::new("/opt/vendor/libold.so");
        let e = quantized_weights_supported((1, 1), lib, "model.layers.0.mlp.up_proj.weight", GgmlType::Q4_1)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "kernel library /opt/vendor/libold.so: it speaks kernel ABI 1.1; \
             model.layers.0.mlp.up_proj.weight is Q4_1, which needs 1.2 or newer"
        );
        assert!(quantized_weights_supported((1, 2), lib, "w", GgmlType::Q8_0).is_ok());
        let e = quantized_weights_supported((1, 4), lib, "w", GgmlType::Q5K).unwrap_err().to_string();
        assert!(e.ends_with("w is Q5_K, which needs 1.5 or newer"), "{e}");
        assert!(quantized_weights_supported((1, 5), lib, "w", GgmlType::Q5K).is_ok());
    }
}
