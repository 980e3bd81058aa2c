"""
Which limit a method meets on RULER's needle tasks at high compression: its scorer, its allocation
across layers, or the model. For each NIAH sample that the full cache answers, each method and each
budget, three caches of the same size are made from one captured prefill and asked the question:

    scored   the method as bench.py runs it (its own eviction level)
    oracle   the same scores, but every token of the sentences holding the answer (the needles)
             scores +inf in every compressed layer and head: kept whatever the scorer says; the
             rest of the budget goes by the method's scores (a scorer that never loses a needle)
    layer    the method's scores with the kept share fixed per layer (`--level layer`): the same
             number of pairs in every compressed layer instead of one threshold over all

If `oracle` answers where `scored` fails, the scorer lost the needle; if `layer` answers, the
allocation across layers starved the layer that retrieves; if neither does, what the model needs
besides the needle is gone at that budget (the model's limit). StreamingLLM at the same budgets is
run beside them for reference. Also recorded: the share of the needles' (layer, head, token) pairs
each `scored` cache kept.

    python -m harness.needle_oracle --model gemma3-270m-gguf --samples 4 \\
        --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 \\
        --out ~/.cache/fastkvzip-runs/needle-oracle-gemma
"""
import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

from cli import UsageError, add_model, add_seed, floats, names, resolve_model
from formats.checkpoint import check_folder, load_checked
from gate import METHODS, Scorer
from harness import quality as Q
from harness import ruler, ruler_tasks
from harness.kvpress_prompt import kvpress_format
from model import chat_template
from prompts import encode_text
from teacher import KVzipTeacher

VARIANTS = ("scored", "oracle", "layer")


class ForceKeep(Scorer):
    """Another scorer's scores, with the positions `keep` at +inf in every layer and head."""

    def __init__(self, inner, keep):
        super().__init__(inner.n_kv_heads)
        self.inner, self.keep = inner, torch.tensor(sorted(keep))
        self.level = inner.level

    def score(self, l, hidden, q, k, pos):
        s = self.inner.score(l, hidden, q, k, pos).clone()  # (H, T)
        s[:, torch.isin(pos.cpu(), self.keep).to(s.device)] = math.inf
        return s


def needle_spans(row):
    """Character spans, in the row's context, of the needle sentences that hold its answer."""
    spans = []
    for value in row["answer"]:
        # a key is one word (an adjective-noun pair, or a UUID): a match never spans two needles
        pattern = r"One of the special magic \S+ for \S+ is: " + re.escape(value) + r"\."
        spans += [m.span() for m in re.finditer(pattern, row["context"])]
    assert spans, f"no needle holds the answer of this {row['task']} sample"
    return spans


def needle_positions(tok, sample_ids, context, spans):
    """Positions in sample_ids of the tokens that overlap a span of `context` (the context's own
    tokens must appear in sample_ids as one run, as a prompt without a chat template holds them).
    A text's tokens up to a character are those its prefix encodes to, as far as both agree: the
    first token where they differ straddles that character."""
    ids = encode_text(tok, context)
    n = len(ids)
    start = next((o for o in range(len(sample_ids) - n + 1) if sample_ids[o:o + n] == ids), None)
    if start is None:
        raise UsageError("the context's tokens are not one run of the prompt's (a chat template "
                         "merged them with its own text): run this on a model without one")

    def agree(prefix):  # -> (tokens shared with the whole context, whether all of the prefix's)
        p = encode_text(tok, prefix)
        k = next((i for i, (x, y) in enumerate(zip(p, ids)) if x != y), min(len(p), n))
        return k, k == len(p)

    out = set()
    for s, e in spans:
        first, _ = agree(context[:s])
        last, whole = agree(context[:e])
        out.update(range(first, last + (not whole)))
    return sorted(start + i for i in out)


def needle_kept(cache, positions):
    """The share of the needles' (compressed layer, head, token) pairs the cache holds."""
    want = torch.tensor(positions)
    held = [torch.isin(want, kv.head_pos(h).cpu()).float().mean()
            for kv in (cache.layers[i] for i in cache.compressed) for h in range(kv.n_heads)]
    return float(torch.stack(held).mean())


