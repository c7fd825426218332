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
