"""
Measure every method side by side: how much quality it loses, how much time and memory it saves.

Quality (quality.py): contexts cut from Jane Austen's novels with needles at many depths, compressed
before any question is seen, then asked pass keys, key-value pairs, and scored by teacher-forced NLL,
each method relative to the full cache. Speed and memory (below): the real path, generate.prefill /
prefill_kvzip then decode, on fresh caches, beside transformers on the same checkpoint (the peer column,
when transformers is installed); on a GPU also random weights in Qwen3-8B's shape.

CPU examples (1 thread; times on 2 CPU cores when no other job runs, ~1.3x longer beside one):
    python bench.py --quick             # smoke run, ~2 min: 2 contexts, budgets 0.5/0.2, every method
    python bench.py --plot              # full run, ~3.5 h: 18 contexts of 2K/4K/8K x 7 budgets x 7 configs
                                        #   (~3.2 h) + speed at 2K/8K/16K (~20 min)
Each finished context is saved in --out at once: rerunning the same command resumes. The README's headline
run (12 contexts) split over both cores, 69 min side by side, then 20 min of speed:
    python bench.py --contexts 4 --speed-lengths 0 --shard 0/2 --out results/full-s0 &
    python bench.py --contexts 4 --speed-lengths 0 --shard 1/2 --out results/full-s1; wait
    python bench.py --contexts 4 --no-quality --out results/full-speed
    python bench.py --merge results/full-s0,results/full-s1,results/full-speed --out results/full --plot
Held-out corpus prose instead of Austen (--text prose), SmolLM2 reading it as plain text (in its chat
template its full cache answers 5 of 18 of these pass keys, as plain text 14; 42 min on one core):
    python bench.py --model smollm2-135m-gguf --text prose --no-chat --methods fastkvzip,kvzip,streaming \
        --budgets 1.0,0.5,0.3,0.2 --lengths 2048 --contexts 12 --speed-lengths 0
GPU (random weights in Qwen3-8B's shape, speed and memory only, contexts up to 128K):
    python bench.py --no-quality --speed-lengths 0 --gpu-lengths 8192,32768,131072
Outputs in --out (default results/<timestamp>/): config.json, results.json, results.md, relative.png.
"""
import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import cli
import gate
import generate
import quality
from cache import LEVELS, Batch, KVCache
from cli import UsageError, file_sha256, write_text
from model import (ModelConfig, ModelError, OFFLINE_DEFAULT, Transformer, load_model, load_tokenizer,
                   prompt_format, resolve_model)
from quality import (DEFAULT_LEVEL, label, load_docs, load_records, log, method_cache, model_info,
                     quality_key, quality_results)
from teacher import KVzipTeacher

ROOT = Path(__file__).resolve().parent
METHODS = ("full", "fastkvzip", "kvzip", "snapkv", "streaming", "random")
BUDGETS = (1.0, 0.75, 0.5, 0.4, 0.3, 0.2, 0.1)


# ---- 1. Speed and memory through the real path (generate.prefill and answer on fresh caches) --------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def timed_run(model, method, budget, ids, n_protected, teacher, args):
    """Prefill ids with one method as generate.py does, then decode; -> one speed row."""
    cfg, dtype, device = model_info(model)
    # the cache is made (and the gate loaded) before the clock starts
    cache = KVCache(cfg, dtype, device) if method == "full" else method_cache(
        model, method, DEFAULT_LEVEL[method], n_protected, args.model, args.gate, args.seed)
    teacher = TimedTeacher(teacher) if method == "kvzip" else None
    sync(device)
    t0 = time.perf_counter()
    if method == "kvzip":  # full prefill, the teacher's repeat pass, one eviction (METHOD.md §6)
        generate.prefill_kvzip(model, teacher, cache, ids, n_protected, budget, args.speed_chunk, args.speed_window)
        score_s = teacher.seconds
    else:
        generate.prefill(model, cache, ids, n_protected, budget, args.speed_chunk, args.speed_window)
        score_s = getattr(cache, "gate_seconds", 0.0)
    sync(device)
    prefill_s = time.perf_counter() - t0
    kv_bytes, peak = cache.nbytes, cache.peak_nbytes
    out, decode_s = generate.answer(model, cache, [ids[-1]] * 4, args.speed_decode, stop_ids=set())
    return dict(context=len(ids) - n_protected, method=method, budget=budget, prefill_s=prefill_s,
                prefill_tok_s=len(ids) / prefill_s, score_s=score_s, score_fraction=score_s / prefill_s,
                kv_bytes=kv_bytes, kv_bytes_full=generate.full_cache_bytes(cache, len(ids)), peak_kv_bytes=peak,
                decode_tok_s=(len(out) - 1) / decode_s if decode_s > 0 else None, device=device.type)


class TimedTeacher:
    """The KVzip teacher, with the seconds its repeat pass takes (the part the gate replaces)."""

    def __init__(self, teacher):
        self.teacher, self.seconds = teacher, 0.0

    def __getattr__(self, name):
        return getattr(self.teacher, name)

    def score(self, *a, **kw):
        t0 = time.perf_counter()
        out = self.teacher.score(*a, **kw)
        sync(out.device)
        self.seconds += time.perf_counter() - t0
        return out


