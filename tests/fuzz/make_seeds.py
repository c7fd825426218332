#!/usr/bin/env python3
"""Writes the seed corpora, corpus/<target>/seed-*: a few small valid inputs per fuzz
target, from which libFuzzer mutates. Standard library only; run from anywhere:
    python3 tests/fuzz/make_seeds.py
The topology seeds are cut from topology/default.toml (comments dropped)."""

import json
import pathlib
import struct

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def write(target, name, data):
    path = HERE / "corpus" / target / f"seed-{name}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


# --- MessagePack, the subset rmp_serde::to_vec_named writes -------------------------
def mp(value):
    if value is None:
        return b"\xc0"
    if isinstance(value, bool):
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        if 0 <= value < 128:
            return bytes([value])
        if 0 <= value < 1 << 8:
            return b"\xcc" + struct.pack(">B", value)
        if 0 <= value < 1 << 16:
            return b"\xcd" + struct.pack(">H", value)
        if 0 <= value < 1 << 32:
            return b"\xce" + struct.pack(">I", value)
        return b"\xcf" + struct.pack(">Q", value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, str):
        raw = value.encode()
        assert len(raw) < 32
        return bytes([0xA0 | len(raw)]) + raw
    if isinstance(value, bytes):
        assert len(value) < 256
        return b"\xc4" + bytes([len(value)]) + value
    if isinstance(value, list):
        assert len(value) < 16
        return bytes([0x90 | len(value)]) + b"".join(mp(v) for v in value)
    if isinstance(value, dict):
        assert len(value) < 16
        return bytes([0x80 | len(value)]) + b"".join(mp(k) + mp(v) for k, v in value.items())
    raise TypeError(value)


def addr(host, actor):
    return {"host": host, "actor": actor}


def envelope(frm, to, topic, kind, corr, payload):
    return mp({"v": 1, "from": frm, "to": to, "topic": topic, "kind": kind, "corr": corr, "payload": payload})


abort = mp({"Abort": {"request_id": 7}})
chip_lost = mp({"ChipLost": {"chip": addr(1, 5)}})
route = mp({"Route": {"request_id": 1, "req": addr(0, 9), "tokens": 10, "prompt_tokens": 5,
                      "exclude": [addr(1, 2)]}})
write("bus_envelope", "direct", envelope(addr(0, 1), addr(1, 2), None, "Msg", 7, abort))
write("bus_envelope", "broadcast", envelope(addr(1, 3), None, "chips", "Msg", 0, chip_lost))
write("bus_envelope", "payload-route", route)

# --- ZMTP: [read size, max size] + greeting + READY + messages ------------------------
GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)
assert len(GREETING) == 64


def frame(flags, body):
    if len(body) > 255:
        return bytes([flags | 0b10]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def ready(socket_type):
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return frame(0b100, body)


def message(*parts):
    return b"".join(frame(1 if i + 1 < len(parts) else 0, p) for i, p in enumerate(parts))


write("zmtp_decode", "router", bytes([0, 3]) + GREETING + ready(b"ROUTER") + message(b"id", b"", b"hello"))
write("zmtp_decode", "long-frame", bytes([7, 7]) + GREETING + ready(b"DEALER") + message(bytes(300), b"tail"))
write("zmtp_decode", "over-bound", bytes([1, 0]) + GREETING + ready(b"PUB") + b"\x02" + struct.pack(">Q", 1 << 60))
# 16 MiB bound, a frame announced past the 128 KiB the decoder reserves headroom beyond.
write("zmtp_decode", "big-announced", bytes([0, 16]) + GREETING + ready(b"SUB") + b"\x02" + struct.pack(">Q", 300_000))

# --- KV transfer headers -------------------------------------------------------------
write("transfer_header", "request", b"TSXF" + struct.pack("<HHQQQ", 1, 1, 7, 4096, 65536))
write("transfer_header", "response-ok", b"TSXR" + struct.pack("<HHQ", 0, 0, 65536))
write("transfer_header", "response-error", b"TSXR" + struct.pack("<HHQ", 2, 0, 12) + b"out of bound")

# --- Topology TOML ---------------------------------------------------------------------
default = (ROOT / "topology" / "default.toml").read_text()
lines = [line for line in default.splitlines() if line.strip() and not line.lstrip().startswith("#")]
write("topology_toml", "default", "\n".join(lines) + "\n")
write("topology_toml", "minimal", """[cluster]
model = "builtin:tiny"

[[hosts]]
name = "h0"
bus = "127.0.0.1:7400"

[[hosts.chips]]
id = "c0"
backend = "cpu"
kind = "cpu"
""")
write("topology_toml", "dense", """[cluster]
model = "models/llama"
dtype = "bf16"
kv_dtype = "f16"

[[chip_kinds]]
name = "nvidia-l40s"
fp16_tflops = 362.0
memory = "48GiB"
memory_bw_gbs = 864.0
link_bw_gbs = 64.0
tdp_w = 350.0
source = "NVIDIA L40S datasheet"

[[hosts]]
name = "a"
bus = "tcp://[::1]:9000"

[[hosts.chips]]
id = "a0"
kind = "nvidia-l40s"
backend = "plugin:lib/kernels.so"
memory_limit = "512MiB"

[[hosts.chips]]
id = "a1"
backend = "emu:nvidia-l40s"
role = "decode"
memory_limit = 1048576
""")


# --- safetensors -----------------------------------------------------------------------
def safetensors(tensors):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, dtype, shape, size in tensors:
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += bytes((len(data) + i) % 251 for i in range(n))
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + data


write("safetensors_header", "two", safetensors([("w", "F32", [2, 3], 4), ("b", "BF16", [4], 2)]))
write("safetensors_header", "scalar-f16", safetensors([("s", "F16", [], 2), ("z", "F32", [0, 5], 4)]))
write("safetensors_header", "empty", safetensors([]))

# --- OpenAI request bodies ---------------------------------------------------------------
for name, body in {
    "text": {"model": "m", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7, "stop": ["\n"]},
    "ids": {"model": "m", "prompt": [[1, 2, 3]], "stream": True, "stream_options": {"include_usage": True},
            "top_k": 40, "top_p": 0.9, "seed": -1, "n": 1, "logit_bias": {}},
}.items():
    write("openai_completion", name, json.dumps(body))
for name, body in {
    "simple": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "parts": {"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "c"}],
        "max_completion_tokens": 3, "stop_token_ids": [2], "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}},
}.items():
    write("openai_chat", name, json.dumps(body))

# --- GGUF --------------------------------------------------------------------------------
# Value type ids (gguf_type) and their struct formats; 8 is a string, 9 an array.
GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                12: "<d"}
# ggml type id: (values per block, bytes per block).
GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
               12: (256, 144), 14: (256, 210)}
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K = 0, 1, 30, 2, 3, 6, 7, 8, 12, 14


