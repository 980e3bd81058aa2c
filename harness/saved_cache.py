"""
Compress once, answer later: what a saved cache costs on disk and how soon it answers.

For each offline model, context length and budget: prefill the context as generate.py does (its
chunk and window), save the cache (formats.cache_file.save_cache), then answer one question twice,
greedily: from the cache just compressed (time to the first answer token = prefill + question +
first token) and from the file (load_cache + question + first token). The answers must be equal;
the file's size is set beside the bytes a full cache holds after the same prefill
(commands.generate.full_cache_bytes).

    python -m harness.saved_cache                                   # both offline models, 2K and 8K
    python -m harness.saved_cache --models smollm2-135m-gguf --lengths 2048 --out /tmp/saved

(run from the repository root.) Writes OUT/results.json and OUT/results.md.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import cli
import generate
import model as M
from cache import Budget
from commands.generate import build_inputs, full_cache_bytes
from formats.cache_file import load_cache, save_cache
from formats.gate_file import resolve_gate
from harness.quality import load_docs
from prompts import prompt_format

QUESTION = "Who is the first person named in the text?"


def first_token(model, cache, q_ids, last_logits):
    """The question's forward and the first answer token (how generate.answer starts)."""
    return generate.sample(generate.begin_answer(model, cache, q_ids, last_logits))


@torch.no_grad()
def measure(model, tok, fmt, name, context, budget, args, folder):
    """One (model, context, budget): prefill, save, answer from both; -> a result row."""
    ids, n_protected, [(_, q_ids)] = build_inputs(tok, fmt, context, [QUESTION])
    method = "full" if budget == 1.0 else "fastkvzip"
    gates = resolve_gate(None, model.config, name) if method == "fastkvzip" else None
    cache = generate.make_cache(method, model, n_protected, gates)  # the gate loads before the clock
    t0 = time.perf_counter()
    plan = Budget(budget, args.chunk_size, args.window)
    last = generate.prefill(model, cache, ids, n_protected, plan)
    prefill_s = time.perf_counter() - t0
    full_bytes, kv_bytes = full_cache_bytes(cache, len(ids)), cache.nbytes
    path = folder / f"{name}-{len(ids)}-{budget:g}.kv"
    t0 = time.perf_counter()
    save_cache(path, cache, model, ids, last, n_protected=n_protected, method=method,
               budget=budget, chunk_size=args.chunk_size, window=args.window,
               prefill_seconds=prefill_s)
    save_s = time.perf_counter() - t0
    state = cache.checkpoint()
    t0 = time.perf_counter()
    token = first_token(model, cache, q_ids, last)
    question_s = time.perf_counter() - t0
    want = [token] + generate.answer(model, cache, [], args.new_tokens - 1, set(),
                                     last_logits=generate.decode_one(model, cache, token))
    cache.rollback(state)
    loads, firsts = [], []
    for _ in range(args.repeats):  # the file: load, question, first token
        t0 = time.perf_counter()
        loaded, info = load_cache(path, model, getattr(cache, "scorer", None))
        loads.append(time.perf_counter() - t0)
        token = first_token(model, loaded, q_ids, info["last_logits"])
        firsts.append(time.perf_counter() - t0)
    got = [token] + generate.answer(model, loaded, [], args.new_tokens - 1, set(),
                                    last_logits=generate.decode_one(model, loaded, token))
    row = dict(model=name, context_tokens=len(ids) - n_protected, prompt_tokens=len(ids),
               budget=budget, method=method, file_bytes=path.stat().st_size, kv_bytes=kv_bytes,
               kv_bytes_full=full_bytes,
               prefill_s=prefill_s, question_first_token_s=question_s, save_s=save_s,
               ttft_prefill_s=prefill_s + question_s, load_s=statistics.median(loads),
               ttft_loaded_s=statistics.median(firsts), loads_s=loads, ttfts_loaded_s=firsts,
               answer=tok.decode(want), answers_equal=want == got)
    path.unlink()
    return row


