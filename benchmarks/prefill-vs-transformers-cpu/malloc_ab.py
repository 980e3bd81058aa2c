"""
Whether keeping freed memory in the process (cli.keep_freed_memory, which our programs call) helps
or hurts our own prefill: fresh processes in alternation, glibc's default malloc and the setting,
each timing our full prefill and Fast KVzip's (the bundled gate, 0.3) three times in turn, as
harness/profile_prefill.py runs them, but from the process's first prefill on (nothing ran in it
before, where in the harness the peak's matmul and transformers' prefills move glibc's thresholds
first).

    python -m benchmarks.prefill-vs-transformers-cpu.malloc_ab smollm2-135m-gguf 2048 1 4

Arguments: model, context tokens, threads, processes of each setting. Run from the repository
root; one line per process: the setting, each run's median seconds of 3 and its minor page faults
per prefill (fresh pages the kernel mapped and zeroed), then the means over the processes.
"""
import json
import statistics
import subprocess
import sys

import torch

import cli
from harness.profile_prefill import clocks, load_run, our_prefill


def one_process(mode, name, n, threads):
    """In this process: keep freed memory or not, then 3 x (ours, fastkvzip) as
    harness/profile_prefill.py runs them (budget 0.3, chunks of 2,048, window 512) -> one JSON line."""
    if mode == "keep":
        cli.keep_freed_memory()
    torch.set_num_threads(threads)
    _, model, gates, system, text = load_run(name)
    ids = system + text[:n]
    runs = {"ours": [], "fastkvzip": []}
    with torch.no_grad():
        for run in ["ours", "fastkvzip"] * 3:
            wall, _, faults = clocks(our_prefill(run, model, gates, len(system), ids))
            runs[run].append((wall, faults))
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
