"""Exact logits of a llama-architecture GGUF file: float64 numpy over its weights,
dequantized by the `gguf` package (`pip install gguf numpy`).

What both Tessera and llama.cpp approximate, so that each one's distance from it can be
measured on its own: llama's forward pass as llama.cpp defines it for a GGUF file (RMS
norm, rotary embedding of adjacent pairs, since the converter permutes q and k for it,
grouped-query causal attention, SiLU-gated MLP, the output matrix or the tied embedding).
Imported by compare-llama-logits.py and tests/fixtures/scoring/make-quantized.py.
"""
import math


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"{key} is missing")
        return default
    return f.parts[f.data[0]][0].item()


def exact_logits(path, ids):
    """Logits at every position of `ids`, a list of rows of floats."""
    import numpy as np
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, not llama")
    n_layer = _field(reader, "llama.block_count")
    n_head = _field(reader, "llama.attention.head_count")
    n_kv = _field(reader, "llama.attention.head_count_kv", n_head)
    eps = _field(reader, "llama.attention.layer_norm_rms_epsilon")
    base = _field(reader, "llama.rope.freq_base", 10000.0)

    def weight(t):
        return quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
            [int(x) for x in reversed(t.shape.tolist())])

    w = {t.name: weight(t) for t in reader.tensors}
    x = w["token_embd.weight"][ids]
    n, d = x.shape
    hd = d // n_head
    angle = np.arange(n)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    causal = np.triu(np.full((n, n), -np.inf), 1)

    def rms(v, weight):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * weight

    def rope(v):
        out = np.empty_like(v)
        out[..., 0::2] = v[..., 0::2] * cos - v[..., 1::2] * sin
        out[..., 1::2] = v[..., 0::2] * sin + v[..., 1::2] * cos
        return out

    for layer in range(n_layer):
        p = f"blk.{layer}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(n, n_head, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(n, n_kv, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, n_kv, hd)
        attn = np.zeros((n, n_head, hd))
        for head in range(n_head):
            kv = head // (n_head // n_kv)
            score = q[:, head] @ k[:, kv].T / math.sqrt(hd) + causal
            prob = np.exp(score - score.max(-1, keepdims=True))
            attn[:, head] = (prob / prob.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + attn.reshape(n, d) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    out = w.get("output.weight", w["token_embd.weight"])
    return (rms(x, w["output_norm.weight"]) @ out.T).tolist()
