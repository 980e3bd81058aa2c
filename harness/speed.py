"""
Speed and memory through the real path: generate.prefill / prefill_kvzip and answer on fresh caches,
beside transformers on the same checkpoint (the peer column, when transformers is installed);
batched decoding (serving.batch.Batch); on a GPU, random weights in Qwen3-8B's shape.
"""
import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import gate
import generate
from cache import Budget, KVCache, full_cache_bytes
from formats.gate_file import save_gate
from harness.quality import DEFAULT_LEVEL, log, method_cache, model_info
from harness.timing import TokenClock, time_scorer
from model import ModelConfig, Transformer, load_tokenizer
from prompts import prompt_format
from serving.batch import Batch
from teacher import KVzipTeacher

# ---- Speed and memory through the real path (generate.prefill and answer on fresh caches) --------

@dataclass
class SpeedSettings:
    """What every speed run shares (bench.py's --speed-* flags)."""
    model: str                  # the model's name: picks its bundled gate when gate is None
    gate: str | None            # the gate file of the fastkvzip runs
    seed: int                   # random method's scores; the GPU section's random weights
    budget: float = 0.3  # fastkvzip's budget in the compared runs (the paper's Figure 1b: 30%)
    budgets: tuple = ()         # decode speed at each of these too, on the shortest context
    chunk_size: int = 2048      # prefill chunk
    window: int = 512           # local window
    decode: int = 32            # tokens decoded per run
    repeats: int = 2  # runs of full, transformers and fastkvzip, in turn; rows hold medians


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def timed_run(model, method, budget, ids, n_protected, teacher, s):
    """Prefill ids with one method as generate.py does, then decode; -> one speed row."""
    cfg, dtype, device = model_info(model)
    # the cache is made (and the gate loaded) before the clock starts
    cache = KVCache(cfg, dtype, device) if method == "full" else method_cache(
        model, method, DEFAULT_LEVEL[method], n_protected, s.model, s.gate, s.seed)
    teacher = TimedTeacher(teacher) if method == "kvzip" else None
    if getattr(cache, "scorer", None) is not None:  # the gate's (or a baseline's) share
        time_scorer(cache.scorer, device)
    sync(device)
    t0 = time.perf_counter()
    if method == "kvzip":  # full prefill, the teacher's repeat pass, one eviction (METHOD.md §6)
        generate.prefill_kvzip(model, teacher, cache, ids, n_protected,
                               Budget(budget, s.chunk_size, s.window))
        score_s = teacher.seconds
    else:
        generate.prefill(model, cache, ids, n_protected, Budget(budget, s.chunk_size, s.window))
        score_s = getattr(getattr(cache, "scorer", None), "seconds", 0.0)
    sync(device)
    prefill_s = time.perf_counter() - t0
    kv_bytes, kept, peak = cache.nbytes, cache.kept_nbytes, cache.peak_nbytes
    clock = TokenClock()  # the steps after the first token, timed as the tokens arrive
    generate.answer(model, cache, [ids[-1]] * 4, s.decode, stop_ids=set(), on_token=clock.token)
    return dict(context=len(ids) - n_protected, method=method, budget=budget, prefill_s=prefill_s,
                prefill_tok_s=len(ids) / prefill_s, score_s=score_s,
                score_fraction=score_s / prefill_s, kv_bytes=kv_bytes,
                kv_kept_bytes=kept, kv_bytes_full=full_cache_bytes(cache, len(ids)),
                peak_kv_bytes=peak,
                decode_tok_s=clock.steps / clock.seconds if clock.seconds > 0 else None,
                device=device.type)


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


