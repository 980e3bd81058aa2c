"""
The layer swap: in which compressed layer the gate's kept set costs it its KVzip teacher's quality.

For each of the benchmark's Austen contexts (quality.make_samples: the contexts, pass keys and JSON
key-value questions of `bench.py --lengths N --contexts K --seed S`) and each budget, the teacher
(T) and the gate (G) score the context once and each picks its kept set with the cache's own rule:
one global threshold over every compressed layer and head (teacher.kept_by_rule, what
EvictingCache.evict keeps). Then every combination of per-layer kept sets, T or G in each compressed
layer (2^L caches, named in the order of the compressed layers: "TGT" = teacher in the first and
last), answers the benchmark's questions (quality.evaluate). All-T is the kvzip method's cache and
all-G fastkvzip's, the same kept tokens (tests/test_layer_swap.py). A mixed cache holds what each
layer's source keeps, so its KV held differs from the budget when T and G split the budget
differently among the layers: it is printed beside the scores.

    python -m harness.layer_swap --out ~/.cache/fastkvzip/runs/layer-swap       # 3 x 4096 tokens at 0.5
    python -m harness.layer_swap --budgets 0.5,0.4 --gate other.safetensors --out ...

(run from the repository root: `-m` puts it on the import path.)

Each finished context is written to --out/contexts/ at once; a rerun with the same flags resumes.
"""
import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

import cli
from cache import EvictingCache
from cli import UsageError, file_sha256, resolve_model
from formats.checkpoint import check_folder, load_checked
from formats.gate_file import GateError, resolve_gate
from gate import GateScorer
from harness import quality
from model import ModelError
from prompts import prompt_format
from teacher import KVzipTeacher, agreement, kept_by_rule, pool_agreement, token_marks

TASKS = ("passkey", "kv", "nll_next", "nll_repeat", "agreement")


def capture(model, sample, teacher, scorer, chunk_size):
    """One full prefill of the context -> (full cache, {"T": teacher's, "G": gate's scores}), each
    (L, H, n_context): the gate scores the prefill's attention inputs, as the benchmark's replay
    does, as the prefill's cut compares them (GateScorer.cut_scores: a calibrated gate's offsets)."""
    full, _, tscores = quality.capture_prefill(model, sample.ids, chunk_size, teacher,
                                               sample.n_protected)
    gscores = scorer.cut_scores(quality.captured_scores(model, scorer, full).float()).cpu()
    p = sample.n_protected
    return full, dict(T=tscores[..., p:].float(), G=gscores[..., p:])


def swap_cache(full, n_protected, scores, keep, combo):
    """An evicting cache holding full's KV, in compressed layer li only the context pairs that
    scorer combo[li] ("T" or "G") keeps: keep[s] (L, H, n_context) from teacher.kept_by_rule. The
    system prompt and the layers that are not compressed stay whole, as in every evicting cache."""
    cache = EvictingCache(full.cfg, None, full.dtype, full.device, n_protected=n_protected)
    chosen = torch.stack([scores[s][li] for li, s in enumerate(combo)])
    cache.take_over_prefill(full, scores=chosen, keep_full=True)
    system = torch.ones(n_protected, dtype=torch.bool)
    for li, s in enumerate(combo):  # rows = system ⊕ context, head after head
        cache.keep_in_layer(li, torch.cat([torch.cat([system, k]) for k in keep[s][li]]))
    return cache


def swap_context(model, tok, sample, full, scores, budgets, chunk_size, window, stops, combos=None):
    """Every (combination, budget) on one context, or those in `combos` ("TTT", ...) -> {"full@1" |
    "TGT@0.5" ...: quality.entry}."""
    ref = quality.evaluate(model, tok, full, sample, stops)
    p, n = sample.n_protected, len(sample.ids)
    out = {"full@1": quality.entry(sample, ref, ref, [1.0] * len(scores["T"]), full.nbytes)}
    for r in budgets:
        keep = {s: kept_by_rule(x, r, chunk_size, window)[0] for s, x in scores.items()}
        for combo in combos or ["".join(c)
                                for c in itertools.product("TG", repeat=len(scores["T"]))]:
            cache = swap_cache(full, p, scores, keep, combo)
            res = quality.evaluate(model, tok, cache, sample, stops)
            out[f"{combo}@{r:g}"] = quality.entry(sample, res, ref,
                                                  cache.kept_fraction_per_layer(p, n), cache.nbytes)
    return out


def pool(records):
    """Per-context entries -> rows pooled over contexts: task sums, mean kept fractions and KV
    bytes."""
    rows = {}
    for key in records[0]["entries"]:
        es = [rec["entries"][key] for rec in records]
        tally = {t: [sum(e["tally"][t][i] for e in es) for i in (0, 1)] for t in TASKS}
        kept = [sum(e["kept"][l] for e in es) / len(es) for l in range(len(es[0]["kept"]))]
        held = sum(e["nbytes"] / rec["entries"]["full@1"]["nbytes"]
                   for e, rec in zip(es, records)) / len(es)
        rows[key] = dict(tally=tally, kept=kept, kv_fraction=held)
    return rows


