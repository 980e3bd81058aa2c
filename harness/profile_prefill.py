"""
Where a CPU prefill spends its time: ours (full cache, and Fast KVzip at a budget) beside
transformers on the same checkpoint, the same context and the same chunks, timed in turn and then
under torch's profiler.

    python -m harness.profile_prefill                                  # Gemma 3 270M, 2K tokens, 3 runs each
    python -m harness.profile_prefill --model smollm2-135m-gguf --lengths 2048,8192 --no-profile

(run from the repository root: `-m` puts it on the import path.)

For each length it prints every run's seconds (ours full, transformers, ours fastkvzip, again and
again: load on the machine hits them alike), wall-clock and this process's CPU seconds (which other
jobs on a shared machine disturb less), the medians and ours / transformers as a speed ratio (> 1:
ours is faster), then, unless --no-profile, the top operators by self time of one more prefill of
each.
"""
import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import cli
import generate
from cache import Budget
from cli import resolve_model
from formats.checkpoint import load_checked, read_tokenizer
from formats.gate_file import resolve_gate
from harness.quality import load_docs
from harness.speed import load_peer, peer_prefill
from prompts import encode_prompt, prompt_format


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model(p)
    p.add_argument("--lengths", type=cli.ints, default=[2048], help="context lengths in tokens")
    p.add_argument("--budget", type=float, default=0.3, help="Fast KVzip's budget")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each, taken in turn")
    p.add_argument("--chunk", type=int, default=2048,
                   help="prefill chunk (bench.py's --speed-chunk)")
    p.add_argument("--window", type=int, default=512,
                   help="local window (bench.py's --speed-window)")
    cli.add_threads(p, default=2)
    p.add_argument("--rows", type=int, default=12, help="operators shown per profile")
    p.add_argument("--no-profile", action="store_true", help="timings only")
    args = p.parse_args()
    if (not 0 < args.budget <= 1 or min(min(args.lengths), args.repeats, args.chunk) < 1
        or args.window < 0):
        p.error("--budget must be in (0, 1]; --lengths, --repeats and --chunk >= 1; "
                "--window >= 0")
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    tok, model = read_tokenizer(folder), load_checked(folder, "cpu", torch.float32)
    peer = load_peer(folder)
    if peer is None:
        p.error("transformers is not installed (pip install -r requirements-test.txt)")
    system = encode_prompt(tok, prompt_format(model.config, args.model).system)
    text = [t for _, d in load_docs(tok) for t in d]
    for n in args.lengths:
        if len(text) < n:
            p.error(f"--lengths {n}: the evaluation text holds only {len(text)} tokens")
        ids = system + text[:n]

        def runs_for(ids):
            def ours(method, budget):
                # the gate loads before the clock
                gates = (resolve_gate(None, model.config, args.model) if method == "fastkvzip"
                         else None)
                cache = generate.make_cache(method, model, len(system), gates)
                return lambda: generate.prefill(model, cache, ids, len(system),
                                                Budget(budget, args.chunk, args.window))
            return {"ours, full": lambda: ours("full", 1.0),
                    "transformers": lambda: (lambda: peer_prefill(peer, ids, args.chunk)),
                    f"ours, fastkvzip {args.budget:g}": lambda: ours("fastkvzip", args.budget)}

        runs = runs_for(ids)
        secs, cpu = {name: [] for name in runs}, {name: [] for name in runs}
        with torch.no_grad():
            # warm up (first calls allocate), shortly
            for make in runs_for(ids[:len(system) + 512]).values():
                make()()
            for _ in range(args.repeats):
                for name, make in runs.items():
                    fn = make()
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    secs[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
        peer_s, peer_cpu = (float(np.median(secs["transformers"])),
                            float(np.median(cpu["transformers"])))
        print(f"\n== {args.model}, {n} context tokens ({len(ids)} with the system prompt), chunks "
              f"of {args.chunk}, {args.threads} threads")
        # CPU seconds of this process: what other jobs on the machine disturb least
        for name, s in secs.items():
            med, med_cpu = float(np.median(s)), float(np.median(cpu[name]))
            print(f"  {name:24s} median {med:7.2f} s ({len(ids) / med:6.0f} tok/s), "
                  f"x{peer_s / med:.2f} of transformers; CPU {med_cpu:7.2f} s, "
                  f"x{peer_cpu / med_cpu:.2f}; runs {', '.join(f'{x:.2f}' for x in s)}; CPU "
                  f"{', '.join(f'{x:.2f}' for x in cpu[name])}")
        if args.no_profile:
            continue
        for name, make in runs.items():
            fn = make()
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            print(f"\n-- {name}: operators by self time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
