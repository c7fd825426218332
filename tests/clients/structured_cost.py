#!/usr/bin/env python3
"""What structured outputs cost: TPOT with and without a JSON schema at 1 and 32
requests in flight, and the mask time per token (`tessera_grammar_mask_seconds`), against
a running gateway serving a chat model whose sampling chip is on the gateway's host
(the mask metric is read from the gateway's /metrics):

    tessera up topology/examples/smollm2-one-chip.toml &
    python3 tests/clients/structured_cost.py [http://127.0.0.1:8000]

Without a schema each request generates 60 tokens (`ignore_eos`); with one, until the
JSON is complete (about 65 tokens). Standard library only.
"""
import concurrent.futures as cf
import json
import statistics
import sys
import time
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
MODEL = json.load(urllib.request.urlopen(BASE + "/v1/models"))["data"][0]["id"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "role", "address", "tags"], "additionalProperties": False}


def metrics():
    txt = urllib.request.urlopen(BASE + "/metrics").read().decode()
    get = lambda k: sum(float(l.split()[-1]) for l in txt.splitlines() if l.startswith(k))
    return get("tessera_grammar_mask_seconds_sum"), get("tessera_grammar_mask_seconds_count")


def one(schema, seed):
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "temperature": 1, "seed": seed,
            "messages": [{"role": "user", "content": "Describe a person as JSON: name, age, role, address and tags."}]}
    if schema:
        body.update(max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    else:
        body.update(max_tokens=60, ignore_eos=True)
    req = urllib.request.Request(BASE + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    times, tokens = [], 0
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            if c.get("usage"):
                tokens = c["usage"]["completion_tokens"]
            elif c["choices"] and c["choices"][0]["delta"].get("content"):
                times.append(time.time())
    return (times[-1] - times[0]) / max(1, tokens - 1), tokens


for conc in (1, 32):
    for schema in (False, True):
        s0, c0 = metrics()
        n = 8 if conc == 1 else 32
        with cf.ThreadPoolExecutor(conc) as ex:
            res = list(ex.map(lambda i: one(schema, i), range(n)))
        s1, c1 = metrics()
        tpots = [t for t, _ in res]
        mask = (s1 - s0) / (c1 - c0) * 1e6 if c1 > c0 else 0
        print(f"batch {conc:2d} schema={schema!s:5}: TPOT p50 {statistics.median(tpots)*1000:.1f} ms, tokens/req {statistics.mean(k for _, k in res):.0f}, mask {mask:.0f} us/token over {c1-c0:.0f} masks")