def speed(model, teacher, lengths, ids_for, s, tag="cpu", peer=None):
    """Speed and memory rows, one per (length, method, budget), and the peer's rows (transformers on
    the same checkpoint, peer_run) when a peer is given. Full, fastkvzip at s.budget and the peer
    are run s.repeats times in turn (full, peer, fastkvzip, full, ...), so that load on the machine
    hits them alike, and their rows hold the medians; those two of ours get vs_peer: prefill and
    decode speed as multiples of the peer's (> 1: ours is faster)."""
    rows, peer_rows = [], []
    for n in lengths:
        ids, n_protected = ids_for(n)
        compared = ([("full", 1.0)] + [("transformers", 1.0)] * bool(peer)
                    + [("fastkvzip", s.budget)])
        runs = compared * s.repeats + [("kvzip", s.budget)] * bool(teacher)
        # decode speed at every budget, on the shortest context (one prefill each)
        if n == lengths[0]:
            runs += [("fastkvzip", b) for b in s.budgets if b not in (1.0, s.budget)]
        done = {}
        for method, budget in runs:
            row = ((peer_run(peer, ids, n_protected, s.chunk_size, s.decode)
                    if method == "transformers"
                    else timed_run(model, method, budget, ids, n_protected, teacher, s)))
            done.setdefault((method, budget), []).append(row)
            log(f"speed[{tag}] {n} tokens {method} at {budget:g}: prefill "
                f"{row['prefill_s']:.1f} s, KV {row['kv_bytes'] / 2**20:.1f} MiB (peak "
                f"{(row['peak_kv_bytes'] or 0) / 2**20:.1f}), decode "
                f"{row['decode_tok_s'] or 0:.1f} tok/s")
        for (method, budget), reps in done.items():
            (peer_rows if method == "transformers" else rows).append(median_row(reps))
    for r in rows:  # ratios against the full cache at the same length
        f = next(x for x in rows if x["context"] == r["context"] and x["method"] == "full")
        # KV held: against an exactly packed full cache (the full run itself may hold decode slack:
        # <= 1,024 rows per head after a one-token last chunk); peak: against the full run's real
        # peak
        r.update(prefill_vs_full=r["prefill_s"] / f["prefill_s"],
                 kv_vs_full=r["kv_bytes"] / r["kv_bytes_full"], peak_vs_full=r["peak_kv_bytes"]
                 / f["peak_kv_bytes"])
        p = next((x for x in peer_rows if x["context"] == r["context"]), None)
        # run in turn
        if p and (r["method"], r["budget"]) in (("full", 1.0), ("fastkvzip", s.budget)):
            decode = (r["decode_tok_s"] / p["decode_tok_s"] if r["decode_tok_s"]
                      and p["decode_tok_s"] else None)
            r["vs_peer"] = dict(prefill=p["prefill_s"] / r["prefill_s"], decode=decode)
    return rows, peer_rows


def median_row(reps):
    """One row for repeated runs: the median prefill time and decode speed, each run's kept in
    *_runs."""
    row = dict(reps[-1], repeats=len(reps))
    for k in ("prefill_s", "prefill_tok_s", "decode_tok_s", "score_fraction"):
        vals = [r[k] for r in reps if r.get(k) is not None]
        if k in row:
            row[k] = float(np.median(vals)) if vals else None
    row.update(prefill_s_runs=[r["prefill_s"] for r in reps],
               decode_tok_s_runs=[r["decode_tok_s"] for r in reps])
    return row