def gguf_str(s):
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(ty, value):
    """The encoding of `value` as type `ty`; an array is (item type, [items])."""
    if ty == 8:
        return gguf_str(value)
    if ty == 9:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(gguf_value(item, v) for v in items)
    return struct.pack(GGUF_SCALARS[ty], value)


def block_data(ty, n, seed):
    """`n` values of ggml type `ty` as deterministic bytes, with small f16 scales."""
    per, size = GGML_BLOCKS[ty]
    data = bytearray((seed * 31 + i * 7) % 251 for i in range(n // per * size))
    if ty == F32:
        data = b"".join(struct.pack("<f", (i % 7 - 3) / 4) for i in range(n))
    elif ty in (F16, BF16) or per == 1:
        pass
    else:
        scale = struct.pack("<e", 0.0625)
        for b in range(n // per):
            at = b * size + (208 if ty == Q6_K else 0)
            data[at:at + 2] = scale
    return bytes(data)


def gguf(metadata, tensors, version=3, alignment=32):
    """metadata: [(key, type id, value)]; tensors: [(name, dims in ggml order, ggml type)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, ty, value in metadata:
        out += gguf_str(key) + struct.pack("<I", ty) + gguf_value(ty, value)
    offset, blobs = 0, []
    for i, (name, dims, ty) in enumerate(tensors):
        n = 1
        for d in dims:
            n *= d
        blob = block_data(ty, n, i)
        out += gguf_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, offset)
        blobs.append((offset, blob))
        offset = -(-(offset + len(blob)) // alignment) * alignment
    out += bytes(-len(out) % alignment)
    start = len(out)
    for at, blob in blobs:
        out += bytes(start + at - len(out)) + blob
    return out


def byte_level_vocab():
    """A small gpt2-style vocabulary: printable ASCII as GPT-2's byte-level chars, a few
    merges, two control tokens."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\u0120"] + [chr(c) for c in range(0x21, 0x7f)]
    merges = ["h e", "l l", "\u0120 t", "he ll", "o r"]
    tokens += ["he", "ll", "\u0120t", "hell", "or"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


tokens, merges, types = byte_level_vocab()
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOKENIZER = [
    ("tokenizer.ggml.model", 8, "gpt2"),
    ("tokenizer.ggml.pre", 8, "smollm"),
    ("tokenizer.ggml.tokens", 9, (8, tokens)),
    ("tokenizer.ggml.token_type", 9, (5, types)),
    ("tokenizer.ggml.merges", 9, (8, merges)),
    ("tokenizer.ggml.bos_token_id", 4, 1),
    ("tokenizer.ggml.eos_token_id", 4, 2),
    ("tokenizer.ggml.add_bos_token", 7, False),
    ("tokenizer.chat_template", 8, TEMPLATE),
]
# A whole (tiny) llama: config keys, vocabulary, every projection of one layer, the Q/K
# rows the loader un-permutes, one tensor of each ggml type.
write("gguf_file", "llama-v3", gguf([
    ("general.architecture", 8, "llama"),
    ("general.name", 8, "tiny"),
    ("llama.block_count", 4, 1),
    ("llama.context_length", 4, 64),
    ("llama.embedding_length", 4, 32),
    ("llama.feed_forward_length", 4, 32),
    ("llama.attention.head_count", 4, 2),
    ("llama.attention.head_count_kv", 4, 1),
    ("llama.attention.layer_norm_rms_epsilon", 6, 1e-5),
    ("llama.rope.freq_base", 6, 10000.0),
] + TOKENIZER, [
    ("token_embd.weight", [32, 4], Q8_0),
    ("output_norm.weight", [32], F32),
    ("blk.0.attn_norm.weight", [32], F16),
    ("blk.0.ffn_norm.weight", [32], BF16),
    ("blk.0.attn_q.weight", [32, 4], Q4_1),
    ("blk.0.attn_k.weight", [32, 2], Q5_0),
    ("blk.0.attn_v.weight", [32, 2], Q5_1),
    ("blk.0.attn_output.weight", [32, 1], Q4_0),
    ("blk.0.ffn_up.weight", [256], Q4_K),
    ("blk.0.ffn_down.weight", [256], Q6_K),
]))
# Qwen2 in version 2: biases, linear rope scaling, a u64 vocab size, the qwen2 pre-tokenizer.
write("gguf_file", "qwen2-v2", gguf([
    ("general.architecture", 8, "qwen2"),
    ("general.alignment", 4, 64),
    ("qwen2.block_count", 10, 1),
    ("qwen2.embedding_length", 10, 32),
    ("qwen2.feed_forward_length", 10, 64),
    ("qwen2.attention.head_count", 10, 2),
    ("qwen2.attention.key_length", 4, 16),
    ("qwen2.vocab_size", 10, len(tokens)),
    ("qwen2.rope.scaling.type", 8, "linear"),
    ("qwen2.rope.scaling.factor", 12, 2.0),
] + [(k, t, v) if k != "tokenizer.ggml.pre" else (k, 8, "qwen2") for k, t, v in TOKENIZER], [
    ("token_embd.weight", [32, 2], F16),
    ("blk.0.attn_q.bias", [32], F32),
    ("blk.0.attn_q.weight", [32, 2], Q8_0),
    ("output.weight", [32, 2], Q4_0),
], version=2, alignment=64))
# Every metadata value type, nested arrays, and no known architecture.
write("gguf_file", "all-value-types", gguf([
    ("u8", 0, 200), ("i8", 1, -5), ("u16", 2, 60000), ("i16", 3, -300), ("u32", 4, 1 << 31), ("i32", 5, -1),
    ("f32", 6, 0.5), ("bool", 7, True), ("str", 8, "héllo"), ("u64", 10, 1 << 40), ("i64", 11, -(1 << 40)),
    ("f64", 12, 2.5),
    ("arr.u8", 9, (0, [1, 2, 3])), ("arr.f32", 9, (6, [1.5, -2.0])), ("arr.bool", 9, (7, [True, False])),
    ("arr.str", 9, (8, ["a", "", "ü"])), ("arr.empty", 9, (10, [])),
    ("arr.nested", 9, (9, [(4, [1, 2]), (8, ["x"])])),
], [("t", [4, 2], F32)], version=3))


def smollm2_header():
    """The shared SmolLM2 file's metadata (vocabulary cut to its first 400 tokens and the
    merges among them) and the names and types of its first tensors, at tiny sizes."""
    path = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        return None
    raw = path.open("rb").read(4 << 20)
    at = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)

    def take_str():
        nonlocal at
        (n,) = struct.unpack_from("<Q", raw, at)
        at += 8 + n
        return raw[at - n:at].decode()

    def take(ty):
        nonlocal at
        if ty == 8:
            return take_str()
        if ty == 9:
            item, n = struct.unpack_from("<IQ", raw, at)
            at += 12
            return (item, [take(item) for _ in range(n)])
        fmt = GGUF_SCALARS[ty]
        (v,) = struct.unpack_from(fmt, raw, at)
        at += struct.calcsize(fmt)
        return v

    metadata = []
    for _ in range(n_kv):
        key = take_str()
        (ty,) = struct.unpack_from("<I", raw, at)
        at += 4
        metadata.append((key, ty, take(ty)))
    tensors = []
    for _ in range(n_tensors):
        name = take_str()
        (n_dims,) = struct.unpack_from("<I", raw, at)
        dims = struct.unpack_from(f"<{n_dims}Q", raw, at + 4)
        ty, _ = struct.unpack_from("<IQ", raw, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        if len(tensors) < 12 and "blk." not in name or name.startswith("blk.0."):
            tensors.append((name, [GGML_BLOCKS[ty][0] * (2 if len(dims) == 1 else 1)] + [2] * (len(dims) - 1), ty))
    kept = None
    for i, (key, ty, value) in enumerate(metadata):
        if key == "tokenizer.ggml.tokens":
            kept = set(value[1][:400])
    cut = []
    for key, ty, value in metadata:
        if key == "tokenizer.ggml.merges":
            value = (8, [m for m in value[1] if set(m.split(" ")) <= kept and m.replace(" ", "") in kept])
        elif ty == 9 and key.startswith("tokenizer."):
            value = (value[0], value[1][:400])
        cut.append((key, ty, value))
    return gguf(cut, tensors, version=3)


smollm2 = smollm2_header()
if smollm2 is not None:
    write("gguf_file", "smollm2-header", smollm2)
