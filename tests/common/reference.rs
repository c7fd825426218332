//! A plain, unpaged, single-sequence forward pass of a Llama-family checkpoint, written
//! to be obviously correct rather than fast: every tensor is read as f32 through
//! `Checkpoint::to_f32`, held as f64, and every sum is accumulated in f64. It follows
//! Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM` step by step.

use std::path::Path;

use tessera_backends::config::{ModelConfig, RopeKind};
use tessera_backends::dtype::DType;
use tessera_backends::weights::Checkpoint;

/// `y = W x (+ b)` with `W` row-major `[out][in]`.
struct Linear {
    w: Vec<f64>,
    b: Option<Vec<f64>>,
    out: usize,
    inp: usize,
}

impl Linear {
    fn apply(&self, x: &[f64]) -> Vec<f64> {
        assert_eq!(x.len(), self.inp);
        (0..self.out)
            .map(|r| {
                let row = &self.w[r * self.inp..(r + 1) * self.inp];
                let dot: f64 = row.iter().zip(x).map(|(w, x)| w * x).sum();
                dot + self.b.as_ref().map_or(0.0, |b| b[r])
            })
            .collect()
    }
}

struct Layer {
    input_norm: Vec<f64>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    post_norm: Vec<f64>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// The reference model.
pub struct Reference {
    pub cfg: ModelConfig,
    embed: Vec<f64>,
    layers: Vec<Layer>,
    norm: Vec<f64>,
    /// `[vocab][hidden]`: `lm_head.weight`, or the embedding when tied.
    head: Vec<f64>,
    /// Per rotary pair `i` in `0..head_dim/2`, after scaling.
    inv_freq: Vec<f64>,
}

/// Rounds `v` to `dtype` and back (what loading the weights as `dtype` does to them).
fn round_to(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => v,
        DType::F16 => half::f16::from_f32(v).to_f32(),
        DType::Bf16 => half::bf16::from_f32(v).to_f32(),
    }
}