def speed(model, teacher, lengths, ids_for, args, tag="cpu", peer=None):
    """Speed and memory rows, one per (length, method, budget), and the peer's rows (transformers on the same
    checkpoint, peer_run) when a peer is given. Full, fastkvzip at --speed-budget and the peer are run
    --speed-repeats times in turn (full, peer, fastkvzip, full, ...), so that load on the machine hits them
    alike, and their rows hold the medians; those two of ours get vs_peer: prefill and decode speed as
    multiples of the peer's (> 1: ours is faster)."""
    rows, peer_rows = [], []
    for n in lengths:
        ids, n_protected = ids_for(n)
        compared = [("full", 1.0)] + [("transformers", 1.0)] * bool(peer) + [("fastkvzip", args.speed_budget)]
        runs = compared * args.speed_repeats + [("kvzip", args.speed_budget)] * bool(teacher)
        if n == lengths[0]:  # decode speed at every budget, on the shortest context (one prefill each)
            runs += [("fastkvzip", b) for b in args.budgets if b not in (1.0, args.speed_budget)]
        done = {}
        for method, budget in runs:
            row = (peer_run(peer, ids, n_protected, args) if method == "transformers" else
                   timed_run(model, method, budget, ids, n_protected, teacher, args))
            done.setdefault((method, budget), []).append(row)
            log(f"speed[{tag}] {n} tokens {method} at {budget:g}: prefill {row['prefill_s']:.1f} s, "
                f"KV {row['kv_bytes'] / 2**20:.1f} MiB (peak {(row['peak_kv_bytes'] or 0) / 2**20:.1f}), "
                f"decode {row['decode_tok_s'] or 0:.1f} tok/s")
        for (method, budget), reps in done.items():
            (peer_rows if method == "transformers" else rows).append(median_row(reps))
    for r in rows:  # ratios against the full cache at the same length
        f = next(x for x in rows if x["context"] == r["context"] and x["method"] == "full")
        # KV held: against an exactly packed full cache (the full run itself may hold decode slack: <= 1,024
        # rows per head after a one-token last chunk); peak: against the full run's real peak
        r.update(prefill_vs_full=r["prefill_s"] / f["prefill_s"], kv_vs_full=r["kv_bytes"] / r["kv_bytes_full"],
                 peak_vs_full=r["peak_kv_bytes"] / f["peak_kv_bytes"])
        p = next((x for x in peer_rows if x["context"] == r["context"]), None)
        if p and (r["method"], r["budget"]) in (("full", 1.0), ("fastkvzip", args.speed_budget)):  # run in turn
            decode = r["decode_tok_s"] / p["decode_tok_s"] if r["decode_tok_s"] and p["decode_tok_s"] else None
            r["vs_peer"] = dict(prefill=p["prefill_s"] / r["prefill_s"], decode=decode)
    return rows, peer_rows


def median_row(reps):
    """One row for repeated runs: the median prefill time and decode speed, each run's kept in *_runs."""
    row = dict(reps[-1], repeats=len(reps))
    for k in ("prefill_s", "prefill_tok_s", "decode_tok_s", "score_fraction"):
        vals = [r[k] for r in reps if r.get(k) is not None]
        if k in row:
            row[k] = float(np.median(vals)) if vals else None
    row.update(prefill_s_runs=[r["prefill_s"] for r in reps], decode_tok_s_runs=[r["decode_tok_s"] for r in reps])
    return row


