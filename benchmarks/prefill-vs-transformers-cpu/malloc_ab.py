"""
Fresh processes in alternation, each timing its prefills three times in turn, as
harness/profile_prefill.py runs them, but from the process's first prefill on (nothing ran in it
before, where in the harness the peak's matmul and the other prefills move glibc's thresholds
first). Two experiments:

- `malloc`: whether keeping freed memory in the process (cli.keep_freed_memory, which our programs
  call) helps or hurts our own prefill. Processes with glibc's default malloc and with the setting,
  each timing our full prefill and Fast KVzip's (the bundled gate, 0.3).
- `shipped`: each program as it runs for its users. Ours with the setting (our programs call it
  through cli.main), transformers with glibc's default (nothing in transformers or torch changes
  it): the speed a user of each sees, the allocator included.

    python -m benchmarks.prefill-vs-transformers-cpu.malloc_ab smollm2-135m-gguf 2048 1 4
    python -m benchmarks.prefill-vs-transformers-cpu.malloc_ab smollm2-135m-gguf 2048 1 3 shipped

Arguments: model, context tokens, threads, processes of each kind, the experiment (default
`malloc`). Run from the repository root; one line per process: its kind, each prefill's median
seconds of 3 and its minor page faults per prefill (fresh pages the kernel mapped and zeroed), then
the means over the processes (`shipped`: also transformers / ours, process pair by pair).
"""
import json
import statistics
import subprocess
import sys

import torch

import cli
from harness.profile_prefill import clocks, load_run, our_prefill
from harness.speed import load_peer, peer_prefill

# experiment -> kind of process -> (malloc, the prefills it times)
EXPERIMENTS = {
    "malloc": {"default": ("default", ["ours", "fastkvzip"]),
               "keep": ("keep", ["ours", "fastkvzip"])},
    "shipped": {"ours": ("keep", ["ours"]), "transformers": ("default", ["transformers"])},
}


def one_process(experiment, kind, name, n, threads):
    """In this process: keep freed memory or not, then 3 x its prefills in turn, as
    harness/profile_prefill.py runs them (budget 0.3, chunks of 2,048, window 512) -> one JSON line."""
    malloc, prefills = EXPERIMENTS[experiment][kind]
    if malloc == "keep":
        cli.keep_freed_memory()
    torch.set_num_threads(threads)
    folder, model, gates, system, text = load_run(name)
    ids = system + text[:n]
    peer = load_peer(folder) if "transformers" in prefills else None
    runs = {run: [] for run in prefills}
    with torch.no_grad():
        for run in prefills * 3:
            if run == "transformers":
                wall, _, faults = clocks(lambda: peer_prefill(peer, ids, 2048))
            else:
                wall, _, faults = clocks(our_prefill(run, model, gates, len(system), ids))
            runs[run].append((wall, faults))
    print(json.dumps(dict(kind=kind, runs=runs)))


def main():
    name, n, threads, processes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    experiment = sys.argv[5] if len(sys.argv) > 5 else "malloc"
    seen = {kind: [] for kind in EXPERIMENTS[experiment]}
    for _ in range(processes):
        for kind in seen:  # alternate: drift on the machine hits both alike
            out = subprocess.run([sys.executable, "-m", __spec__.name, "--one", experiment, kind,
                                  name, str(n), str(threads)],
                                 capture_output=True, text=True, check=True)
            runs = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
            seen[kind].append({run: statistics.median(s for s, _ in v) for run, v in runs.items()})
            print(kind, ", ".join(f"{run} {seen[kind][-1][run]:.3f} s (faults "
                                  f"{', '.join(f'{f:,}' for _, f in v)})"
                                  for run, v in runs.items()), flush=True)
    for kind, rows in seen.items():
        print(f"mean over {len(rows)} processes, {kind}: " + ", ".join(
            f"{run} {statistics.mean(r[run] for r in rows):.3f} s" for run in rows[0]))
    if experiment == "shipped":
        ratios = [t["transformers"] / o["ours"] for o, t in zip(seen["ours"], seen["transformers"])]
        print(f"transformers / ours, pair by pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        one_process(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
