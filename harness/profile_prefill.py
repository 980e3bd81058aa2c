"""
Our CPU prefill beside transformers' on the same checkpoint, the same context, the same chunks and
the same threads, in one process: speed ratios, where the time goes, and how close each comes to
the CPU's fp32 matmul peak.

    python -m harness.profile_prefill --models smollm2-135m-gguf --lengths 2048 --threads 1 --repeats 1
    python -m harness.profile_prefill --lengths 2048,8192 --threads 1,2 --repeats 3 --parts 1 \\
        --json prefill.json          # both offline models: the full benchmark

(run from the repository root: `-m` puts it on the import path.)

For each model, length and thread count, every round times ours (full cache), transformers (SDPA,
its DynamicCache) and ours with Fast KVzip (the bundled gate, --budget), in an order that rotates
from round to round, so that load on a shared machine hits all three alike. It prints, per round
and as medians: wall seconds, transformers / ours (> 1: ours is faster), Fast KVzip / our full
prefill and the gate's FLOP share (the gate's projections over the model's linear and attention
FLOPs), and each prefill's fraction of the fp32 peak: its FLOPs over its seconds, against a plain
2048 x 2048 x 2048 matmul timed on the same threads. FLOPs are counted once, written out in
`prefill_flops`: the linear layers (2 per multiply-add, the logits of each chunk's last token
included) and causal attention (q.k and p.v over the visible pairs only, a window's included).

--parts N adds N more rounds of each under timers around the parts of a prefill (QKV and output
projections, MLP, norms, rotary, attention, cache writes, masks, the gate, the eviction; the rest is
"other"), side by side. --ops adds torch's profiler's operator table.

Each round also counts each prefill's minor page faults: fresh pages the kernel maps and zeroes
when freed memory went back to it. --malloc keep (the default, as in our programs:
cli.keep_freed_memory) keeps freed memory in the process for ours and transformers alike;
--malloc default measures glibc's own behaviour.

--json FILE keeps every measured round (written atomically after each) and resumes: a rerun with
the same FILE skips the rounds it holds and the peaks it measured.
"""
import argparse
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import cli
import gate
import generate
import kernels
import model as M
from cache import Budget, EvictingCache, WindowKV
from cli import resolve_model
from formats.checkpoint import load_checked, read_tokenizer
from formats.gate_file import resolve_gate
from harness.quality import load_docs
from harness.speed import load_peer, peer_prefill
from prompts import encode_prompt, prompt_format

RUNS = ("ours", "transformers", "fastkvzip")
PARTS = ("qkv proj", "o proj", "mlp", "attention", "cache writes", "norms", "rotary", "masks",
         "gate", "eviction", "other")


# ------------------------------------------------------------------------------------------ FLOPs

def prefill_flops(cfg, n, chunk, gated_layers=0, gate_dims=(0, 0)):
    """FLOPs of prefilling n tokens in chunks of `chunk` (each chunk's last logits only):
    {"linear", "attention", "gate", "total"}. Linear: per token and layer 2·D·(Hq·d + 2·Hk·d) for q,
    k, v, 2·Hq·d·D for o, 2·3·D·I for the MLP; plus 2·D·V per chunk for the logits. Attention: 2·d
    for q·k and 2·d for p·v per query head and visible (query, key) pair: (i + 1) pairs for query i
    causally, min(i + 1, W) in a window layer. Gate (gated_layers compressed layers): its two
    projections, 2·D·(q_out + k_out) per token and layer, gate_dims = (q_out, k_out)."""
    D, d, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    Hq, Hk, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    per_token = 2 * D * (Hq * d + 2 * Hk * d) + 2 * Hq * d * D + 2 * 3 * D * I
    linear = n * L * per_token + (-(-n // chunk)) * 2 * D * cfg.vocab_size
    i = np.arange(1, n + 1, dtype=np.float64)  # keys visible to query i-1, causally
    pairs = sum(float(np.minimum(i, cfg.window(layer) or n).sum()) for layer in range(L))
    attention = 4 * d * Hq * pairs
    gate_flops = n * gated_layers * 2 * D * sum(gate_dims)
    return dict(linear=linear, attention=attention, gate=gate_flops,
                total=linear + attention)


def matmul_peak(threads, n=2048, repeats=10):
    """fp32 FLOP/s of a plain n x n x n matmul on `threads` threads -> (per wall second, per CPU
    second times threads: what the threads do while they run, steadier on a loaded machine): the
    best of `repeats` (load on the machine only ever slows it)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    timed = [clocks(lambda: a @ b) for _ in range(repeats)]
    return (2 * n ** 3 / min(w for w, _, _ in timed),
            2 * n ** 3 * threads / min(max(c, 1e-9) for _, c, _ in timed))


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def clocks(fn):
    """-> (wall seconds, this process's CPU seconds, its minor page faults: fresh pages the kernel
    had to map and zero) of fn()."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


# ------------------------------------------------------------------------------------------ parts

class Parts:
    """Seconds per part of a prefill (clock: time.perf_counter or time.process_time), from timers
    around modules and functions; a part entered inside another part counts to the outer one
    (nothing is counted twice)."""

    def __init__(self, clock):
        self.seconds, self._inside, self._undo, self.clock = {}, False, [], clock

    def wrap(self, owner, name, part):
        """Time owner.name (a function of a module or class, or a module instance's forward)."""
        f = getattr(owner, name)
        had_own = name in vars(owner)

        def timed(*a, **kw):
            if self._inside:
                return f(*a, **kw)
            self._inside, t0 = True, self.clock()
            try:
                return f(*a, **kw)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + self.clock() - t0
                self._inside = False
        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, f) if had_own else delattr(owner, name))

    def modules(self, root, part_of):
        """Time every submodule of root that part_of(name, module) names a part for."""
        for name, mod in root.named_modules():
            part = part_of(name, mod)
            if part is not None:
                self.wrap(mod, "forward", part)

    def undo(self):
        for f in reversed(self._undo):
            f()
        self._undo.clear()