def load_peer(folder):
    """The same checkpoint in transformers (SDPA attention, fp32), or None when transformers is not installed."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        log("speed: transformers is not installed: no peer column (pip install -r requirements-test.txt)")
        return None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.version = transformers.__version__
    return model.eval().requires_grad_(False)


def peer_prefill(peer, ids, chunk):
    """ids through transformers in chunks into its DynamicCache (logits of the last position only) ->
    (forward(token ids) -> last logits, the prefill's last logits, KV bytes held)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=peer.config)
    forward = lambda x: peer(torch.tensor([x]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    for i in range(0, len(ids), chunk):
        logits = forward(ids[i:i + chunk])
    return forward, logits, sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def peer_run(peer, ids, n_protected, args):
    """timed_run's work through transformers: the same prefill chunks (peer_prefill), the same 4-token
    question, the same greedy decode timed the same way."""
    t0 = time.perf_counter()
    forward, _, kv_bytes = peer_prefill(peer, ids, args.speed_chunk)
    prefill_s = time.perf_counter() - t0
    logits, out = forward([ids[-1]] * 4), []
    t0 = time.perf_counter()
    for _ in range(args.speed_decode):  # as generate.answer: sample, stop at the last token, else one forward
        out.append(generate.sample(logits))
        if len(out) == args.speed_decode:
            break
        logits = forward([out[-1]])
    decode_s = time.perf_counter() - t0
    return dict(context=len(ids) - n_protected, method="transformers", budget=1.0, prefill_s=prefill_s,
                prefill_tok_s=len(ids) / prefill_s, kv_bytes=kv_bytes, peak_kv_bytes=None,
                decode_tok_s=(len(out) - 1) / decode_s if decode_s > 0 else None, version=peer.version)


@torch.no_grad()
def batch_speed(model, peer, docs, n_protected, args):
    """Decode throughput of B requests at once (cache.Batch: one forward per step for all B, one attention
    call per layer), B in --batch-sizes, for the full cache and fastkvzip at --speed-budget; beside it
    transformers' own batched generate, left-padded to the longest context. docs: the contexts (system
    prompt ⊕ text ids, mixed lengths); every member is prefilled once, alone, and copied for each B. Decode
    is timed alone, after the 4-token question: --speed-decode greedy steps; tokens/s counts all B."""
    cfg, dtype, device = model_info(model)
    question, rows = [docs[0][-1]] * 4, []
    for method, budget in (("full", 1.0), ("fastkvzip", args.speed_budget)):
        prefilled = []
        for ids in docs[:max(args.batch_sizes)]:
            cache = KVCache(cfg, dtype, device) if method == "full" else method_cache(
                model, method, DEFAULT_LEVEL[method], n_protected, args.model, args.gate, args.seed)
            generate.prefill(model, cache, ids, n_protected, budget, args.speed_chunk, args.speed_window)
            prefilled.append(cache)
        for B in args.batch_sizes:
            batch, tokens = Batch(cfg, dtype, device), []
            for cache in (copy.deepcopy(c) for c in prefilled[:B]):
                tokens.append(int(generate.begin_answer(model, cache, question).argmax()))
                batch.join(cache)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.speed_decode):
                tokens = generate.decode_batch(model, batch, tokens).argmax(-1).tolist()
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
            rows.append(dict(method=method, budget=budget, batch=B, decode_tok_s=B * args.speed_decode / secs,
                             decode_cpu_tok_s=B * args.speed_decode / cpu, kv_bytes=batch.nbytes,
                             peak_kv_bytes=batch.peak_nbytes))
            log(f"batch speed {method} at {budget:g}, B={B}: {rows[-1]['decode_tok_s']:.1f} tok/s, "
                f"KV {batch.nbytes / 2**20:.1f} MiB")
    for B in args.batch_sizes if peer is not None else []:
        rows.append(peer_batch_run(peer, docs[:B], question, args.speed_decode))
        log(f"batch speed transformers, B={B}: {rows[-1]['decode_tok_s']:.1f} tok/s")
    return rows


def peer_batch_run(peer, docs, question, steps):
    """transformers' generate on B contexts at once (left padding, attention mask, greedy, exactly `steps` + 1
    new tokens); decode time from its first new token to its last, read by a streamer."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):  # put() gets the prompt, then each step's new tokens
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append((time.perf_counter(), time.process_time()))

        def end(self):
            self.put(None)

    seqs = [ids + question for ids in docs]
    L = max(map(len, seqs))
    input_ids = torch.tensor([[0] * (L - len(x)) + x for x in seqs])
    mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in seqs])
    clock = Clock()
    out = peer.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                        do_sample=False, streamer=clock, pad_token_id=0, return_dict_in_generate=True)
    kv = sum(t.nbytes for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    (t1, c1), (t2, c2) = clock.times[1], clock.times[-1]  # after the prefill's token: `steps` decode forwards
    return dict(method="transformers", budget=1.0, batch=len(docs), decode_tok_s=len(docs) * steps / (t2 - t1),
                decode_cpu_tok_s=len(docs) * steps / (c2 - c1), kv_bytes=kv, peak_kv_bytes=None, padded_to=L,
                version=peer.version)


def batch_markdown(rows, args):
    if not rows:
        return []
    one = {(r["method"], r["budget"]): r["decode_tok_s"] for r in rows if r["batch"] == 1}
    peer = {r["batch"]: r["decode_tok_s"] for r in rows if r["method"] == "transformers"}
    out = ["", "## Batched decoding (generate.py --batch)", "",
           f"B requests decode together, one forward per step (cache.Batch); contexts of {args.batch_length} tokens "
           f"and shorter (75-100%), each prefilled alone; {args.speed_decode} greedy steps after a 4-token question, "
           "tokens/s over all B. transformers: its own generate on the same contexts, left-padded, timed from its "
           "first new token. KV: bytes the batch holds at the end (transformers: its padded DynamicCache). "
           "CPU tok/s: over this process's CPU seconds (what other jobs on a shared machine disturb least).", "",
           "| method | budget | B | decode tok/s | × B=1 | × transformers | CPU tok/s | KV held |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x1 = r["decode_tok_s"] / one[(r["method"], r["budget"])] if (r["method"], r["budget"]) in one else None
        xp = r["decode_tok_s"] / peer[r["batch"]] if r["batch"] in peer and r["method"] != "transformers" else None
        f = lambda x: f"{x:.2f}×" if x is not None else "–"
        out.append(f"| {r['method']} | {r['budget']:g} | {r['batch']} | {r['decode_tok_s']:.1f} | {f(x1)} | {f(xp)} | "
                   f"{r['decode_cpu_tok_s']:.1f} | {r['kv_bytes'] / 2**20:.1f} MiB |")
    return out


# Qwen3-8B's published shape (HF config), with the YaRN scaling the authors use for long contexts (METHOD.md §9)
QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=131072, rope_theta=1e6,
                rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
                tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)


def random_model(shape, device, dtype, seed=0):
    """A model of the given config dict with random weights (speed and memory only: no real 8B weights
    exist offline). Norm weights 1, matrices N(0, 1/fan_in): activations stay finite through the layers."""
    cfg = ModelConfig.from_dict(shape)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():  # parameters only: the RoPE buffers stay fp32
            p.data = torch.ones_like(p, dtype=dtype) if p.dim() == 1 else \
                torch.randn(p.shape, generator=g, device=device, dtype=dtype) * p.shape[-1] ** -0.5
    return model.eval().requires_grad_(False)


def gpu_section(args, shape=QWEN3_8B, device="cuda", chunk=16000, window=4096):
    """Speed and memory of full / fastkvzip / kvzip on a random-weight model of `shape`, with the paper's own
    prefill chunk and window (METHOD.md §6)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype, args.seed)
    cfg = model_info(model)[0]
    gates = gate.Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads, cfg.group_size,
                    dtype=dtype, device=device)
    gargs = copy.copy(args)
    gargs.gate = str(Path(args.out_dir) / "random-gate.safetensors")  # a random gate: timing only
    gate.save_gate(gargs.gate, gates, {"note": "random weights, for timing only"})
    teacher = None
    try:
        from tools import fetch_assets
        tok = load_tokenizer(fetch_assets.tokenizer_file("qwen3").parent)
        teacher = KVzipTeacher(model, tok, prompt_format(cfg, "qwen3-8b"))
    except Exception as e:  # no tokenizer asset: KVzip's repeat prompt cannot be written
        log(f"gpu: no KVzip timing ({e})")
    gen = torch.Generator().manual_seed(args.seed)

    def ids_for(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist(), 0
    gargs.speed_chunk, gargs.speed_window = chunk, window
    return speed(model, teacher, args.gpu_lengths, ids_for, gargs, tag=device.type)[0]


# ---- 2. Output: config.json, results.json, results.md, relative.png — each written atomically -------

def run_config(args, folder, gates):
    import tokenizers
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    files = sorted(p for p in Path(folder).iterdir() if p.suffix in (".json", ".safetensors"))
    return dict(flags=vars(args), command=" ".join(sys.argv),
                started=time.strftime("%Y-%m-%dT%H:%M:%S"), git_commit=git("rev-parse", "HEAD"),
                git_dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
                versions=dict(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
                              tokenizers=tokenizers.__version__),
                machine=dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count(),
                             torch_threads=torch.get_num_threads(), cuda=torch.cuda.is_available()),
                model=dict(folder=str(folder), sha256={p.name: file_sha256(p) for p in files}),
                gate=dict(source=gates.meta.get("source"), meta=gates.meta,
                          sha256=file_sha256(gates.meta["source"]) if gates.meta.get("source") else None),
                levels=list(LEVELS))