def markdown(rows, args, load):
    mib = lambda b: f"{b / 2**20:.1f}"
    out = ["# A saved cache: its size, and the time to the first answer token", "",
           f"`python -m harness.saved_cache --lengths {','.join(map(str, args.lengths))} --budgets "
           f"{','.join(f'{b:g}' for b in args.budgets)}`, fp32, {args.threads} thread(s), "
           f"chunk {args.chunk_size}, window {args.window} (generate.py's defaults: a context "
           "shorter than a chunk keeps its last 2%). Load average at the start: " + load + ".", "",
           "| model | context tokens | budget | file MiB | full cache MiB | file / full "
           "| prefill + 1st token s | load s | load + 1st token s | × faster | answers equal |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {cli.md(r['model'])} | {r['context_tokens']} | {r['budget']:g} | "
                   f"{mib(r['file_bytes'])} | "
                   f"{mib(r['kv_bytes_full'])} | {r['file_bytes'] / r['kv_bytes_full']:.2f} | "
                   f"{r['ttft_prefill_s']:.2f} | {r['load_s']:.2f} | {r['ttft_loaded_s']:.2f} | "
                   f"{r['ttft_prefill_s'] / r['ttft_loaded_s']:.1f}× | "
                   f"{'yes' if r['answers_equal'] else '**no**'} |")
    out += ["", "Load (the file read, its checksum verified, the cache rebuilt on the device) and "
            f"load + 1st token (+ the question's forward): medians of {args.repeats}, from the "
            "file just written (in the OS page cache: a cold disk adds its read time). Prefill: "
            "one run. Answers: "
            f"{args.new_tokens} greedy tokens from each cache."]
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=cli.names, default=list(cli.OFFLINE_MODELS))
    p.add_argument("--lengths", type=cli.ints, default=[2048, 8192], help="context tokens")
    p.add_argument("--budgets", type=cli.floats, default=[1.0, 0.3])
    p.add_argument("--chunk-size", type=int, default=16384, help="prefill chunk (generate.py's)")
    p.add_argument("--window", type=int, default=4096, help="local window (generate.py's default)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy answer tokens compared")
    p.add_argument("--repeats", type=int, default=3, help="loads of each file (median)")
    cli.add_threads(p)
    p.add_argument("--out", default="benchmarks/saved-cache-cpu", help="results.json/.md go here")
    args = p.parse_args()
    counts = min(args.lengths), args.new_tokens, args.repeats, args.chunk_size
    if min(counts) < 1 or not all(0 < b <= 1 for b in args.budgets):
        p.error("--lengths, --new-tokens, --repeats, --chunk-size >= 1; "
                "budgets in (0, 1]")
    torch.set_num_threads(args.threads)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            folder = cli.resolve_model(name)
            model, tok = M.load_model(folder, "cpu", torch.float32), M.load_tokenizer(folder)
            fmt = prompt_format(model.config, name)
            with torch.no_grad():  # first calls pay one-time setup: not part of either path's time
                warm = generate.make_cache("full", model, 0)
                generate.answer(model, warm, [1, 2, 3], 2, set())
            text = [t for _, d in load_docs(tok) for t in d]
            for n in args.lengths:
                context = tok.decode(text[:n])
                for budget in args.budgets:
                    rows.append(measure(model, tok, fmt, name, context, budget, args, Path(tmp)))
                    r = rows[-1]
                    print(f"{name} {r['context_tokens']} tokens at {budget:g}: file "
                          f"{r['file_bytes'] / 2**20:.1f} MiB of {r['kv_bytes_full'] / 2**20:.1f}, "
                          f"first token {r['ttft_prefill_s']:.2f} s by prefill, "
                          f"{r['ttft_loaded_s']:.2f} s from the file, answers equal: "
                          f"{r['answers_equal']}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cli.write_json(out / "results.json", dict(args=vars(args), load_average=load, rows=rows))
    cli.write_text(out / "results.md", markdown(rows, args, load))


if __name__ == "__main__":
    main()