def _module_part(name, mod):
    """The part a module of ours or of transformers belongs to (their names match the checkpoint's)."""
    leaf, kind = name.rsplit(".", 1)[-1], type(mod).__name__
    if leaf in ("q_proj", "k_proj", "v_proj") and ".self_attn." in f".{name}.":
        return "qkv proj"
    if leaf == "o_proj":
        return "o proj"
    if leaf == "mlp":
        return "mlp"
    if kind.endswith("RMSNorm"):
        return "norms"
    if kind == "Rotary" or kind.endswith("RotaryEmbedding"):
        return "rotary"
    return None


@contextlib.contextmanager
def timing_ours(model, clock):
    parts = Parts(clock)
    parts.modules(model, _module_part)
    parts.wrap(M, "apply_rope", "rotary")
    parts.wrap(kernels.RaggedKV, "attend", "attention")
    for cls in (kernels.RaggedKV, WindowKV):
        parts.wrap(cls, "append", "cache writes")
    parts.wrap(WindowKV, "wrap", "cache writes")
    parts.wrap(gate.GateScorer, "score", "gate")
    parts.wrap(EvictingCache, "evict", "eviction")
    try:
        yield parts
    finally:
        parts.undo()


@contextlib.contextmanager
def timing_peer(peer, clock):
    from transformers import DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    parts = Parts(clock)
    parts.modules(peer, _module_part)
    modeling = sys.modules[type(peer).__module__]
    for name in ("apply_rotary_pos_emb", "create_causal_mask", "create_sliding_window_causal_mask"):
        if hasattr(modeling, name):
            parts.wrap(modeling, name, "rotary" if name.startswith("apply") else "masks")
    parts.wrap(DynamicCache, "update", "cache writes")
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    # the attention interface is a registry entry, not an attribute: time it through a holder
    holder = type("Holder", (), {"f": staticmethod(sdpa)})
    parts.wrap(holder, "f", "attention")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = holder.f
    try:
        yield parts
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        parts.undo()


# ------------------------------------------------------------------------------------------- runs

def load_json(path):
    if path and Path(path).is_file():
        return json.loads(Path(path).read_text())
    return {"peak_flops": {}, "rows": {}}


def save_json(path, data):
    if path:  # atomically: an interrupted run leaves the previous file whole
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


def load_run(name):
    """-> (its folder, the fp32 model on the CPU, its bundled gate, the system prompt's ids, the
    evaluation text's ids): what the prefills of `name` here read."""
    folder = resolve_model(name)
    tok, model = read_tokenizer(folder), load_checked(folder, "cpu", torch.float32)
    gates = resolve_gate(None, model.config, name)
    system = encode_prompt(tok, prompt_format(model.config, name).system)
    return folder, model, gates, system, [t for _, d in load_docs(tok) for t in d]


def our_prefill(run, model, gates, n_system, ids, budget=0.3, chunk=2048, window=512):
    """-> our prefill of ids ("ours": the full cache; "fastkvzip": the gate at `budget`), ready to
    call (the cache and the gate built before the clock). The defaults are main()'s."""
    method, ratio = ("fastkvzip", budget) if run == "fastkvzip" else ("full", 1.0)
    cache = generate.make_cache(method, model, n_system, gates if method == "fastkvzip" else None)
    return lambda: generate.prefill(model, cache, ids, n_system, Budget(ratio, chunk, window))