def speed_keys(args, config):
    """What makes two runs' speed rows (and GPU rows) comparable: rows are kept from an earlier run in the same
    --out, or merged, only if equal. The lengths are not part of it: each row names its own."""
    common = dict(budgets=args.budgets, speed_budget=args.speed_budget, speed_decode=args.speed_decode)
    return dict(speed=dict(common, model=config["model"]["sha256"], gate=config["gate"]["sha256"],
                           kvzip="kvzip" in args.methods, speed_chunk=args.speed_chunk,
                           speed_window=args.speed_window, threads=args.threads),
                gpu=dict(common, seed=args.seed))  # random weights and gate, Qwen3-8B's shape


def differing(a, b):
    return ", ".join(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


TEXT_NAMES = {"austen": "Austen", "prose": "held-out prose"}  # --text, as results.md names it


def markdown(results):
    """results.md: what was run, the quality sections (quality.markdown), then speed and memory."""
    cfg = results["config"]
    f = cfg["flags"]
    out = [f"# Fast KVzip benchmark ({cfg['started']})", "",
           f"Model `{f['model']}`, gate `{cfg['gate']['source']}` (sha256 {str(cfg['gate']['sha256'])[:12]}), "
           f"commit {cfg['git_commit'][:10]}{' (dirty)' if cfg['git_dirty'] else ''}. "
           + (f"{results['n_contexts']} {TEXT_NAMES[f.get('text', 'austen')]} contexts of {f['lengths']} tokens, "
              + ("no chat template, " if f.get("chat") is False else "chat template, " if f.get("chat") else "")
              + f"{f['passkeys']} pass keys and "
              f"{f['kv_questions']} of {f['kv_pairs']} JSON pairs asked per context; chunk {f['chunk_size']}, "
              f"seed {f['seed']}. " if results.get("n_contexts") else "No quality section (speed and memory only). ")
           + f"Run time {results.get('seconds', 0) / 60:.1f} min"
           + (f" ({len(cfg['merged_from'])} runs side by side, merged)." if cfg.get("merged_from") else "."), ""]
    out += quality.markdown(results)
    mib = lambda x, ratio: f"{x / 2**20:.1f} MiB ({ratio:.0%})"
    for key, title in (("speed", "CPU"), ("gpu", "GPU, random weights in Qwen3-8B's shape")):
        if results.get(key):
            chunk, window = (f["speed_chunk"], f["speed_window"]) if key == "speed" else (16000, 4096)
            out += ["", f"## Speed and memory: {title}", "", f"Real path (generate.prefill / prefill_kvzip, then "
                    f"answer); prefill chunk {chunk}, window {window}. KV bytes count every layer (Gemma3's sliding "
                    "layers hold their window whatever the budget); KV after prefill in % of an exactly packed full "
                    "cache; peak = the most held during prefill (a layer's old and new buffers both count while it is "
                    "re-laid out), in % of the full run's peak. The paper's "
                    "anchors (Figure 1b, Table 5): gate ≈ 1% of prefill; compression ≈ 5× faster than KVzip at 170K "
                    "tokens; prefill peak ≈ 3× lower than full at a 30% budget.", "",
                    "| context | method | budget | prefill s | × full | gate/teacher share | KV after prefill | "
                    "peak KV in prefill | decode tok/s |", "|---|---|---|---|---|---|---|---|---|"]
            for r in results[key]:
                out.append(f"| {r['context']} | {r['method']} | {r['budget']:g} | {r['prefill_s']:.2f} | "
                           f"{r['prefill_vs_full']:.2f} | {r['score_fraction']:.1%} | "
                           f"{mib(r['kv_bytes'], r['kv_vs_full'])} | {mib(r['peak_kv_bytes'], r['peak_vs_full'])} | "
                           f"{r['decode_tok_s'] or 0:.1f} |")
            if key == "speed" and results.get("speed_peer"):
                out += peer_markdown(results)
    out += batch_markdown(results.get("batch_speed"), argparse.Namespace(**f))
    out += ["", results.get("gpu_note", "")]
    return "\n".join(out) + "\n"


def peer_markdown(results):
    """The peer table: transformers on the same checkpoint, run in turn with ours, and ours / transformers."""
    peer = results["speed_peer"]
    fmt = lambda x: f"{x:.2f}×" if x is not None else "–"
    out = ["", f"### Against transformers {peer[0].get('version', '')} (SDPA attention, DynamicCache, fp32)", "",
           f"The same checkpoint, chunks, question and greedy decode, run in turn with ours in the same process "
           f"({peer[0]['repeats']} runs each, medians). Speed ratio ours / transformers: > 1 means ours is faster "
           "(prefill: its time over ours; decode: our tokens/s over its).", "",
           "| context | transformers prefill s | transformers decode tok/s | transformers KV after prefill | "
           "method | budget | prefill × transformers | decode × transformers |", "|---|---|---|---|---|---|---|---|"]
    for p in peer:
        for r in (r for r in results["speed"] if r["context"] == p["context"] and r.get("vs_peer")):
            out.append(f"| {p['context']} | {p['prefill_s']:.2f} | {p['decode_tok_s'] or 0:.1f} | "
                       f"{p['kv_bytes'] / 2**20:.1f} MiB | {r['method']} | {r['budget']:g} | "
                       f"{fmt(r['vs_peer']['prefill'])} | {fmt(r['vs_peer']['decode'])} |")
    return out


# ---- 3. Command line --------------------------------------------------------------------------------

def floats(s):
    return [float(x) for x in s.split(",") if x]


def ints(s):
    """A comma list of token counts; '0' alone means none."""
    values = [int(x) for x in s.split(",") if x]
    if any(v < 0 for v in values) or (0 in values and values != [0]):
        raise argparse.ArgumentTypeError(f"{s!r}: token counts must be positive ('0' alone = none)")
    return [v for v in values if v > 0]


# --quick's settings; flags given explicitly win over them
QUICK = dict(lengths=[512], contexts=2, budgets=[0.5, 0.2], speed_lengths=[256], passkeys=1, kv_questions=1,
             probe_tokens=32, continue_tokens=0, speed_decode=4, speed_repeats=1, bootstrap=200, extra_levels=[], gpu_lengths=[8192])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run (< 3 min on 2 CPU cores): 2 contexts of 512 "
                   "tokens, 2 questions each, budgets 0.5 and 0.2, every method at its own level; speed at 256 tokens "
                   "(flags given explicitly win over these)")
    p.add_argument("--model", default=OFFLINE_DEFAULT, help="model folder, repo id or alias")
    p.add_argument("--gate", help="gate file (default: the bundled gate for the model)")
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS),
                   help="comma list of " + ",".join(METHODS))
    p.add_argument("--budgets", type=floats, default=list(BUDGETS), help="fractions of the context kept")
    p.add_argument("--extra-levels", type=lambda s: [x for x in s.split(",") if x], default=["calibrated"],
                   help="eviction levels run beside the paper's for fastkvzip and kvzip (cache.LEVELS; '' = none)")
    p.add_argument("--lengths", type=ints, default=[2048, 4096, 8192], help="context lengths in tokens (quality)")
    p.add_argument("--contexts", type=int, default=6, help="contexts per length (each from another document)")
    p.add_argument("--text", choices=quality.TEXTS, default="austen", help="the documents the quality contexts are "
                   "cut from: austen (the novels, by chapters) or prose (held-out documents of the gates' training "
                   "corpus: Wikipedia, State of the Union addresses, the Python library reference)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="contexts and questions in the model's chat template, as generate.py --chat (default: on, "
                   "except for the base offline model); --no-chat: plain text, as a base model reads it")
    p.add_argument("--passkeys", type=int, default=3, help="pass keys hidden per context, at stratified depths")
    p.add_argument("--kv-pairs", type=int, default=8, help="key-value pairs in each context's JSON block")
    p.add_argument("--kv-questions", type=int, default=3, help="of those, how many are asked")
    p.add_argument("--probe-tokens", type=int, default=64, help="tokens scored by each NLL probe")
    p.add_argument("--continue-tokens", type=int, default=12, help="greedy tokens of free continuation "
                   "(agreement only)")
    p.add_argument("--chunk-size", type=int, default=16384, help="prefill chunk; a longer quality context runs the real chunked prefill (KVzip: not chunked)")
    p.add_argument("--window", type=int, default=4096, help="recent tokens always kept (short contexts: 2%%)")
    p.add_argument("--speed-lengths", type=ints, default=[2048, 8192, 16384], help="CPU speed contexts ('0' = none)")
    p.add_argument("--speed-budget", type=float, default=0.3, help="budget of the speed runs (paper Fig. 1b: 30%%)")
    p.add_argument("--speed-chunk", type=int, default=2048, help="prefill chunk of the CPU speed runs: the "
                   "paper's 16K chunk over 170K contexts, scaled to 16K contexts")
    p.add_argument("--speed-window", type=int, default=512, help="local window of the CPU speed runs (scaled 4096)")
    p.add_argument("--speed-decode", type=int, default=32, help="tokens decoded per speed run")
    p.add_argument("--speed-repeats", type=int, default=2, help="runs of full, transformers and fastkvzip at "
                   "--speed-budget per length, taken in turn; their rows hold medians")
    p.add_argument("--no-peer", action="store_true", help="CPU speed: skip transformers (the peer column; it "
                   "runs whenever transformers is installed)")
    p.add_argument("--batch-sizes", type=ints, default=[], help="CPU batched decoding: requests decoded at "
                   "once, e.g. 1,4,8 ('0' = none, the default)")
    p.add_argument("--batch-length", type=int, default=1024, help="batched decoding: the longest context (the "
                   "others 75-100%% of it)")
    p.add_argument("--gpu-lengths", type=ints, default=[8192, 32768, 131072], help="GPU speed contexts")
    p.add_argument("--no-quality", action="store_true", help="skip the quality section")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU section even when CUDA is available")
    p.add_argument("--average", type=lambda s: s.split(","), default=list(quality.AVERAGED),
                   help="tasks in the relative-performance average (default: all four, as the paper's Figure 10); "
                        "a summary choice: --merge can recompute it from finished runs")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the intervals")
    p.add_argument("--seed", type=int, default=0, help="seed for contexts, needles, random scores, bootstrap")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default). 1: on the "
                   "2-core CPU, 2 threads made the whole run 5x slower (small decode ops, other load)")
    p.add_argument("--out", help="output folder (default results/<timestamp>/)")
    p.add_argument("--plot", action="store_true", help="also draw relative.png (needs matplotlib)")
    p.add_argument("--shard", default="0/1", help="k/n: run only the quality contexts c with c %% n == k, to "
                   "split one experiment over processes or machines (each with its own --out; then --merge)")
    p.add_argument("--merge", type=lambda s: [x for x in s.split(",") if x],
                   help="comma list of --out folders of one experiment's shards: merge them into --out, run nothing")
    args, unset = p.parse_args(argv), object()
    # parsed again onto a namespace that already holds every flag, argparse sets only the flags typed:
    # those keep their value under --quick
    typed = {k for k, v in vars(p.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset)))).items()
             if v is not unset}
    try:
        shard = tuple(int(x) for x in args.shard.split("/"))
        assert len(shard) == 2 and 0 <= shard[0] < shard[1]
    except (ValueError, AssertionError):
        p.error(f"--shard {args.shard}: expected k/n with 0 <= k < n, e.g. 0/2")
    args.shard = shard
    if args.quick:
        for k, v in QUICK.items():
            if k not in typed:
                setattr(args, k, v)
    check_args(p, args)
    if "full" not in args.methods:
        args.methods = ["full"] + args.methods  # every relative score needs the full cache
    return args


