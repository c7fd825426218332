#!/usr/bin/env python3
"""Prompt log-probabilities of GGUF files, ours against llama.cpp's, token by token.

For each file: llama.cpp's logits at every prompt position (its Python bindings over a
llama.cpp build, `logits_all`), and ours from `tessera up` on a one-chip topology with
that file as its model, through `/v1/completions` with `echo` and `logprobs` (what an
evaluation harness reads). Prints, per file, the largest and the mean absolute
difference in nats and where the largest is. Files of types Tessera does not load are
reported as such.

usage: backends/scripts/compare-llama-logprobs.py --llama-python DIR --llama-lib DIR
           [--topology T.toml] [--prompt-file F] [--tessera BIN] [--json OUT] [--llama-spread]
           GGUF...
  --llama-python: a directory holding the `llama_cpp` package (llama-cpp-python's
                  source tree) whose ctypes bindings match the build in --llama-lib.
  --llama-lib:    the directory holding libllama.so.
  --topology:     a one-chip topology whose gateway listens on 127.0.0.1:8100; its
                  `model` line is replaced by each file (default
                  topology/examples/smollm2-cpu.toml).
Files made with llama.cpp's `llama-quantize` (e.g. `--allow-requantize IN OUT Q4_K_M`)
show how far each quantization's arithmetic differs. `--llama-spread` also prints how far
llama.cpp moves from its own default when only its arithmetic changes (KV cache in f32
instead of f16; flash attention on): the floor under any other implementation's
agreement with it.
"""
import argparse
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_PROMPT = (
    "The history of the city begins in the early twelfth century, when a small market grew up "
    "around the bridge over the river. Merchants came from the surrounding villages to sell wool, "
    "grain and salt, and within a hundred years the town had its own charter, a guildhall and two "
    "churches. The plague of 1349 killed almost half of the people, but the wool trade recovered "
    "quickly, and by the sixteenth century the city was one of the richest in the region.\n"
)
URL = "http://127.0.0.1:8100"


def theirs(args, path, text, **settings):
    """llama.cpp's log-probability of each prompt token after the first (its default
    context settings, or these)."""
    sys.path.insert(0, args.llama_python)
    os.environ["LLAMA_CPP_LIB_PATH"] = args.llama_lib
    import llama_cpp  # noqa: imported here so that --help needs no llama.cpp

    llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=4096, n_batch=512, verbose=False, **settings)
    tokens = llm.tokenize(text.encode(), add_bos=False, special=False)
    llm.reset()
    llm.eval(tokens)
    out = []
    for i in range(len(tokens) - 1):
        # In f64: the scores are numpy f32, which JSON cannot write and which would
        # round log Z.
        row = [float(x) for x in llm.scores[i]]
        top = max(row)
        log_z = top + math.log(sum(math.exp(x - top) for x in row))
        out.append(float(row[tokens[i + 1]]) - log_z)
    pieces = [llm.detokenize([t]).decode(errors="replace") for t in tokens]
    return pieces, out


def wait_up(proc):
    for _ in range(240):
        if proc.poll() is not None:
            return False
        try:
            urllib.request.urlopen(URL + "/health", timeout=1)
            return True
        except OSError:
            time.sleep(0.5)
    return False


def ours(args, path, text):
    """Ours, through the gateway: (pieces, log-probabilities) or (None, why)."""
    topology = pathlib.Path(args.topology).read_text()
    topology = re.sub(r'(?m)^model = .*$', f'model = "{os.path.abspath(path)}"', topology, count=1)
    with tempfile.TemporaryDirectory() as tmp:
        topo = pathlib.Path(tmp) / "topology.toml"
        topo.write_text(topology)
        log = pathlib.Path(tmp) / "up.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([args.tessera, "up", str(topo)], stdout=out, stderr=subprocess.STDOUT)
        try:
            if not wait_up(proc):
                lines = [line for line in log.read_text().splitlines() if line.startswith("error")]
                return None, (lines[0] if lines else f"tessera did not start (see {log})")
            models = json.load(urllib.request.urlopen(URL + "/v1/models"))
            body = {"model": models["data"][0]["id"], "prompt": text, "max_tokens": 1, "echo": True,
                    "logprobs": 1, "temperature": 0}
            request = urllib.request.Request(URL + "/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            lp = json.load(urllib.request.urlopen(request))["choices"][0]["logprobs"]
            # The echo is the prompt and the one token generated after it.
            return lp["tokens"][:-1], lp["token_logprobs"][1:-1]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--llama-python", required=True)
    p.add_argument("--llama-lib", required=True)
    p.add_argument("--topology", default=str(ROOT / "topology/examples/smollm2-cpu.toml"))
    p.add_argument("--prompt-file")
    p.add_argument("--tessera", default=str(ROOT / "target/release/tessera"))
    p.add_argument("--json", help="write every file's log-probabilities, both sides, to this file")
    p.add_argument("--llama-spread", action="store_true",
                   help="also run llama.cpp with its KV cache in f32 and with flash attention, against its default")
    p.add_argument("gguf", nargs="+")
    args = p.parse_args()
    text = pathlib.Path(args.prompt_file).read_text() if args.prompt_file else DEFAULT_PROMPT
    record = {}
    for path in args.gguf:
        their_pieces, their_lp = theirs(args, path, text)
        our_pieces, our_lp = ours(args, path, text)
        name = os.path.basename(path)
        if our_pieces is None:
            print(f"{name}: not loaded by Tessera: {our_lp}")
            continue
        if our_pieces != their_pieces:
            print(f"{name}: the tokenizations differ ({len(our_pieces)} tokens against {len(their_pieces)})")
            continue
        diffs = [abs(a - b) for a, b in zip(our_lp, their_lp)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        print(f"{name}: {len(diffs)} prompt tokens, max |d logprob| {diffs[worst]:.3f} nats "
              f"(token {worst + 1}, {their_pieces[worst + 1]!r}), mean {sum(diffs) / len(diffs):.4f}")
        record[name] = {"pieces": their_pieces, "ours": our_lp, "llama_cpp": their_lp}
        if args.llama_spread:
            # GGML_TYPE_F32 = 0.
            for label, settings in [("KV cache f32", {"type_k": 0, "type_v": 0}), ("flash attention", {"flash_attn": True})]:
                _, lp = theirs(args, path, text, **settings)
                d = [abs(a - b) for a, b in zip(lp, their_lp)]
                print(f"  llama.cpp with {label} against its default: max {max(d):.3f} nats, mean {sum(d) / len(d):.4f}")
                record[name][f"llama_cpp {label}"] = lp
    if args.json:
        import llama_cpp  # noqa: loaded by theirs() already
        reference = (f"llama-cpp-python {llama_cpp.__version__} (its vendored llama.cpp, CPU), n_ctx 4096, "
                     "n_batch 512, otherwise default context settings (KV cache f16, no flash attention)")
        out = {"prompt": text, "reference": reference, "files": record}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