def bench_model(args, name, data, error):
    folder, model, gates, system, text = load_run(name)
    peer = load_peer(folder)
    if peer is None:
        error("transformers is not installed (pip install -r requirements-test.txt)")
    cfg = model.config

    def make(run, ids):
        """-> a prefill of ids, ready to call."""
        if run == "transformers":
            return lambda: peer_prefill(peer, ids, args.chunk)
        return our_prefill(run, model, gates, len(system), ids, args.budget, args.chunk,
                           args.window)

    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for run in RUNS:  # warm up (first calls allocate), shortly
                make(run, system + text[:512])()
            for n in args.lengths:
                if len(text) < n:
                    error(f"--lengths {n}: the evaluation text holds only {len(text)} tokens")
                ids = system + text[:n]
                key = f"{name} {n} {threads}"
                row = data["rows"].setdefault(key, dict(model=name, context=n, tokens=len(ids),
                                                        threads=threads, rounds=[]))
                row["flops"] = prefill_flops(cfg, len(ids), args.chunk,
                                             len(cfg.compressed_layers),
                                             (gates.q_weight.shape[1], gates.k_weight.shape[1]))
                while len(row["rounds"]) < args.repeats:
                    r = len(row["rounds"])
                    order = RUNS[r % 3:] + RUNS[:r % 3]  # rotate: each run leads in turn
                    times = {}
                    for run in order:
                        fn = make(run, ids)
                        times[run], times[f"{run} cpu"], times[f"{run} faults"] = clocks(fn)
                    times["load"] = os.getloadavg()[0]
                    row["rounds"].append(times)
                    save_json(args.json, data)
                    print(f"  {key} round {r + 1}: " + ", ".join(
                        f"{k} {times[k]:.2f} s" for k in order) + f" (load {times['load']:.1f})",
                        flush=True)
                report(row, data["peak_flops"].get(str(threads)))
                row.setdefault("parts", [])
                clock = time.process_time if args.clock == "cpu" else time.perf_counter
                while len(row["parts"]) < args.parts:  # rounds of the three, rotated
                    r, by_run = len(row["parts"]), {"clock": args.clock}
                    for run in RUNS[r % 3:] + RUNS[:r % 3]:
                        fn = make(run, ids)
                        ctx = (timing_peer(peer, clock) if run == "transformers"
                               else timing_ours(model, clock))
                        with ctx as parts:
                            t0 = clock()
                            fn()
                            total = clock() - t0
                        parts.seconds["other"] = total - sum(parts.seconds.values())
                        by_run[run] = dict(parts.seconds, total=total)
                    row["parts"].append(by_run)
                    save_json(args.json, data)
                if row["parts"]:
                    print(parts_table(row["parts"]))
                if args.ops:
                    for run in RUNS:
                        fn = make(run, ids)
                        with profile(activities=[ProfilerActivity.CPU]) as prof:
                            fn()
                        print(f"\n-- {key} {run}: operators by self time")
                        print(prof.key_averages().table(sort_by="self_cpu_time_total",
                                                        row_limit=args.rows))


def report(row, peak):
    """Print one row's medians: ratios (of wall seconds, and of CPU seconds) and fractions of the
    peak."""
    rounds, f = row["rounds"], row["flops"]
    share = f["gate"] / f["total"]
    print(f"== {row['model']}, {row['context']} context tokens ({row['tokens']} with the system "
          f"prompt), {row['threads']} threads, {len(rounds)} rounds, load "
          f"{np.median([x['load'] for x in rounds]):.1f}")
    for clock, suffix in (("wall", ""), ("CPU", " cpu")):
        med = {run: float(np.median([x[run + suffix] for x in rounds])) for run in RUNS}
        speed = [x["transformers" + suffix] / x["ours" + suffix] for x in rounds]
        gated = [x["fastkvzip" + suffix] / x["ours" + suffix] for x in rounds]
        print(f"  {clock} seconds (medians): ours {med['ours']:.2f}, transformers "
              f"{med['transformers']:.2f}, fastkvzip {med['fastkvzip']:.2f}")
        print(f"    transformers / ours: median {np.median(speed):.3f} (runs "
              f"{', '.join(f'{x:.3f}' for x in speed)})")
        print(f"    fastkvzip / ours: median {np.median(gated):.3f} (runs "
              f"{', '.join(f'{x:.3f}' for x in gated)}); within the gate's FLOP share + 2% "
              f"({1 + share + 0.02:.3f}): {sum(x <= 1 + share + 0.02 for x in gated)} of {len(gated)}")
        if peak:  # CPU seconds: FLOPs per CPU second times threads, against the same for the peak
            top = peak[0] if clock == "wall" else peak[1]
            scale = 1 if clock == "wall" else row["threads"]
            frac = {run: scale * f["total"] / med[run] / top for run in ("ours", "transformers")}
            print(f"    fraction of the fp32 matmul peak ({top / 1e9:.1f} GFLOP/s): ours "
                  f"{frac['ours']:.1%}, transformers {frac['transformers']:.1%}")
    if all("ours faults" in x for x in rounds):  # rounds measured before the harness counted them
        print("  minor page faults per prefill (medians): " + ", ".join(
            f"{run} {np.median([x[run + ' faults'] for x in rounds]):,.0f}" for run in RUNS))
    print(f"  FLOPs: linear {f['linear'] / 1e9:.1f} G, attention {f['attention'] / 1e9:.1f} G, "
          f"gate {f['gate'] / 1e9:.2f} G ({share:.2%} of linear + attention)")


