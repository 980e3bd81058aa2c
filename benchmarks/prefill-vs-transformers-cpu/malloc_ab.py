"""
Whether keeping freed memory in the process (cli.keep_freed_memory, which our programs call) helps
or hurts our own prefill: fresh processes in alternation, glibc's default malloc and the setting,
each timing our full prefill and Fast KVzip's (the bundled gate, 0.3) three times in turn, from the
process's first prefill on (nothing else ran in it before, unlike in harness/profile_prefill.py,
where the peak's matmul and transformers' prefills move glibc's thresholds first).

    python -m benchmarks.prefill-vs-transformers-cpu.malloc_ab smollm2-135m-gguf 2048 1 4

Arguments: model, context tokens, threads, processes of each setting. Run from the repository
root; one line per process: the setting, each run's median seconds of 3 and its minor page faults
per prefill (fresh pages the kernel mapped and zeroed), then the means over the processes.
"""
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

import cli
import generate
from cache import Budget
from formats.checkpoint import load_checked, read_tokenizer
from formats.gate_file import resolve_gate
from harness.quality import load_docs
from prompts import encode_prompt, prompt_format


def one_process(mode, name, n, threads):
    """In this process: keep freed memory or not, then 3 x (full, fastkvzip) -> one JSON line."""
    if mode == "keep":
        cli.keep_freed_memory()
    torch.set_num_threads(threads)
    folder = cli.resolve_model(name)
    tok, model = read_tokenizer(folder), load_checked(folder, "cpu", torch.float32)
    gates = resolve_gate(None, model.config, name)
    system = encode_prompt(tok, prompt_format(model.config, name).system)
    ids = system + [t for _, doc in load_docs(tok) for t in doc][:n]
    runs = {"full": [], "fastkvzip": []}
    with torch.no_grad():
        for run in ["full", "fastkvzip"] * 3:
            cache = generate.make_cache(run, model, len(system),
                                        gates if run == "fastkvzip" else None)
            budget = Budget(0.3 if run == "fastkvzip" else 1.0, 2048)
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            generate.prefill(model, cache, ids, len(system), budget)
            runs[run].append((time.perf_counter() - t0,
                              resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
    print(json.dumps(dict(mode=mode, runs=runs)))


def main():
    name, n, threads, processes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    seen = {"default": [], "keep": []}
    for _ in range(processes):
        for mode in seen:  # alternate: drift on the machine hits both alike
            out = subprocess.run([sys.executable, "-m", __spec__.name, "--one", mode, name, str(n),
                                  str(threads)], capture_output=True, text=True, check=True)
            runs = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
            seen[mode].append({run: statistics.median(s for s, _ in v) for run, v in runs.items()})
            print(mode, ", ".join(f"{run} {seen[mode][-1][run]:.3f} s (faults "
                                  f"{', '.join(f'{f:,}' for _, f in v)})"
                                  for run, v in runs.items()), flush=True)
    for mode, rows in seen.items():
        print(f"mean over {len(rows)} processes, {mode}: " + ", ".join(
            f"{run} {statistics.mean(r[run] for r in rows):.3f} s" for run in rows[0]))


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        one_process(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