def table(rows, layers):
    """Markdown: counts correct for the accuracies, ppl_full / ppl for the NLLs (1 = lossless)."""
    full = rows["full@1"]["tally"]
    nll = lambda t, x: math.exp(full[t][0] / full[t][1] - x[t][0] / x[t][1])
    lines = [f"| layers {'/'.join(map(str, layers))} | budget | pass keys | JSON KV | answers as "
             f"full | nll_next rel | nll_repeat rel | kept per layer | compressed pairs kept | "
             f"KV bytes |", "|---" * 10 + "|"]
    for key, row in rows.items():
        combo, budget = key.rsplit("@", 1)
        t = row["tally"]
        lines.append(f"| {combo} | {budget} | {t['passkey'][0]:g}/{t['passkey'][1]:g} | "
                     f"{t['kv'][0]:g}/{t['kv'][1]:g} | {t['agreement'][0]:g}/{t['agreement'][1]:g} "
                     f"| {nll('nll_next', t):.3f} | {nll('nll_repeat', t):.3f} | "
                     f"{'/'.join(f'{x:.2f}' for x in row['kept'])} | "
                     f"{sum(row['kept']) / len(row['kept']):.1%} | {row['kv_fraction']:.1%} |")
    return "\n".join(lines)


def run(args):
    torch.set_num_threads(args.threads)
    flags = ["--model", args.model, "--lengths", str(args.length), "--contexts", str(args.contexts),
             "--seed", str(args.seed), "--chunk-size", str(args.chunk_size), "--window",
             str(args.window)]
    folder = resolve_model(args.model)
    cfg, tok = check_folder(folder)
    fmt = prompt_format(cfg, args.model)
    gates = resolve_gate(args.gate, cfg, args.model)
    # the benchmark's contexts and questions (its default needles) for these flags
    exp = quality.Experiment(methods=["full"], budgets=args.budgets, extra_levels=[],
                             lengths=[args.length], contexts=args.contexts, **quality.NEEDLES,
                             chunk_size=args.chunk_size, window=args.window, seed=args.seed)
    _, samples = quality.make_samples(tok, fmt, exp)
    L = len(cfg.compressed_layers)
    if args.combos and any(len(c) != L or set(c) - set("TG") for c in args.combos):
        raise UsageError(f"--combos: each is {L} letters T (teacher) or G (gate), one per "
                         f"compressed layer {cfg.compressed_layers}, e.g. {'T' * L},{'G' * L}")
    if max(len(s.ids) for s in samples) > args.chunk_size:
        raise UsageError(f"--length {args.length} with its system prompt exceeds --chunk-size "
                         f"{args.chunk_size}: the swap needs one-chunk prefills (every scorer then "
                         "sees the same hidden states)")
    out = Path(args.out)
    (out / "contexts").mkdir(parents=True, exist_ok=True)
    source = gates.meta.get("source")  # what makes two runs' contexts the same experiment
    key = dict(flags=flags, budgets=args.budgets, gate=file_sha256(source) if source else None,
               combos=args.combos)
    model = load_checked(folder, "cpu", torch.float32)
    teacher, scorer = KVzipTeacher(model, tok, fmt), GateScorer(gates)
    stops = quality.answer_stops(cfg, tok)
    records = []
    for c, sample in enumerate(samples):
        path = out / "contexts" / f"context-{c}.json"
        rec = json.loads(path.read_text()) if path.is_file() else None
        if rec and rec["key"] == key:
            records.append(rec)
            print(f"context {c + 1}/{len(samples)}: done in an earlier run", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        with torch.no_grad():
            full, scores = capture(model, sample, teacher, scorer, args.chunk_size)
            print(f"context {c + 1}/{len(samples)}: prefilled, scored by teacher and gate in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
            entries = swap_context(model, tok, sample, full, scores, args.budgets, args.chunk_size,
                                   args.window, stops, args.combos)
        is_digit, is_identifier = token_marks(tok, sample.ids[sample.n_protected:])
        counts = agreement(scores["G"], scores["T"], is_digit, chunk_size=args.chunk_size,
                           window=args.window, is_identifier=is_identifier)  # as bench.py
        rec = dict(key=key, context=c, doc=sample.doc, n_tokens=len(sample.ids), entries=entries,
                   agreement=counts)
        cli.write_text(path, json.dumps(rec))
        records.append(rec)
        print(f"context {c + 1}/{len(samples)} ({sample.doc}): {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    rows = pool(records)
    md = table(rows, cfg.compressed_layers)
    pooled = pool_agreement([r["agreement"] for r in records])
    md += ("\n\nGate vs teacher on these contexts, layers "
           + "/".join(map(str, cfg.compressed_layers)) + ": Spearman "
           + " / ".join(f"{x:.2f}" for x in pooled["spearman"]) + "; overlap@0.5 " + " / ".join(
               "–" if x is None else f"{x:.0%}" for x in pooled["overlap@0.5"]))
    cli.write_text(out / "layer_swap.json", json.dumps(dict(key=key, command=" ".join(sys.argv),
                                                            rows=rows, agreement=pooled,
                                                            contexts=[r["doc"] for r in records]),
                                                       indent=1))
    cli.write_text(out / "layer_swap.md", md + "\n")
    print(md)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model(p)
    p.add_argument("--gate", help="gate file (default: the bundled gate for the model)")
    p.add_argument("--length", type=int, default=4096, help="context length in tokens")
    p.add_argument("--contexts", type=int, default=3,
                   help="contexts (each from another Austen part)")
    p.add_argument("--budgets", type=cli.floats, default=[0.5],
                   help="fractions of the context kept, e.g. 0.5,0.4")
    cli.add_seed(p, "the benchmark's contexts and needles")
    p.add_argument("--chunk-size", type=int, default=16384,
                   help="prefill chunk: a context must fit in one")
    p.add_argument("--window", type=int, default=4096,
                   help="recent tokens always kept (contexts shorter than a chunk: 2%%)")
    p.add_argument("--combos", type=lambda s: cli.names(s.upper()),
                   help="only these combinations, e.g. TTT,GGG (default: all 2^L)")
    cli.add_threads(p)
    p.add_argument("--out", required=True,
                   help="folder for contexts/, layer_swap.json and layer_swap.md")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli.main(run, parse_args(), ModelError, GateError)