def run_context(model, tok, fmt, row, teacher, args):
    sample = ruler.to_samples(tok, fmt, [row])[0]
    positions = needle_positions(tok, sample.ids, row["context"], needle_spans(row))
    stop_ids = set(model.config.eos_token_ids)
    with torch.no_grad():
        full, logits, tscores = Q.capture_prefill(model, sample.ids, args.chunk_size, teacher,
                                                  sample.n_protected)
        ref = ruler.answer_alone(model, tok, full, sample, stop_ids)
        rec = dict(task=row["task"], n_tokens=len(sample.ids), needle_tokens=len(positions),
                   full=ref["scores"][0], answer_full=tok.decode(ref["outputs"][0]), entries={})
        if ref["scores"][0] < 1.0:
            return rec  # the full cache fails: nothing to learn about compression here
        caches = {}
        for method in args.methods:
            variants = VARIANTS if method != "streaming" else ("scored",)
            for budget in args.budgets:
                for variant in variants:
                    level = "layer" if variant == "layer" else METHODS[method].level
                    cache = Q.method_cache(model, method, level, sample.n_protected, args.model,
                                           args.gate, 0, tscores)
                    if variant == "oracle":
                        cache.scorer = ForceKeep(cache.scorer, positions)
                    Q.prefill_from_capture(model, full, logits, cache, method, sample, budget,
                                           args.chunk_size, args.window)
                    name = f"{method}/{variant}@{budget}"
                    caches[name] = cache
                    rec["entries"][name] = dict(
                        needle_kept=needle_kept(cache, positions),
                        kept=cache.kept_fraction_per_layer(sample.n_protected, len(sample.ids)))
        # every cache answers in one batched decode, as bench.py's RULER runs answer
        for name, res in ruler.answer(model, tok, caches, sample, stop_ids).items():
            rec["entries"][name].update(score=res["scores"][0],
                                        answer=tok.decode(res["outputs"][0]))
    return rec


def summary(records, methods, budgets):
    """Markdown: per method, budget and variant, the contexts answered among those the full cache
    answers, and the needles' kept share."""
    ok = [r for r in records if r["full"] == 1.0]
    lines = [f"{len(ok)} of {len(records)} contexts answered by the full cache "
             f"({', '.join(sorted({r['task'] for r in ok}))}).", "",
             "| method | compression ratio | scored | oracle (needles kept) | layer | "
             "needle pairs kept (scored) |", "|---|---|---|---|---|---|"]
    for method in methods:
        for b in budgets:
            cell = {}
            for v in VARIANTS:
                es = [r["entries"].get(f"{method}/{v}@{b}") for r in ok]
                es = [e for e in es if e]
                cell[v] = (f"{sum(e['score'] for e in es):g}/{len(es)}" if es else "—",
                           sum(e["needle_kept"] for e in es) / len(es) if es else None)
            kept = cell["scored"][1]
            lines.append(f"| {method} | {1 - b:g} | {cell['scored'][0]} | {cell['oracle'][0]} | "
                         f"{cell['layer'][0]} | {'' if kept is None else f'{kept:.0%}'} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p)
    p.add_argument("--gate", default=None, help="gate file (default: the model's bundled gate)")
    p.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1",
                   help="comma list of RULER NIAH tasks")
    p.add_argument("--samples", type=int, default=4, help="samples per task (RULER's, seeded)")
    p.add_argument("--length", type=int, default=4096, help="RULER's target length")
    p.add_argument("--methods", default="fastkvzip,kvzip,streaming", help="comma list")
    p.add_argument("--ratios", default="0.7,0.75,0.875",
                   help="compression ratios (1 - budget), comma list")
    p.add_argument("--chunk-size", type=int, default=16384, help="prefill chunk (tokens)")
    p.add_argument("--window", type=int, default=4096, help="local window cap (METHOD.md §6)")
    add_seed(p, "the RULER samples", default=42)
    p.add_argument("--out", required=True, help="folder: records.jsonl (resumable), summary.md")
    args = p.parse_args(argv)
    args.tasks = names(args.tasks)
    bad = [t for t in args.tasks if t not in ruler_tasks.NIAH]
    if bad:
        p.error(f"--tasks {','.join(bad)}: only NIAH tasks have needles "
                f"({', '.join(ruler_tasks.NIAH)})")
    args.methods = names(args.methods)
    args.budgets = list(dict.fromkeys(round(1 - r, 6) for r in floats(args.ratios)))
    folder = resolve_model(args.model)
    cfg, tok = check_folder(folder)
    fmt = kvpress_format(cfg, args.model, None, chat_template(folder))  # as bench.py's RULER
    model = load_checked(folder, "cpu", torch.float32)
    teacher = KVzipTeacher(model, tok, fmt) if "kvzip" in args.methods else None
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    done = {(r["task"], r["index"]): r for r in map(json.loads, path.open())} if path.exists() \
        else {}
    for i in range(args.samples):
        for task in args.tasks:
            if (task, i) in done:
                continue
            t0 = time.perf_counter()
            row = ruler.sample_at(tok, [args.length], args.samples, args.seed, [task], i)
            rec = dict(run_context(model, tok, fmt, row, teacher, args), index=i)
            with path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            done[(task, i)] = rec
            print(f"{task} sample {i}: full {rec['full']:g}, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    text = "\n".join(summary(list(done.values()), args.methods, args.budgets)) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
