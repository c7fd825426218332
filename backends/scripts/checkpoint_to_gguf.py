#!/usr/bin/env python3
"""Convert a Hugging Face Llama checkpoint directory to a GGUF file, as llama.cpp's
convert_hf_to_gguf.py (+ llama-quantize for q4_0) would write it.

The checkpoint is what `tessera generate --model builtin:<preset>` caches under
~/.cache/tessera/models/<preset>-llama-seed0 (or any LlamaForCausalLM directory):
config.json, model.safetensors (or shards + model.safetensors.index.json; f32, f16 or
bf16), tokenizer.json (byte-level BPE), optionally tokenizer_config.json.

Usage (from the repository root):

    python3 -m venv .venv && .venv/bin/pip install numpy gguf
    .venv/bin/python backends/scripts/checkpoint_to_gguf.py \\
        ~/.cache/tessera/models/bench-llama-seed0 /tmp/bench-q8_0.gguf \\
        --type q8_0 --drop-rope-freqs

What the file holds:
- metadata: general.*, llama.* hyperparameters, tokenizer.ggml.* (model gpt2, tokens,
  token_type, merges, pre, special ids, add_bos/eos, chat template), written with
  gguf-py's own SpecialVocab as the converter does;
- tensors under llama.cpp's names (token_embd, blk.N.attn_q, ..., output_norm, output
  when not tied); the rows of Q and K permuted per head as LlamaModel.permute does
  (ggml ropes interleaved pairs; Tessera un-permutes on load);
- llama3 rope scaling as a `rope_freqs.weight` tensor of per-dimension factors, as the
  converter writes it (--drop-rope-freqs leaves it out; see below).

Tensor types by --type (norms and 1-D tensors are always f32):
- f32, f16: every 2-D weight in that type (convert_hf_to_gguf --outtype f32/f16);
- q8_0: every 2-D weight, token_embd and output included, in Q8_0 (the converter's
  --outtype q8_0, and llama-quantize Q8_0, agree on this);
- q4_0: the 2-D linear weights in Q4_0, token_embd and output in Q8_0. That is Tessera's
  `--quantize q4_0` rule and `llama-quantize --token-embedding-type q8_0
  --output-tensor-type q8_0 IN.gguf OUT.gguf Q4_0`; plain llama-quantize Q4_0 would
  instead store the output (or, when tied, token_embd) as Q6_K.
Q8_0/Q4_0 blocks come from gguf-py's `gguf.quants.quantize`, which reproduces ggml's
reference quantization bit for bit.

Caveats for files Tessera must also read (see backends/src/gguf/hf.rs):
- Tessera refuses `rope_freqs.weight`; --drop-rope-freqs omits it, so the file ropes
  with unscaled frequencies (a different model from the checkpoint at positions where
  the llama3 factors matter; the same one for both engines).
- tokenizer.ggml.pre: the checkpoint's pre-tokenizer (ByteLevel with the GPT-2 regex) is
  llama.cpp's "gpt-2", a name Tessera does not accept; Tessera reads "default" as the
  GPT-2 regex, llama.cpp reads it as its own default regex set (punctuation runs and
  digits split differently). The default here is "default" so both load; --pre gpt-2
  is exact for llama.cpp. Token-id prompts are unaffected either way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __name__ == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
    # Usage without numpy or gguf installed (CI checks it).
    print(__doc__)
    sys.exit(0)

import numpy as np  # noqa: E402

try:
    import gguf
except ImportError:  # pragma: no cover - a message beats a traceback
    sys.exit("checkpoint_to_gguf: the `gguf` package is missing (pip install gguf, or the "
             "gguf-py folder of a llama.cpp checkout)")

Q = gguf.GGMLQuantizationType

FILE_TYPES = {
    "f32": (gguf.LlamaFileType.ALL_F32, Q.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, Q.F16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
}

# Hugging Face layer-tensor names -> llama.cpp's.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
FIXED_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


class ConvertError(Exception):
    """The checkpoint is not one this script converts; the message says why."""


# ---------------------------------------------------------------------------------------
# safetensors, read directly: numpy has no bf16, and a memory map keeps one tensor at a
# time in memory.

ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass
class StTensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    def load_f32(self) -> np.ndarray:
        if self.dtype not in ST_DTYPES:
            raise ConvertError(f"{self.file}: dtype {self.dtype} is not supported (f32, f16, bf16)")
        raw = np.memmap(self.file, dtype=np.uint8, mode="r", offset=self.start,
                        shape=(self.end - self.start,))
        a = raw.view(ST_DTYPES[self.dtype]).reshape(self.shape)
        if self.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


def read_safetensors_index(directory: Path) -> dict[str, StTensor]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{directory}: no .safetensors file")
    tensors: dict[str, StTensor] = {}
    for f in files:
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        base = 8 + header_len
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            tensors[name] = StTensor(f, meta["dtype"], tuple(meta["shape"]), base + begin, base + end)
    return tensors


# ---------------------------------------------------------------------------------------
# Tensors


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: per head, rows (i, i + half) become (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str | None:
    """llama.cpp's name of a checkpoint tensor; None for tensors the converter skips."""
    if hf in FIXED_NAMES:
        return FIXED_NAMES[hf]
    if hf.endswith("rotary_emb.inv_freq"):
        return None
    parts = hf.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdecimal():
        kind = parts[-1]
        part = ".".join(parts[3:-1])
        if part in LAYER_NAMES and kind in ("weight", "bias"):
            return f"blk.{parts[2]}.{LAYER_NAMES[part]}.{kind}"
    raise ConvertError(f"tensor {hf!r} has no llama.cpp name (not a Llama checkpoint?)")


