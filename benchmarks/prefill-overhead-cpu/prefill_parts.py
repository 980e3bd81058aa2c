"""
Fast KVzip's compressed prefill against our full prefill, in one process, in CPU seconds, with the
share of the gate (gate.GateScorer.score) and the eviction (EvictingCache.evict) and a hash of every
kept set (positions kept per compressed layer and head) to compare two versions of the code.

    python -m benchmarks.prefill-overhead-cpu.prefill_parts --model smollm2-135m-gguf --lengths 2048,8192

Run from the repository root (it imports the working tree's modules). Timers wrap the methods for
the run; CPU seconds (time.process_time) are this process's, what other jobs on a shared machine
disturb least. Rounds alternate the order full / fastkvzip.
"""
import argparse
import hashlib
import json
import time

import numpy as np
import torch

import cache as C
import gate
import generate
import model as M
from cache import Budget
from cli import add_model, add_threads, resolve_model
from formats.gate_file import resolve_gate
from harness.quality import load_docs
from prompts import encode_prompt, prompt_format

p = argparse.ArgumentParser()
add_model(p, default="smollm2-135m-gguf")
p.add_argument("--lengths", default="2048,8192")
p.add_argument("--repeats", type=int, default=1)
add_threads(p)
p.add_argument("--budget", type=float, default=0.3)
p.add_argument("--chunk", type=int, default=2048)
p.add_argument("--window", type=int, default=512)
args = p.parse_args()
torch.set_num_threads(args.threads)
folder = resolve_model(args.model)
tok, model = M.load_tokenizer(folder), M.load_model(folder, "cpu", torch.float32)
gates = resolve_gate(None, model.config, args.model)
system = encode_prompt(tok, prompt_format(model.config, args.model).system)
text = [t for _, d in load_docs(tok) for t in d]
parts = {}


def timed(cls, name, key):
    f = getattr(cls, name)

    def g(*a, **kw):
        t0 = time.process_time()
        try:
            return f(*a, **kw)
        finally:
            parts[key] = parts.get(key, 0.0) + time.process_time() - t0
    setattr(cls, name, g)


timed(gate.GateScorer, "score", "gate_cpu_s")
timed(C.EvictingCache, "evict", "evict_cpu_s")


def kept_hash(cache):
    h = hashlib.sha256()
    for layer in cache.compressed:
        kv = cache.layers[layer]
        for i in range(kv.n_heads):
            h.update(kv.head_pos(i).numpy().tobytes() + b"|")
    return h.hexdigest()[:16]


def run(method, ids):
    cache = generate.make_cache(method, model, len(system), gates if method == "fastkvzip" else None)
    parts.clear()
    budget = Budget(args.budget if method == "fastkvzip" else 1.0, args.chunk, args.window)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        generate.prefill(model, cache, ids, len(system), budget)
    out = dict(parts, wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0,
               kv_bytes=cache.nbytes)
    if method == "fastkvzip":
        out["kept_sha"] = kept_hash(cache)
    return out


run("full", system + text[:256]), run("fastkvzip", system + text[:256])  # warm up
for n in map(int, args.lengths.split(",")):
    ids = system + text[:n]
    rows = {"full": [], "fastkvzip": []}
    for r in range(args.repeats):
        for m in (("full", "fastkvzip") if r % 2 == 0 else ("fastkvzip", "full")):
            rows[m].append(run(m, ids))
    med = lambda m, k: float(np.median([x[k] for x in rows[m]]))
    full_cpu = med("full", "cpu_s")
    print(json.dumps(dict(
        model=args.model, context=n, threads=args.threads, load=open("/proc/loadavg").read().split()[0],
        full_cpu_s=full_cpu, fkv_cpu_s=med("fastkvzip", "cpu_s"),
        ratio_cpu=med("fastkvzip", "cpu_s") / full_cpu,
        ratio_wall=med("fastkvzip", "wall_s") / med("full", "wall_s"),
        gate_share=med("fastkvzip", "gate_cpu_s") / full_cpu,
        evict_share=med("fastkvzip", "evict_cpu_s") / full_cpu,
        kept_sha=sorted({x["kept_sha"] for x in rows["fastkvzip"]}), runs=rows)), flush=True)