def load_peer(folder):
    """The same checkpoint in transformers (SDPA attention, fp32), or None when transformers is not
    installed."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        log("speed: transformers is not installed: no peer column (pip install -r "
            "requirements-test.txt)")
        return None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.version = transformers.__version__
    return model.eval().requires_grad_(False)


def peer_prefill(peer, ids, chunk):
    """ids through transformers in chunks into its DynamicCache (logits of the last position only)
    -> (forward(token ids) -> last logits, the prefill's last logits, KV bytes held)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=peer.config)
    forward = lambda x: peer(torch.tensor([x]), past_key_values=cache, use_cache=True,
                             logits_to_keep=1).logits[0, -1]
    for i in range(0, len(ids), chunk):
        logits = forward(ids[i:i + chunk])
    return forward, logits, sum(t.nbytes for layer in cache.layers
                                for t in (layer.keys, layer.values))


@torch.no_grad()
def peer_run(peer, ids, n_protected, chunk_size, steps):
    """timed_run's work through transformers: the same prefill chunks (peer_prefill), the same
    4-token question, the same greedy decode timed the same way."""
    t0 = time.perf_counter()
    forward, _, kv_bytes = peer_prefill(peer, ids, chunk_size)
    prefill_s = time.perf_counter() - t0
    logits, out = forward([ids[-1]] * 4), []
    t0 = time.perf_counter()
    for _ in range(steps):  # as generate.answer: sample, stop at the last token, else one forward
        out.append(generate.sample(logits))
        if len(out) == steps:
            break
        logits = forward([out[-1]])
    decode_s = time.perf_counter() - t0
    return dict(context=len(ids) - n_protected, method="transformers", budget=1.0,
                prefill_s=prefill_s, prefill_tok_s=len(ids) / prefill_s, kv_bytes=kv_bytes,
                peak_kv_bytes=None, decode_tok_s=(len(out) - 1) / decode_s if decode_s > 0
                else None, version=peer.version)


@torch.no_grad()
def batch_speed(model, peer, docs, n_protected, s, batch_sizes, repeats=1):
    """Decode throughput of B requests at once (serving.batch.Batch: one forward per step for all B,
    one attention call per layer), B in batch_sizes, for the full cache and fastkvzip at s.budget;
    beside it transformers' own batched generate, left-padded to the longest context. docs: the
    contexts (system prompt ⊕ text ids, mixed lengths); every member is prefilled once, alone, and
    copied for each B. Decode is timed alone, after the 4-token question: s.decode greedy steps;
    tokens/s counts all B. `repeats` rounds of every configuration, taken in turn (load on the
    machine hits them alike); each row holds the medians and every round's tokens/s (`runs`)."""
    cfg, dtype, device = model_info(model)
    question, prefilled, runs = [docs[0][-1]] * 4, {}, {}
    for method, budget in (("full", 1.0), ("fastkvzip", s.budget)):
        prefilled[method, budget] = []
        for ids in docs[:max(batch_sizes)]:
            cache = KVCache(cfg, dtype, device) if method == "full" else method_cache(
                model, method, DEFAULT_LEVEL[method], n_protected, s.model, s.gate, s.seed)
            generate.prefill(model, cache, ids, n_protected, Budget(budget, s.chunk_size, s.window))
            prefilled[method, budget].append(cache)
    for _ in range(repeats):
        for (method, budget), caches in prefilled.items():
            for B in batch_sizes:
                row = batch_run(model, caches[:B], question, s.decode)
                row.update(method=method, budget=budget)
                runs.setdefault((method, budget, B), []).append(row)
                log(f"batch speed {method} at {budget:g}, B={B}: {row['decode_tok_s']:.1f} tok/s, "
                    f"KV {row['kv_bytes'] / 2**20:.1f} MiB")
        for B in batch_sizes if peer is not None else []:
            row = peer_batch_run(peer, docs[:B], question, s.decode)
            runs.setdefault(("transformers", 1.0, B), []).append(row)
            log(f"batch speed transformers, B={B}: {row['decode_tok_s']:.1f} tok/s")
    med = lambda rs, key: float(np.median([r[key] for r in rs]))
    return [dict(rs[0], runs=[r["decode_tok_s"] for r in rs], decode_tok_s=med(rs, "decode_tok_s"),
                 decode_cpu_tok_s=med(rs, "decode_cpu_tok_s")) for rs in runs.values()]


def batch_run(model, prefilled, question, steps):
    """One timing: copies of the B prefilled caches join a Batch after the question; steps steps."""
    cfg, dtype, device = model_info(model)
    batch, tokens = Batch(cfg, dtype, device), []
    for cache in (copy.deepcopy(c) for c in prefilled):
        # as generate.decode: the question and the answer's rows reserved (`steps` fed back)
        logits = generate.begin_answer(model, cache, question, max_new_tokens=steps + 1)
        tokens.append(int(logits.argmax()))
        batch.join(cache)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        tokens = generate.decode_batch(model, batch, tokens).argmax(-1).tolist()
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    B = len(prefilled)
    return dict(batch=B, decode_tok_s=B * steps / secs, decode_cpu_tok_s=B * steps / cpu,
                kv_bytes=batch.nbytes, kv_kept_bytes=batch.kept_nbytes,
                peak_kv_bytes=batch.peak_nbytes)


def peer_batch_run(peer, docs, question, steps):
    """transformers' generate on B contexts at once (left padding, attention mask, greedy, exactly
    `steps` + 1 new tokens); decode time from its first new token to its last, read by a
    streamer."""
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
    out = peer.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=steps + 1,
                        min_new_tokens=steps + 1, do_sample=False, streamer=clock, pad_token_id=0,
                        return_dict_in_generate=True)
    kv = sum(t.nbytes for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    # after the prefill's token: `steps` decode forwards
    (t1, c1), (t2, c2) = clock.times[1], clock.times[-1]
    return dict(method="transformers", budget=1.0, batch=len(docs), decode_tok_s=len(docs) * steps
                / (t2 - t1), decode_cpu_tok_s=len(docs) * steps / (c2 - c1), kv_bytes=kv,
                peak_kv_bytes=None, padded_to=L, version=peer.version)


def batch_markdown(rows, batch_length, steps):
    if not rows:
        return []
    one = {(r["method"], r["budget"]): r["decode_tok_s"] for r in rows if r["batch"] == 1}
    peer = {r["batch"]: r["decode_tok_s"] for r in rows if r["method"] == "transformers"}
    rounds = len(rows[0].get("runs") or [0])
    out = ["", "## Batched decoding (generate.py --batch)", "",
           "B requests decode together, one forward per step (serving.batch.Batch); contexts of "
           f"{batch_length} tokens and shorter (75-100%), each prefilled alone; {steps} greedy "
           "steps after a 4-token question, tokens/s over all B. transformers: its own generate on "
           "the same contexts, left-padded, timed from its first new token. KV: bytes the batch "
           "holds at the end (transformers: its padded DynamicCache); held / kept: those "
           "bytes over the bytes of the rows kept (slack is the difference). CPU tok/s: over this "
           "process's CPU seconds (what other jobs on a shared machine disturb least)."
           + (f" Medians of {rounds} rounds, taken in turn." if rounds > 1 else ""), "",
           "| method | budget | B | decode tok/s | × B=1 | × transformers | CPU tok/s | KV held "
           "| held / kept |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x1 = (r["decode_tok_s"] / one[(r["method"], r["budget"])]
              if (r["method"], r["budget"]) in one else None)
        xp = (r["decode_tok_s"] / peer[r["batch"]] if r["batch"] in peer
              and r["method"] != "transformers" else None)
        f = lambda x: f"{x:.2f}×" if x is not None else "–"
        out.append(f"| {r['method']} | {r['budget']:g} | {r['batch']} | {r['decode_tok_s']:.1f} | "
                   f"{f(x1)} | {f(xp)} | {r['decode_cpu_tok_s']:.1f} | "
                   f"{r['kv_bytes'] / 2**20:.1f} MiB | "
                   f"{f(r['kv_bytes'] / r['kv_kept_bytes'] if r.get('kv_kept_bytes') else None)} |")
    return out


# Qwen3-8B's published shape (HF config), with the YaRN scaling the authors use for long contexts
# (METHOD.md §9)
QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=131072,
                rope_theta=1e6, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                  original_max_position_embeddings=32768),
                tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)


