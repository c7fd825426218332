#!/usr/bin/env python3
"""The official `openai` Python client against a running Tessera gateway: every
response shape the gateway sends for log-probabilities, echo, penalties, several
choices, structured outputs, tool calls and their errors is parsed by the client's own
models, and checked field by field.

    python3 -m venv .venv && .venv/bin/pip install openai
    cargo run --release -- up &          # the default cluster, gateway on :8000
    .venv/bin/python tests/clients/openai_shapes.py [http://127.0.0.1:8000/v1]

Exits non-zero, naming the check, on the first shape the client cannot read or that
does not say what it should.
"""
import json
import math
import sys

import openai

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = openai.OpenAI(base_url=BASE, api_key="unused")
MODEL = client.models.list().data[0].id
PROMPT = "The capital of France is"


def check(what, ok):
    if not ok:
        sys.exit(f"FAILED: {what}")
    print(f"ok  {what}")


def number(x):
    return isinstance(x, float) and math.isfinite(x)


# Completions with logprobs: parallel arrays, alternatives as a map.
r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                              extra_body={"ignore_eos": True})
lp = r.choices[0].logprobs
check("completions logprobs parse", lp is not None and len(lp.tokens) == 6)
check("completions token_logprobs are numbers <= 0", all(number(x) and x <= 0 for x in lp.token_logprobs))
check("completions top_logprobs are maps with the sampled token",
      all(isinstance(t, dict) and tok in t for t, tok in zip(lp.top_logprobs, lp.tokens)))
check("completions text_offset ascends", lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0)
check("completions tokens spell the text", "".join(lp.tokens) == r.choices[0].text)

# A scoring request: echo, logprobs, max_tokens 0.
r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
lp = r.choices[0].logprobs
check("echo returns the prompt", r.choices[0].text == PROMPT)
check("echo's first prompt token has no logprob", lp.token_logprobs[0] is None and lp.top_logprobs[0] is None)
check("echo scores every later prompt token", all(number(x) for x in lp.token_logprobs[1:]) and len(lp.tokens) > 1)
check("a scoring request generates nothing", r.usage.completion_tokens == 0)
stream = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, stream=True)
chunks = [c for c in stream if c.choices]
check("a streamed scoring request is the prompt with its figures",
      "".join(c.choices[0].text for c in chunks) == PROMPT
      and [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs][1:]
      == lp.token_logprobs[1:])

# Chat with logprobs and top_logprobs. A first request fills the prefix cache, so the
# whole and the streamed runs below compute the same part of the prompt (quantized
# kernels' numerics depend on the rows a step carries: see docs/reference/http-api.md, "Several choices").
messages = [{"role": "user", "content": "Say hello"}]
client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                   logprobs=True, top_logprobs=2)
content = r.choices[0].logprobs.content
check("chat logprobs parse", content is not None and len(content) == r.usage.completion_tokens)
check("chat entries have token, logprob and bytes",
      all(isinstance(e.token, str) and number(e.logprob) and e.bytes == list(e.token.encode()) for e in content))
check("chat entries list top_logprobs", all(len(e.top_logprobs) == 2 and number(e.top_logprobs[0].logprob)
                                             for e in content))
check("chat text is the tokens", "".join(e.token for e in content) == r.choices[0].message.content)

# Streamed: chunks carry their tokens' logprobs; together they equal the whole answer's.
stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                        logprobs=True, top_logprobs=2, stream=True)
streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
            for e in c.choices[0].logprobs.content]
check("streamed chat logprobs equal whole",
      len(streamed) == len(content) and all(abs(a - e.logprob) < 1e-4 for a, e in zip(streamed, content)))
stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                   stream=True, extra_body={"ignore_eos": True})
streamed = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
check("streamed completions carry logprobs", len(streamed) == 6 and all(number(x) for x in streamed))

# Penalties, logit_bias and vLLM's extensions are accepted.
r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, presence_penalty=1.0,
                              frequency_penalty=0.5, logit_bias={"13": 5},
                              extra_body={"repetition_penalty": 1.2, "min_tokens": 2})
check("penalties accepted", r.usage.completion_tokens >= 2)

# Several choices, whole and streamed, each with its index.
r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1, seed=5, n=3)
check("n choices carry their index", sorted(c.index for c in r.choices) == [0, 1, 2])
r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=1, n=2, stream=True)
check("streamed choices carry their index", {c.index for chunk in r for c in chunk.choices} == {0, 1})
r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=1, n=2, best_of=3)
check("best_of returns n choices", len(r.choices) == 2)

# Structured outputs: the answer follows the schema even from a random model.
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=1,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
check("json_schema output validates", json.loads(r.choices[0].message.content)["answer"] in ("yes", "no"))
r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1,
                              extra_body={"guided_choice": ["Paris", "Rome"]})
check("guided_choice picks a choice", r.choices[0].text in ("Paris", "Rome"))

# Tool calls, whole and streamed.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                         "required": ["city"], "additionalProperties": False}}}]
r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=300, temperature=1, tools=TOOLS,
                                   tool_choice="required", parallel_tool_calls=False)
call = (r.choices[0].message.tool_calls or [None])[0]
check("tool_calls parse", call is not None and call.function.name == "get_weather"
      and json.loads(call.function.arguments)["city"] in ("Paris", "Rome") and call.id.startswith("call_"))
check("a call ends with finish_reason tool_calls", r.choices[0].finish_reason == "tool_calls")
follow = messages + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
r = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=4, temperature=0, tools=TOOLS)
check("a conversation with a call and its result is accepted", r.choices[0].message is not None)
stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=300, temperature=1, tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        parallel_tool_calls=False, stream=True)
deltas = [d for chunk in stream for c in chunk.choices for d in (c.delta.tool_calls or [])]
check("streamed tool-call deltas parse", len(deltas) == 1 and deltas[0].function.name == "get_weather"
      and json.loads(deltas[0].function.arguments)["city"] in ("Paris", "Rome"))

# What is refused is refused in OpenAI's error shape, naming the field.
for what, call in [
    ("n above the limit", lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, n=65)),
    ("an invalid schema", lambda: client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}})),
    ("a tool_choice naming no tool", lambda: client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "nope"}})),
    ("top_logprobs out of range", lambda: client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, logprobs=True, top_logprobs=21)),
    ("a bias on no token", lambda: client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias={"99999999": 1})),
]:
    try:
        call()
        check(f"{what} refused", False)
    except openai.BadRequestError as e:
        check(f"{what} refused with a 400 naming its field", e.status_code == 400 and e.body.get("param"))
print("all shapes parsed")