def tensor_type(name: str, shape: tuple[int, ...], out: str) -> Q:
    """The GGML type `name` is stored in for --type `out` (module doc: tensor types)."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32
    qtype = FILE_TYPES[out][1]
    if out == "q4_0" and name in ("token_embd.weight", "output.weight"):
        qtype = Q.Q8_0
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block != 0:
        print(f"warning: {name}: rows of {shape[-1]} are not whole {qtype.name} blocks, "
              "falling back to F16 (as the converter does)", file=sys.stderr)
        return Q.F16
    return qtype


def encode(data: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def llama3_rope_factors(cfg: dict, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors for rope_type llama3."""
    base = cfg.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@dataclass
class OutTensor:
    name: str
    shape: tuple[int, ...]
    qtype: Q
    load: Callable[[], np.ndarray]  # f32 values in HF layout, already permuted


def plan_tensors(cfg: dict, st: dict[str, StTensor], out: str, drop_rope_freqs: bool) -> list[OutTensor]:
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    tied = cfg.get("tie_word_embeddings", False)
    plan: list[OutTensor] = []

    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3" and not drop_rope_freqs:
        factors = llama3_rope_factors(cfg, scaling)
        plan.append(OutTensor("rope_freqs.weight", factors.shape, Q.F32, lambda f=factors: f))

    def loader(t: StTensor, heads: int | None) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            data = t.load_f32()
            return permute(data, heads) if heads else data
        return load

    for hf, t in st.items():
        name = gguf_name(hf)
        if name is None or (name == "output.weight" and tied):
            continue
        heads = None
        if name.endswith((".attn_q.weight", ".attn_q.bias")):
            heads = n_head
        elif name.endswith((".attn_k.weight", ".attn_k.bias")):
            heads = n_kv
        if heads and (t.shape[0] % (2 * heads)) != 0:
            raise ConvertError(f"{hf}: {t.shape[0]} rows do not split into {heads} heads of even size")
        plan.append(OutTensor(name, t.shape, tensor_type(name, t.shape, out), loader(t, heads)))

    names = {p.name for p in plan}
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in names:
            raise ConvertError(f"the checkpoint has no tensor for {required}")
    if not tied and "output.weight" not in names:
        raise ConvertError("tie_word_embeddings is false but the checkpoint has no lm_head.weight")
    return sorted(plan, key=order_key)


def order_key(t: OutTensor) -> tuple:
    """Model order: rope_freqs, token_embd, blocks by index, output_norm, output."""
    if t.name.startswith("blk."):
        layer, rest = t.name[4:].split(".", 1)
        return (2, int(layer), rest)
    head = {"rope_freqs.weight": 0, "token_embd.weight": 1, "output_norm.weight": 3, "output.weight": 4}
    return (head.get(t.name, 5), 0, t.name)


