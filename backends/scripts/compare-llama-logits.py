#!/usr/bin/env python3
"""Whole rows of logits along a greedy generation, ours against llama.cpp's, and each
against the exact logits (float64 over the file's dequantized weights).

For each GGUF file: the prompt tokenized by llama.cpp; `tessera generate --prompt-ids ...
--dump-logits` greedily for --tokens tokens (f32 arithmetic, KV cache f16 unless --kv-dtype); llama.cpp's
logits at the same positions of the same sequence (its Python bindings, default context
settings: KV cache f16); and, unless --no-exact, the exact logits there
(backends/scripts/llama_exact.py; a 135M-parameter model takes a minute). Per position the
relative difference is max |a - b| over the vocabulary divided by max |b|; printed are its
largest and mean over positions, and whether the greedy tokens agree.

usage: backends/scripts/compare-llama-logits.py --llama-python DIR --llama-lib DIR
           [--tessera BIN] [--prompt-file F] [--tokens N] [--kv-dtype f16|f32] [--no-exact]
           GGUF...
  --llama-python: llama-cpp-python's source tree (the `llama_cpp` package) matching the
                  build in --llama-lib.
  --llama-lib:    the directory holding libllama.so.
Needs `pip install gguf numpy`. Files made with llama.cpp's `llama-quantize --allow-requantize
IN OUT TYPE` show each quantization's arithmetic.
"""
import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "backends" / "scripts"))
from llama_exact import exact_logits  # noqa: E402

DEFAULT_PROMPT = (
    "The history of the city begins in the early twelfth century, when a small market grew up "
    "around the bridge over the river. Merchants came from the surrounding villages to sell wool, "
    "grain and salt, and within a hundred years the town had its own charter, a guildhall and two "
    "churches."
)


def relative(a, b):
    """(max, mean) over rows of max |a - b| / max |b|."""
    import numpy as np

    rel = np.abs(a - b).max(1) / np.abs(b).max(1)
    return rel.max(), rel.mean()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--llama-python", required=True)
    p.add_argument("--llama-lib", required=True)
    p.add_argument("--tessera", default=str(ROOT / "target/release/tessera"))
    p.add_argument("--prompt-file")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--no-exact", action="store_true", help="skip the exact logits")
    p.add_argument("--kv-dtype", default="f16", help="our KV cache's dtype (f16, as llama.cpp's default; f32)")
    p.add_argument("gguf", nargs="+")
    args = p.parse_args()
    text = pathlib.Path(args.prompt_file).read_text() if args.prompt_file else DEFAULT_PROMPT
    sys.path.insert(0, args.llama_python)
    os.environ["LLAMA_CPP_LIB_PATH"] = args.llama_lib
    import numpy as np
    import llama_cpp

    for path in args.gguf:
        name = os.path.basename(path)
        llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=1024, n_batch=512, verbose=False)
        prompt = llm.tokenize(text.encode(), add_bos=True, special=False)
        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "logits.npy")
            run = subprocess.run([args.tessera, "generate", "--model", path, "--prompt-ids",
                                  ",".join(map(str, prompt)), "--max-tokens", str(args.tokens), "--ignore-eos",
                                  "--kv-dtype", args.kv_dtype, "--dump-logits", dump], capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{name}: tessera generate failed: {run.stderr.strip().splitlines()[-1:]}")
                continue
            ours = np.load(dump).astype(np.float64)
        ours_greedy = [int(t) for t in ours.argmax(1)]
        seq = prompt + ours_greedy[:-1]
        llm.reset()
        llm.eval(seq)
        at = range(len(prompt) - 1, len(seq))
        theirs = np.array([[float(x) for x in llm.scores[i]] for i in at])
        their_greedy = [int(t) for t in theirs.argmax(1)]
        agree = next((i for i, (a, b) in enumerate(zip(ours_greedy, their_greedy)) if a != b), None)
        greedy = "all agree" if agree is None else f"first differ at token {agree}"
        mx, mean = relative(ours, theirs)
        print(f"{name}: {len(prompt)}-token prompt, {len(ours_greedy)} greedy tokens ({greedy}); "
              f"ours from llama.cpp's: max {100 * mx:.2f}% mean {100 * mean:.2f}%")
        if not args.no_exact:
            truth = np.array(exact_logits(path, seq))[len(prompt) - 1:]
            om, oa = relative(ours, truth)
            tm, ta = relative(theirs, truth)
            best = truth.argmax(1)
            print(f"  from the exact logits: ours max {100 * om:.2f}% mean {100 * oa:.2f}%; "
                  f"llama.cpp's max {100 * tm:.2f}% mean {100 * ta:.2f}%; exact argmax: ours "
                  f"{int((ours.argmax(1) == best).sum())}/{len(best)}, llama.cpp's {int((theirs.argmax(1) == best).sum())}")


if __name__ == "__main__":
    main()