def random_model(shape, device, dtype, seed=0):
    """A model of the given config dict with random weights (speed and memory only: no real 8B
    weights exist offline). Norm weights 1, matrices N(0, 1/fan_in): activations stay finite through
    the layers."""
    cfg = ModelConfig.from_dict(shape)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():  # parameters only: the RoPE buffers stay fp32
            p.data = torch.ones_like(p, dtype=dtype) if p.dim() == 1 else \
                torch.randn(p.shape, generator=g, device=device, dtype=dtype) * p.shape[-1] ** -0.5
    return model.eval().requires_grad_(False)


def gpu_section(s, lengths, out_dir, shape=QWEN3_8B, device="cuda", chunk=16000, window=4096):
    """Speed and memory of full / fastkvzip / kvzip on a random-weight model of `shape`, contexts of
    `lengths` tokens, with the paper's own prefill chunk and window (METHOD.md §6); the random gate
    is written in out_dir."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype, s.seed)
    cfg = model_info(model)[0]
    gates = gate.Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                       cfg.group_size, dtype=dtype, device=device)
    gate_file = str(Path(out_dir) / "random-gate.safetensors")  # a random gate: timing only
    save_gate(gate_file, gates, {"note": "random weights, for timing only"})
    teacher = None
    try:
        from offline import fetch_assets
        tok = load_tokenizer(fetch_assets.tokenizer_file("qwen3").parent)
        teacher = KVzipTeacher(model, tok, prompt_format(cfg, "qwen3-8b"))
    except Exception as e:  # no tokenizer asset: KVzip's repeat prompt cannot be written
        log(f"gpu: no KVzip timing ({e})")
    gen = torch.Generator().manual_seed(s.seed)

    def ids_for(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist(), 0
    s = dataclasses.replace(s, gate=gate_file, chunk_size=chunk, window=window)
    return speed(model, teacher, lengths, ids_for, s, tag=device.type)[0]