# ---------------------------------------------------------------------------------------
# Metadata


def add_hparams(w: gguf.GGUFWriter, cfg: dict, file_type: gguf.LlamaFileType, drop_rope_freqs: bool) -> None:
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise ConvertError(f"config.json: not a Llama model (model_type {cfg.get('model_type')!r}, "
                           f"architectures {archs})")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    elif rope_type == "llama3":
        if drop_rope_freqs:
            print("warning: --drop-rope-freqs: the llama3 rope scaling of config.json is left out; "
                  "the file ropes with unscaled frequencies", file=sys.stderr)
    elif rope_type not in (None, "default"):
        raise ConvertError(f"config.json: rope_scaling type {rope_type!r} is not supported (linear, llama3)")
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(file_type)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim or cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def gpt2_style(pre_tokenizer: dict | None) -> bool:
    """Whether tokenizer.json pre-tokenizes with ByteLevel's GPT-2 regex and nothing else."""
    return bool(pre_tokenizer) and pre_tokenizer.get("type") == "ByteLevel" \
        and pre_tokenizer.get("use_regex", True) and not pre_tokenizer.get("add_prefix_space", False)


def add_vocab(w: gguf.GGUFWriter, directory: Path, cfg: dict, pre: str | None) -> None:
    """As convert_hf_to_gguf's _set_vocab_gpt2: tokens with their types, then SpecialVocab."""
    tok = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    model = tok.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ConvertError("tokenizer.json: only byte-level BPE vocabularies are supported")
    if pre is None:
        if not gpt2_style(tok.get("pre_tokenizer")) or tok.get("normalizer"):
            raise ConvertError("tokenizer.json: the pre-tokenizer is not plain ByteLevel; "
                               "name its llama.cpp equivalent with --pre")
        pre = "default"
    vocab_size = cfg["vocab_size"]
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    if by_id and max(by_id) >= vocab_size:
        raise ConvertError(f"tokenizer.json: token id {max(by_id)} >= vocab_size {vocab_size}")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            content = by_id[i]
            looks_special = content.startswith("<|") and content.endswith("|>")
            special = added[i].get("special", False) or looks_special
            tokens.append(content)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(directory, load_merges=True)
    if not special.merges:
        raise ConvertError("tokenizer.json: no merges")
    special.add_to_gguf(w, quiet=True)


# ---------------------------------------------------------------------------------------


def convert(directory: Path, out_path: Path, out: str, pre: str | None, drop_rope_freqs: bool) -> None:
    cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    st = read_safetensors_index(directory)
    plan = plan_tensors(cfg, st, out, drop_rope_freqs)

    w = gguf.GGUFWriter(out_path, "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(directory.name)
    add_hparams(w, cfg, FILE_TYPES[out][0], drop_rope_freqs)
    add_vocab(w, directory, cfg, pre)

    # Tensor infos first, then each tensor loaded, converted and written in turn.
    for t in plan:
        if t.qtype in (Q.F32, Q.F16):
            dtype = np.float32 if t.qtype == Q.F32 else np.float16
            w.add_tensor_info(t.name, t.shape, np.dtype(dtype), int(np.prod(t.shape)) * np.dtype(dtype).itemsize)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(t.shape, t.qtype)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in plan:
        w.write_tensor_data(encode(t.load(), t.qtype))
        print(f"{t.name:32} {t.qtype.name:5} {list(reversed(t.shape))}", file=sys.stderr)
    w.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("output", type=Path, help="GGUF file to write")
    p.add_argument("--type", choices=list(FILE_TYPES), default="f16", help="tensor types (default: f16)")
    p.add_argument("--pre", help="tokenizer.ggml.pre to write (default: 'default' for a GPT-2 ByteLevel "
                   "pre-tokenizer; 'gpt-2' is llama.cpp's exact name for it, which Tessera does not read)")
    p.add_argument("--drop-rope-freqs", action="store_true",
                   help="leave out llama3 rope scaling (rope_freqs.weight), which Tessera does not read yet")
    args = p.parse_args(argv)
    try:
        convert(args.checkpoint, args.output, args.type, args.pre, args.drop_rope_freqs)
    except (ConvertError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"checkpoint_to_gguf: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