def check_args(p, args):
    """Every flag on its own, before anything loads (p.error: exit 2)."""
    bad = [m for m in args.methods if m not in METHODS] + [lv for lv in args.extra_levels if lv not in LEVELS]
    if bad:
        p.error(f"unknown method/level {bad}: methods are {','.join(METHODS)}, levels {','.join(LEVELS)}")
    if not args.budgets or not all(0 < b <= 1 for b in args.budgets):
        p.error(f"--budgets {','.join(map(str, args.budgets)) or '(none)'}: each must be in (0, 1]")
    if not 0 < args.speed_budget <= 1:
        p.error(f"--speed-budget {args.speed_budget}: must be in (0, 1]")
    if not args.average or any(t not in quality.AVERAGED for t in args.average):
        p.error(f"--average {','.join(args.average) or '(none)'}: tasks are {','.join(quality.AVERAGED)}")
    for name in ("methods", "budgets", "extra_levels", "average"):  # a repeated value would run (and count) twice
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    for flag, low in (("contexts", 1), ("chunk_size", 1), ("speed_chunk", 1), ("speed_decode", 1), ("bootstrap", 1),
                      ("window", 0), ("speed_window", 0), ("passkeys", 0), ("kv_pairs", 0), ("kv_questions", 0),
                      ("continue_tokens", 0), ("threads", 0), ("probe_tokens", quality.CUE_TOKENS + 1)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}"
                    + (f" (the repeat probe's first {quality.CUE_TOKENS} tokens are its cue)" if flag == "probe_tokens"
                       else ""))
    if not -2**63 <= args.seed < 2**63:
        p.error(f"--seed {args.seed} does not fit in 64 bits")
    if args.passkeys > len(quality.OWNERS):
        p.error(f"--passkeys {args.passkeys}: at most {len(quality.OWNERS)} (one per named owner)")
    if args.kv_questions > args.kv_pairs:
        p.error(f"--kv-questions {args.kv_questions} asks more pairs than --kv-pairs {args.kv_pairs} holds")
    if not args.no_quality and not args.merge and not args.lengths:
        p.error("--lengths is empty: give context lengths, or --no-quality")


