"""
Decode at B = 1: our full cache, Fast KVzip 0.3 and transformers on the same context, one process,
1 thread; each round times `--steps` greedy-free decode steps of each (fixed tokens), the order of
the three reversed every other round; CPU milliseconds per step (time.process_time).

    python -m benchmarks.prefill-overhead-cpu.decode_ab --model smollm2-135m-gguf --length 2048

Run from the repository root. Prints one JSON line: the medians and every round.
"""
import argparse
import collections
import json
import time

import numpy as np
import torch

import generate
import model as M
from cache import Budget, EvictingCache
from cli import add_model, add_threads, resolve_model
from formats.gate_file import resolve_gate
from harness.quality import load_docs
from harness.speed import load_peer, peer_prefill
from prompts import encode_prompt, prompt_format

p = argparse.ArgumentParser()
add_model(p, default="smollm2-135m-gguf")
p.add_argument("--length", type=int, default=2048)
p.add_argument("--steps", type=int, default=16)
p.add_argument("--rounds", type=int, default=5)
add_threads(p)
a = p.parse_args()
torch.set_num_threads(a.threads)
folder = resolve_model(a.model)
tok, model = M.load_tokenizer(folder), M.load_model(folder, "cpu", torch.float32)
system = encode_prompt(tok, prompt_format(model.config, a.model).system)
ids = system + [t for _, d in load_docs(tok) for t in d][:a.length]
steps = {}
with torch.no_grad():
    for method, b in (("full", 1.0), ("fastkvzip", 0.3)):
        gates = resolve_gate(None, model.config, a.model) if method == "fastkvzip" else None
        cache = generate.make_cache(method, model, len(system), gates)
        generate.prefill(model, cache, ids, len(system), Budget(b, 2048, 512))
        if isinstance(cache, EvictingCache):
            cache.start_decoding()
        steps[method] = (lambda c: (lambda t: generate.decode_one(model, c, t)))(cache)
    forward, _, _ = peer_prefill(load_peer(folder), ids, 2048)
    steps["hf"] = lambda t: forward([t])
    res = collections.defaultdict(list)
    for r in range(a.rounds):
        for n in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            f = steps[n]
            f(5)
            t0 = time.process_time()
            for i in range(a.steps):
                f(100 + i)
            res[n].append((time.process_time() - t0) / a.steps * 1e3)
print(json.dumps(dict(model=a.model, length=a.length, ms={n: float(np.median(v)) for n, v in res.items()},
                      runs=res)))