def parts_table(rounds):
    """Markdown: milliseconds per part (medians over the rounds), ours / transformers / fastkvzip
    side by side, and transformers / ours per part (> 1: ours is faster)."""
    clock = rounds[0]["clock"]
    lines = [f"| part ({clock} ms, median of {len(rounds)}) | ours | transformers | fastkvzip | "
             "transformers / ours |", "|---|---|---|---|---|"]
    for part in PARTS + ("total",):
        cells = [np.median([x[run].get(part, 0.0) for x in rounds]) for run in RUNS]
        if any(cells):
            ratio = f"{cells[1] / cells[0]:.2f}" if cells[0] and cells[1] else ""
            lines.append(f"| {part} | " + " | ".join(f"{1e3 * c:.0f}" for c in cells)
                         + f" | {ratio} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m-gguf,gemma3-270m-gguf",
                   help="comma list of models (what --model takes elsewhere)")
    p.add_argument("--lengths", type=cli.ints, default=[2048], help="context lengths in tokens")
    cli.add_threads(p, default=[2], many=True)
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three runs, rotated")
    p.add_argument("--budget", type=float, default=0.3, help="Fast KVzip's budget")
    p.add_argument("--chunk", type=int, default=2048,
                   help="prefill chunk (bench.py's --speed-chunk)")
    p.add_argument("--window", type=int, default=512,
                   help="local window (bench.py's --speed-window)")
    p.add_argument("--parts", type=int, default=0,
                   help="rounds of the three timed by part (rotated), after the plain rounds")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="the parts' clock: wall, or this process's CPU seconds (steadier on a "
                   "loaded machine with 1 thread; with 2 it counts a spinning thread too)")
    p.add_argument("--ops", action="store_true", help="torch profiler's operator table")
    p.add_argument("--no-profile", action="store_true",
                   help="no operator table: the default now (earlier runs' commands pass it)")
    p.add_argument("--rows", type=int, default=12, help="operators shown per --ops table")
    p.add_argument("--json", help="keep the rounds in this file and resume from it")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: freed memory stays in the process, as in our programs "
                   "(cli.keep_freed_memory), for ours and transformers alike; default: glibc's "
                   "own behaviour (freed blocks go back to the kernel). One per --json file")
    args = p.parse_args()
    if (not 0 < args.budget <= 1 or min(args.repeats, args.chunk) < 1 or args.window < 0
            or not args.lengths or not args.threads):
        p.error("--budget must be in (0, 1]; --lengths, --threads, --repeats and --chunk >= 1; "
                "--window >= 0")
    data = load_json(args.json)
    # a file from before the flag was measured with glibc's default
    if data.setdefault("malloc", "default" if data["rows"] else args.malloc) != args.malloc:
        p.error(f"--json {args.json} holds rounds with --malloc {data['malloc']}: use another file")
    if args.malloc == "keep" and not cli.keep_freed_memory():
        print("note: not glibc: --malloc keep changes nothing here", flush=True)
    for threads in args.threads:  # the peak first: the machine's, not the models'
        if str(threads) not in data["peak_flops"]:
            data["peak_flops"][str(threads)] = matmul_peak(threads)
            save_json(args.json, data)
        wall, cpu = data["peak_flops"][str(threads)]
        print(f"fp32 matmul peak, {threads} threads: {wall / 1e9:.1f} GFLOP/s (wall), "
              f"{cpu / 1e9:.1f} GFLOP/s (per CPU second x threads)", flush=True)
    for name in args.models.split(","):
        bench_model(args, name, data, p.error)


if __name__ == "__main__":
    main()