/// HF `inv_freq` for `rope`: `theta^(-2i/d)`, then linear or Llama-3 scaling as in
/// `_compute_linear_scaling_rope_parameters` / `_compute_llama3_parameters`.
pub fn inv_freq(head_dim: usize, theta: f64, rope: RopeKind) -> Vec<f64> {
    let base: Vec<f64> = (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
    match rope {
        RopeKind::None => base,
        RopeKind::Linear { factor } => base.iter().map(|f| f / factor as f64).collect(),
        RopeKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            let (factor, low, high) = (factor as f64, low_freq_factor as f64, high_freq_factor as f64);
            let old_ctx = original_max_position as f64;
            let low_freq_wavelen = old_ctx / low;
            let high_freq_wavelen = old_ctx / high;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (old_ctx / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

impl Reference {
    /// The checkpoint in `dir` with its weights as stored.
    pub fn load(dir: &Path) -> Reference {
        Self::load_rounded(dir, DType::F32)
    }

    /// The checkpoint in `dir` with every weight rounded to `dtype` first (the
    /// reference for a model loaded with `Some(dtype)`).
    pub fn load_rounded(dir: &Path, dtype: DType) -> Reference {
        let cfg = ModelConfig::from_dir(dir).expect("config.json");
        let ckpt = Checkpoint::open(dir).expect("checkpoint");
        let t = |name: &str, shape: &[usize]| -> Vec<f64> {
            let v = ckpt.to_f32(name, shape).unwrap_or_else(|e| panic!("{name}: {e}"));
            v.into_iter().map(|x| round_to(x, dtype) as f64).collect()
        };
        let lin = |name: &str, out: usize, inp: usize, bias: bool| Linear {
            w: t(&format!("{name}.weight"), &[out, inp]),
            b: bias.then(|| t(&format!("{name}.bias"), &[out])),
            out,
            inp,
        };
        let (h, v, i) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let qd = cfg.num_heads * cfg.head_dim;
        let kvd = cfg.num_kv_heads * cfg.head_dim;
        let layers = (0..cfg.num_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                Layer {
                    input_norm: t(&format!("{p}.input_layernorm.weight"), &[h]),
                    q: lin(&format!("{p}.self_attn.q_proj"), qd, h, cfg.qkv_bias),
                    k: lin(&format!("{p}.self_attn.k_proj"), kvd, h, cfg.qkv_bias),
                    v: lin(&format!("{p}.self_attn.v_proj"), kvd, h, cfg.qkv_bias),
                    o: lin(&format!("{p}.self_attn.o_proj"), h, qd, false),
                    post_norm: t(&format!("{p}.post_attention_layernorm.weight"), &[h]),
                    gate: lin(&format!("{p}.mlp.gate_proj"), i, h, false),
                    up: lin(&format!("{p}.mlp.up_proj"), i, h, false),
                    down: lin(&format!("{p}.mlp.down_proj"), h, i, false),
                }
            })
            .collect();
        let embed = t("model.embed_tokens.weight", &[v, h]);
        let head = if ckpt.contains("lm_head.weight") {
            t("lm_head.weight", &[v, h])
        } else {
            assert!(cfg.tie_word_embeddings, "untied checkpoint without lm_head.weight");
            embed.clone()
        };
        let norm = t("model.norm.weight", &[h]);
        let inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta as f64, cfg.rope);
        Reference { cfg, embed, layers, norm, head, inv_freq }
    }

    /// `x / sqrt(mean(x²) + eps) * w`.
    fn rms_norm(&self, x: &[f64], w: &[f64]) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + self.cfg.rms_norm_eps as f64).sqrt();
        x.iter().zip(w).map(|(x, w)| x * inv * w).collect()
    }

    /// Rotate-half RoPE at `pos` on every head of `v` (heads of `head_dim`).
    fn rope(&self, v: &mut [f64], pos: usize) {
        let d = self.cfg.head_dim;
        for head in v.chunks_mut(d) {
            for (i, f) in self.inv_freq.iter().enumerate() {
                let (s, c) = (pos as f64 * f).sin_cos();
                let (a, b) = (head[i], head[i + d / 2]);
                head[i] = a * c - b * s;
                head[i + d / 2] = b * c + a * s;
            }
        }
    }

    /// Logits of every position of `tokens`, flat `[tokens.len()][vocab]`.
    pub fn logits(&self, tokens: &[u32]) -> Vec<f32> {
        let c = &self.cfg;
        let (h, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let group = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();
        let n = tokens.len();
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| {
                assert!((t as usize) < c.vocab_size);
                self.embed[t as usize * h..(t as usize + 1) * h].to_vec()
            })
            .collect();
        for layer in &self.layers {
            // Attention sublayer: contiguous K/V of the whole sequence.
            let mut qs = Vec::with_capacity(n);
            let mut ks = Vec::with_capacity(n);
            let mut vs = Vec::with_capacity(n);
            for (pos, x) in xs.iter().enumerate() {
                let hn = self.rms_norm(x, &layer.input_norm);
                let mut q = layer.q.apply(&hn);
                let mut k = layer.k.apply(&hn);
                self.rope(&mut q, pos);
                self.rope(&mut k, pos);
                qs.push(q);
                ks.push(k);
                vs.push(layer.v.apply(&hn));
            }
            for pos in 0..n {
                let mut attn = vec![0.0f64; nh * hd];
                for head in 0..nh {
                    let kvh = head / group;
                    let q = &qs[pos][head * hd..(head + 1) * hd];
                    let scores: Vec<f64> = (0..=pos)
                        .map(|j| {
                            q.iter().zip(&ks[j][kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (j, ej) in e.iter().enumerate() {
                        let p = ej / z;
                        for d in 0..hd {
                            attn[head * hd + d] += p * vs[j][kvh * hd + d];
                        }
                    }
                }
                let o = layer.o.apply(&attn);
                xs[pos].iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            }
            // MLP sublayer (SwiGLU).
            for x in xs.iter_mut() {
                let hn = self.rms_norm(x, &layer.post_norm);
                let g = layer.gate.apply(&hn);
                let u = layer.up.apply(&hn);
                let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let o = layer.down.apply(&a);
                x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            }
        }
        let mut out = Vec::with_capacity(n * c.vocab_size);
        for x in &xs {
            let hn = self.rms_norm(x, &self.norm);
            for r in 0..c.vocab_size {
                let row = &self.head[r * h..(r + 1) * h];
                out.push(row.iter().zip(&hn).map(|(w, x)| w * x).sum::<f64>() as f32);
            }
        }
        out
    }

    /// Greedy continuation of `prompt` by `n` tokens (argmax, lowest id on ties).
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Vec<u32> {
        let v = self.cfg.vocab_size;
        let mut seq = prompt.to_vec();
        for _ in 0..n {
            let logits = self.logits(&seq);
            let last = &logits[(seq.len() - 1) * v..];
            seq.push(argmax(last));
        }
        seq[prompt.len()..].to_vec()
    }
}

/// Index of the largest value; the lowest index wins ties.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