def main(argv=None):
    return run(parse_args(argv))


def run(args):
    if args.merge:
        return merge(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    folder = resolve_model(args.model)
    # the cheap checks first (config, tokenizer, gate, lengths, --out): the weights load last
    cfg = ModelConfig.from_json(folder)
    tok = load_tokenizer(folder, cfg.vocab_size)
    fmt = prompt_format(cfg, args.model, chat=args.chat)
    gates = gate.resolve_gate(args.gate, cfg, args.model)
    check_lengths(args, cfg, tok, len(tok.encode(fmt.system, add_special_tokens=False).ids))
    out = Path(args.out or ROOT / "results" / time.strftime("%Y%m%d-%H%M%S"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create the folder ({e.strerror or e}); pass another --out") from None
    args.out_dir = str(out)
    config = run_config(args, folder, gates)
    key = config["quality_key"] = quality_key(args, config)
    config.update({f"{k}_key": v for k, v in speed_keys(args, config).items()})
    done = load_records(out, key)  # an interrupted run with the same --out resumes after its last context
    results = dict(config=config, compressed_layers=list(cfg.compressed_layers), rows=[], complete=False)
    gpu = torch.cuda.is_available() and not args.no_gpu
    previous = out / "results.json"
    if previous.exists():  # keep the speed rows of an earlier run of this folder if this one does not redo them
        old = read_json(previous, "delete it: the finished contexts in contexts/ are kept, only speed rows are lost")
        for k, redo in (("speed", bool(args.speed_lengths)), ("gpu", gpu)):
            if not old.get(k) or redo:
                continue  # nothing to keep, or replaced by this run
            if old["config"].get(f"{k}_key") != config[f"{k}_key"]:
                raise UsageError(f"{previous} holds {k} rows of another configuration ("
                                 f"{differing(old['config'].get(f'{k}_key') or {}, config[f'{k}_key'])} differ); "
                                 f"use a new --out, or the flags of the run that wrote them")
            results[k] = old[k]
            if k == "speed" and old.get("speed_peer"):  # the peer rows were measured in the same run
                results["speed_peer"] = old["speed_peer"]
    write_text(out / "config.json", json.dumps(config, indent=1))
    model = load_model(folder, "cpu", torch.float32)  # CPU: fp32 compute (bf16 is ~4x slower without bf16 units)
    records = list(done.values())

    def save():
        results["seconds"] = time.perf_counter() - t_start + sum(r["seconds"] for r in done.values())
        if records:
            results.update(quality_results(records, args))
        write_results(out, results)

    def finished(record):  # each context is kept the moment it ends: a killed run loses at most one
        (out / "contexts").mkdir(exist_ok=True)
        write_text(out / "contexts" / f"context-{record['context']:03d}.json", json.dumps({**record, "key": key}))
        records.append(record)
        save()
    log(f"model {folder}, gate {gates.meta.get('source')}; writing {out}"
        + (f"; resuming after {len(done)} finished contexts" if done else ""))
    if not args.no_quality:
        quality.run(model, tok, fmt, args, done, on_context=finished)
    if args.speed_lengths:
        teacher = KVzipTeacher(model, tok, fmt) if "kvzip" in args.methods else None
        system = tok.encode(fmt.system, add_special_tokens=False).ids
        stream = [t for _, d in load_docs(tok) for t in d]
        peer = None if args.no_peer else load_peer(folder)
        results["speed"], results["speed_peer"] = speed(model, teacher, args.speed_lengths,
                                                        lambda n: (system + stream[:n], len(system)), args, peer=peer)
    if args.batch_sizes:
        system = tok.encode(fmt.system, add_special_tokens=False).ids
        stream, n = [t for _, d in load_docs(tok) for t in d], args.batch_length
        lengths = [n - (n // 4) * i // max(1, max(args.batch_sizes) - 1) for i in range(max(args.batch_sizes))]
        docs = [system + stream[sum(lengths[:i]):sum(lengths[:i]) + m] for i, m in enumerate(lengths)]  # distinct text
        peer = None if args.no_peer else load_peer(folder)
        results["batch_speed"] = batch_speed(model, peer, docs, len(system), args)
        save()
    if gpu:
        results["gpu"] = gpu_section(args)
    elif not results.get("gpu"):
        results["gpu_note"] = ("GPU section (random-weight Qwen3-8B shape up to 128K tokens) not run: "
                               + ("--no-gpu." if args.no_gpu else "no CUDA device on this machine."))
    results["complete"] = True
    save()
    finish(results, out, args)
    log(f"done in {(time.perf_counter() - t_start) / 60:.1f} min -> {out}/results.md")


def check_lengths(args, cfg, tok, n_system):
    """Context lengths against the model, the prefill chunk and the corpus, before anything runs."""
    quality_n = 0 if args.no_quality else max(args.lengths)
    # after the context: a question turn and its answer, or a probe with its ~20-token cue text; 4 + decoded
    # tokens after a speed context (generate.answer's prompt)
    for flag, n, after in (("--lengths", quality_n, args.probe_tokens + 64),
                           ("--speed-lengths", max(args.speed_lengths, default=0), args.speed_decode + 4)):
        if n and n_system + n + after > cfg.max_position_embeddings:
            raise UsageError(f"{flag} {n}: with the system prompt and what follows the context, more than the "
                             f"model's {cfg.max_position_embeddings} positions; use shorter contexts")
    if torch.cuda.is_available() and not args.no_gpu and args.gpu_lengths and \
            max(args.gpu_lengths) + args.speed_decode + 4 > QWEN3_8B["max_position_embeddings"]:
        raise UsageError(f"--gpu-lengths {max(args.gpu_lengths)}: more than the {QWEN3_8B['max_position_embeddings']} "
                         f"positions of Qwen3-8B's shape with the decoded tokens")
    corpus = sum(len(d) for _, d in load_docs(tok)) if args.speed_lengths else 0  # speed contexts are cut from it
    if args.speed_lengths and max(args.speed_lengths) > corpus:
        raise UsageError(f"--speed-lengths {max(args.speed_lengths)}: longer than the whole Austen corpus ({corpus} "
                         f"tokens)")


def read_json(path, fix):
    """A JSON object this script wrote (atomically): damaged by something else (a copy cut short) -> UsageError
    naming the file and `fix`, what to do about it."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise UsageError(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:80]}); {fix}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{path} holds a JSON {type(obj).__name__}, not a bench result; {fix}")
    return obj


def kept(args):
    """What an interrupted run (Ctrl-C, SIGTERM, a full disk) keeps, and how to resume it: a clause for
    cli.main."""
    out = getattr(args, "out_dir", None)  # set once --out exists
    if args.merge or out is None:
        return None
    n = len(list((Path(out) / "contexts").glob("context-*.json")))
    again = "the same command" + ("" if args.out else f" with --out {out}")  # the default --out is a new folder
    return f"{n} finished contexts are kept in {out}; rerun {again} to resume"


def write_results(out, results):
    write_text(out / "results.json", json.dumps(results, indent=1))
    write_text(out / "results.md", markdown(results))


def finish(results, out, args):
    if args.plot:
        quality.plot(results, out / "relative.png")
    avg = {(label(r), r["budget"]): r["relative"] for r in results["rows"] if r["task"] == "average"}
    low = min((b for _, b in avg), default=None)
    log("relative at the lowest budget: " + ", ".join(f"{c}@{b:g} {v:.2f}" for (c, b), v in avg.items()
                                                       if v is not None and b == low))


def merge(args):
    """Several runs of one experiment (shards: --shard k/n, each with its own --out) -> one result in --out."""
    if not args.out:
        raise UsageError("--merge needs --out: the folder that receives the merged results")
    folders = [Path(f) for f in args.merge]
    missing = [str(f) for f in folders if not (f / "config.json").exists()]
    if missing:
        raise UsageError(f"no bench run in {', '.join(missing)} (config.json missing)")
    configs = [read_json(f / "config.json", "rerun that folder's command to rewrite it, or leave it out of --merge")
               for f in folders]
    key = configs[0]["quality_key"]
    records, results = {}, dict(config=dict(configs[0], merged_from=[str(f) for f in folders],
                                            commands=[c["command"] for c in configs]), rows=[])
    for f in folders:
        for c, rec in load_records(f, key).items():
            records.setdefault(c, rec)  # a context run twice (same seed, same flags) is the same context
        old = read_json(f / "results.json", "delete it: the contexts are merged from contexts/, its speed rows are "
                        "lost") if (f / "results.json").exists() else {}
        for k in ("speed", "gpu"):
            if not old.get(k):
                continue
            row_key = old["config"].get(f"{k}_key")
            if results.get(k) and results["config"].get(f"{k}_key") != row_key:
                raise UsageError(f"{f} holds {k} rows of another configuration than the folders before it "
                                 f"({differing(results['config'].get(f'{k}_key') or {}, row_key or {})} differ)")
            results[k] = results.get(k, []) + old[k]
            results["config"][f"{k}_key"] = row_key
            if k == "speed" and old.get("speed_peer"):  # measured in the same run as these rows
                results["speed_peer"] = results.get("speed_peer", []) + old["speed_peer"]
        results["compressed_layers"] = old.get("compressed_layers", results.get("compressed_layers"))
        results["seconds"] = max(results.get("seconds", 0), old.get("seconds", 0))  # shards run side by side
    expected = len(key["lengths"]) * key["contexts"]
    if len(records) < expected:
        log(f"merge: {len(records)} of {expected} contexts finished; the result is partial")
    results.update(quality_results(list(records.values()), args), complete=len(records) == expected)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, results)
    write_text(out / "config.json", json.dumps(results["config"], indent=1))
    finish(results, out, args)
    log(f"merged {len(records)} contexts from {len(folders)} runs -> {out}/results.md")


if __name__ == "__main__":
    cli.main(run, parse_args(), ModelError, gate.GateError, kept=kept)  # bad --model / --gate / folders: one line
