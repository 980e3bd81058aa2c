"""
Generate with a compressed KV cache: the method's path from a prompt to its answers.

The context is prefilled in chunks; after every chunk the tokens that left the local window are
scored and the least important KV pairs are evicted (METHOD.md §6). Questions are then answered one
by one from the same compressed cache, each rolled back afterwards (METHOD.md §11's query-agnostic
setting). Many requests decode together: each is prefilled alone, then their rows join one ragged
cache (a batch: serving/batch.py), one forward of one token each per step.

Read first: prefill, then answer (one question), then decode (many requests). `python generate.py
...` keeps its command line (flags, requests, batch files, saved caches, printing, the time each
step took) in commands/generate.py.
"""
import math
import numbers
import sys
from dataclasses import dataclass, field
from itertools import islice

import torch

import gate
from cache import Budget, EvictingCache, KVCache, check_answering, is_count
from gate import METHODS
from kernels import ArgumentError
from model import NonFiniteLogits
from prompts import check_ids

# -------------------------------------------------------------------------------------------------
# sampling (small pure functions, as gpt-fast)

def logits_to_probs(logits, temperature=1.0, top_p=1.0):
    # float64, the largest logit first moved to 0: a tiny temperature (1e-40) overflowed float32 to
    # inf - inf = NaN; here the others go to -inf and the largest keeps all the mass
    logits = logits.double()
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
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
# prefill, one decode step

def prefill(model, cache, ids, n_protected, budget=Budget()):
    """Feed ids (system prompt ⊕ context) in chunks of budget.chunk_size, evicting after each
    chunk (METHOD.md §6); -> the last position's logits. A full KVCache evicts nothing."""
    check_prompt(cache, ids, n_protected, budget, scored=True)
    cache.prefilled_ids = torch.tensor(list(ids), dtype=torch.long)
    n_context = len(ids) - n_protected
    evicting = isinstance(cache, EvictingCache) and n_context > 0
    plan = budget.plan(n_context) if evicting else None
    if not isinstance(cache, EvictingCache) and len(ids) > budget.chunk_size:
        cache.reserve(len(ids))  # every row it will hold: later chunks append without a re-layout
    start = n_protected  # first position not evaluated yet
    for i in range(0, len(ids), budget.chunk_size):
        chunk = torch.tensor(ids[i:i + budget.chunk_size], device=cache.device)
        logits = model(chunk, cache, num_logits=1)[-1]
        if evicting:  # evict what just left the window: the explicit step of the method
            end = cache.n_seen - plan.window  # tokens older than the window are evaluated now
            if end > start:
                cache.evict(start, end, plan.segment_ratio)
                start = end
    return newest(cache, logits)


def prefill_kvzip(model, teacher, cache, ids, n_protected, budget=Budget()):
    """KVzip as an inference method (METHOD.md §6, §13.4): prefill the whole context with nothing
    evicted, score it with the reconstruction teacher (about a second prefill), then evict once,
    with the same budget rule as the gate. Peak memory is the full context: the cost the gate
    removes."""
    check_prompt(cache, ids, n_protected, budget)
    full = teacher.new_cache()
    teacher.prefill(full, ids[:-1])
    full.prefilled_ids = torch.tensor(list(ids), dtype=torch.long)
    last = model(torch.tensor(ids[-1:], device=full.device), full, num_logits=1)[-1]
    scores = teacher.score(full, n_protected, ids[n_protected:])  # (L_g, H, n_context)
    cache.take_over_prefill(full, scores=scores)
    evict_once(cache, len(ids), n_protected, budget)
    return newest(cache, last)


def check_prompt(cache, ids, n_protected, budget=Budget(), scored=False):
    """What a prefill needs, else an ArgumentError (library misuse fails here, not deep inside): an
    empty cache, token ids of its model, a system prompt within them, the one the cache protects,
    a Budget; scored: a scorer for an EvictingCache that evicts (KVzip's teacher scores instead, in
    prefill_kvzip)."""
    if not isinstance(budget, Budget):
        raise ArgumentError(f"prefill: budget must be a cache.Budget, e.g. Budget(0.3), got "
                            f"{budget!r}")
    if scored and getattr(cache, "scorer", True) is None and budget.ratio < 1:
        raise ArgumentError(f"prefill: the cache has no scorer (make_cache('kvzip') makes one for "
                            f"its teacher) and cannot evict to budget {budget.ratio}: prefill it "
                            f"with generate.prefill_kvzip, or make it for a scoring method")
    if cache.n_seen != 0:
        raise ArgumentError("prefill: the cache already holds a prompt; make a new one "
                            "(generate.make_cache) for each prefill")
    check_ids("prefill", ids, cache.cfg.vocab_size)
    if not is_count(n_protected) or n_protected > len(ids):
        raise ArgumentError(f"prefill: n_protected {n_protected!r} must be an integer in [0, "
                            f"{len(ids)}] (the system prompt's ids)")
    if getattr(cache, "n_protected", n_protected) != n_protected:
        raise ArgumentError(f"prefill: n_protected {n_protected}, but the cache protects "
                            f"{cache.n_protected}: make the cache with the system prompt's length")


def evict_once(cache, n_tokens, n_protected, budget):
    """KVzip's one eviction, once the whole prompt of n_tokens is in the cache with its scores: the
    same budget rule as the chunked prefill, applied to the whole context at once."""
    plan = budget.plan(n_tokens - n_protected)
    cache.evict(n_protected, n_tokens - plan.window, plan.segment_ratio)


def decode_one(model, cache, token):
    """Feed one generated token (after begin_answer) -> the logits of the next."""
    check_step(cache, token)
    logits = model(torch.tensor([int(token)], device=cache.device), cache)[-1]
    if isinstance(cache, EvictingCache):
        cache.after_step()  # every 128 tokens: gate the buffer, evict to --decode-tokens-per-head
    return newest(cache, logits)


def newest(cache, logits):
    """Note the logits after the cache's newest token -> them: formats.cache_file.save_cache
    refuses others (a prefill's, once an answer went into the cache)."""
    cache.newest_logits = (cache.n_seen, logits)
    return logits


def check_step(cache, token):
    """What decode_one needs, else an ArgumentError: a prefilled cache that began its answer (an
    EvictingCache would score the token as prompt and never evict while decoding), a token id."""
    check_answering("decode_one", cache)
    if torch.is_tensor(token) and token.numel() == 1 and not token.is_floating_point():
        token = int(token)  # an argmax
    if not is_count(token) or token >= cache.cfg.vocab_size:
        raise ArgumentError(f"decode_one: token {token!r} is no token id of the model (an integer "
                            f"0 to {cache.cfg.vocab_size - 1})")


def decode_batch(model, batch, tokens):
    """One forward, a token for each member of a batch (serving.batch.Batch) in join order
    -> logits (B, vocab)."""
    logits = model(torch.tensor(tokens, device=batch.device), batch)
    batch.after_step()  # every member's decode-time eviction, on its own rows
    return logits


def begin_answer(model, cache, question_ids, last_logits=None, max_new_tokens=None):
    """Switch the cache to decoding, append the question -> the logits its answer starts from.
    max_new_tokens: the answer's length at most; its rows are reserved with the question's (the
    last token sampled is never fed back), so decoding neither copies the cache nor holds
    spare rows beyond them. With decode-time eviction only the rows up to the next eviction are
    reserved: the budget, not the answer's length, bounds the memory."""
    if isinstance(cache, EvictingCache):
        cache.start_decoding()  # from here on new tokens are buffered and gated 128 at a time
    if max_new_tokens is not None:
        cache.reserve(len(question_ids), max(0, max_new_tokens - 1))
    if not question_ids:
        return newest(cache, last_logits)
    return newest(cache, model(torch.tensor(question_ids, device=cache.device), cache,
                               num_logits=1)[-1])


# -------------------------------------------------------------------------------------------------
# answering: one question from one cache, then many requests decoding together

def next_token(logits, dtype, n_out, temperature=0.0, top_p=1.0, generator=None):
    """sample(), refusing logits that are not finite (argmax of NaN is token 0: never answer that);
    dtype: what they were computed in, n_out: tokens generated so far (for the message)."""
    if not torch.isfinite(logits).all():
        raise NonFiniteLogits(f"the model's logits are inf/NaN after {n_out} generated tokens, "
                              f"computed in {dtype}")
    return sample(logits, temperature, top_p, generator)


@torch.no_grad()
def answer(model, cache, question_ids, max_new_tokens, stop_ids, temperature=0.0, top_p=1.0,
           generator=None, on_token=None, last_logits=None):
    """Append the question to a cache and generate until a stop id or max_new_tokens, the answer
    left in the cache -> its token ids. With no question ids, generation continues the prefill
    (whose last logits are last_logits). on_token(token): each token as it is generated."""
    check_answer(cache, question_ids, max_new_tokens, last_logits)
    check_sampling("answer", stop_ids, temperature, top_p)
    logits = begin_answer(model, cache, question_ids, last_logits, max_new_tokens)
    out = []
    for i in range(max_new_tokens):
        token = next_token(logits, cache.dtype, i, temperature, top_p, generator)
        if token in stop_ids:
            break
        out.append(token)
        if on_token:
            on_token(token)
        if i + 1 < max_new_tokens:  # the last token is never fed back (begin_answer reserved)
            logits = decode_one(model, cache, token)
    return out


@dataclass
class Compression:
    """What scores and evicts the KV pairs of every request of a run (make_cache)."""
    method: str = "fastkvzip"  # one of gate.METHODS
    gates: object = None  # fastkvzip: the gate.Gates (formats.gate_file.resolve_gate loads them)
    teacher: object = None  # kvzip: the teacher.KVzipTeacher that scores the context
    level: str = None  # eviction structure (cache.LEVELS); None: the scorer's own
    decode_tokens_per_head: int = None  # decode-time eviction (EvictingCache); None: keep all
    decode_level: str = None  # decode-time eviction's structure; None: make_cache's default
    decode_window: int = None  # the last tokens decoding keeps; None: make_cache's default
    decode_redundancy: float = None  # fastkvzip's decode-time factor λ; None: make_cache's default
    # scorer -> the scorer to use: how a caller measures it from outside the method (the command
    # line's gate_seconds: harness/timing.py); None: the scorer as made
    wrap_scorer: object = None


@dataclass(eq=False)
class Request:
    """One request while it is answered, all that decoding needs: the cache it prefilled alone, its
    questions, the answer being decoded and the answers given."""
    cache: object
    questions: list  # [(text, ids)]; text "" continues the context, until the plain stop ids
    max_new_tokens: int
    logits: torch.Tensor  # the next token is sampled from these; at first the prefill's last logits
    generator: torch.Generator = None  # sampling: seeded per request, as a run of it alone
    question_index: int = -1  # in questions, the one being answered
    out: list = None  # its answer so far; None between answers
    state: dict = None  # the cache's checkpoint from before the question
    answers: list = field(default_factory=list)  # [{"question", "output_ids"}]

    def ask(self, model):
        """Start question question_index alone: checkpoint, then the question's forward."""
        self.state = self.cache.checkpoint()
        self.logits = begin_answer(model, self.cache, self.questions[self.question_index][1],
                                   self.logits, self.max_new_tokens)
        self.out = []


def prefill_request(model, req, compression=Compression(), seed=0):
    """A request made ready to answer, from plain values: req {"ids": system prompt ⊕ context ids,
    "n_protected": system prompt length, "questions": [(text, ids)], "budget": a cache.Budget,
    "max_new_tokens"} -> a Request whose cache is made for `compression` and prefilled alone.
    Budget 1.0 without decode-time eviction keeps every pair: the full cache, no scorer (and no
    gate) needed."""
    ids, n_protected, budget, how = req["ids"], req["n_protected"], req["budget"], compression
    keeps_all = budget.ratio == 1.0 and how.decode_tokens_per_head is None
    method = "full" if keeps_all else how.method
    if method == "kvzip" and how.teacher is None:
        raise ArgumentError("prefill_request: kvzip needs its teacher "
                            "(Compression(teacher=KVzipTeacher(...)))")
    cache = make_cache(method, model, n_protected, level=how.level,
                       decode_tokens_per_head=how.decode_tokens_per_head, seed=seed,
                       gates=how.gates, decode_level=how.decode_level, decode_window=how.decode_window,
                       decode_redundancy=None if keeps_all else how.decode_redundancy)
    if how.wrap_scorer is not None and getattr(cache, "scorer", None) is not None:
        cache.scorer = how.wrap_scorer(cache.scorer)
    if method == "kvzip":
        logits = prefill_kvzip(model, how.teacher, cache, ids, n_protected, budget)
    else:
        logits = prefill(model, cache, ids, n_protected, budget)
    return Request(cache, req["questions"], req["max_new_tokens"], logits,
                   torch.Generator().manual_seed(seed))


def load_request(model, req, compression, seed, load):
    """prefill_request() for a request whose cache was saved: load(scorer) -> (cache, info) reads
    it (formats.cache_file.load_cache, through the command line). The file decides what its
    prefill did (method, budget, decode-time eviction); `compression` only lends the scorer that
    goes on evicting while decoding (the same gate; the file checks it is the scorer it had)."""
    state, scorer, how = req["cache_state"], None, compression
    if state.get("decode_tokens_per_head") is not None:
        scorer = make_cache(state["method"], model, state["n_protected"],
                            decode_tokens_per_head=state["decode_tokens_per_head"], seed=seed,
                            gates=how.gates, decode_redundancy=state.get("decode_redundancy")).scorer
        scorer = how.wrap_scorer(scorer) if how.wrap_scorer else scorer
    cache, info = load(scorer)
    return Request(cache, req["questions"], req["max_new_tokens"], info["last_logits"],
                   torch.Generator().manual_seed(seed))


def stop_rule(stop_ids=(), answer_stop_ids=None, ends_line=None):
    """-> stops(request, token): whether token ends the request's answer. answer_stop_ids (default
    stop_ids) end an answer to a question; stop_ids end a continuation of the context (question
    text ""). ends_line(answer so far, token) -> bool, for a base model's one-line answers
    (prompts.one_line): also ends an answer to a question."""
    plain = set(stop_ids)
    asked = plain if answer_stop_ids is None else set(answer_stop_ids)

    def stops(r, token):
        if not r.questions[r.question_index][0]:
            return token in plain
        return token in asked or (ends_line is not None and ends_line(r.out, token))
    return stops


def decode_step(model, batch, active):
    """One forward of every answering request's last token (the rows of a batch, or a lone
    request's own cache): each request's logits are then its next token's."""
    tokens = [r.out[-1] for r in active]
    if batch is None:
        logits = decode_one(model, active[0].cache, tokens[0])[None]
    else:
        logits = decode_batch(model, batch, tokens)  # (B, vocab)
    for r, row in zip(active, logits):
        r.logits = row


def between_answers(model, r):
    """A request whose answer just ended (or that was just prefilled): the answer kept, the cache
    rolled back, its next question started alone, until one has tokens to decode (r.out == []) or
    none is left (r.out is None). Yields decode()'s events."""
    while True:
        if r.out is not None:  # the answer that just ended
            r.answers.append({"question": r.questions[r.question_index][0], "output_ids": r.out})
            yield "answer", r
            r.cache.rollback(r.state)
            r.out = None
        if r.question_index + 1 == len(r.questions):
            yield "done", r
            r.cache = None  # its memory is free before the next request is prefilled
            return
        r.question_index += 1
        yield "question", r
        r.ask(model)
        if r.max_new_tokens > 0:  # else an empty answer, as asked
            return


@torch.no_grad()
def decode(model, requests, batch_size=1, stop_ids=(), answer_stop_ids=None, temperature=0.0,
           top_p=1.0, ends_line=None, batch=None):
    """The decode loop, for one request or many: each Request's questions are answered in turn from
    its cache, each rolled back afterwards (METHOD.md §11); at most batch_size requests (taken from
    the iterator `requests` as slots free) answer at once, their rows in one `batch`, an empty
    serving.batch.Batch (serving.scheduler.decode makes it), one forward of one token each per step
    (batch_size 1: on the request's own cache, no batch). A request whose answer ends leaves the
    batch, starts its next question alone and rejoins. Greedy answers are the ones each request gets
    alone (tests/test_batch.py). Stops: stop_rule's. Yields (event, request): "question"
    (request.question_index starts; its max_new_tokens may still change), "token" (request.out[-1];
    lowering max_new_tokens to len(out) ends the answer there), "answer" (request.answers[-1],
    before the rollback), "done" (its cache still readable)."""
    if batch_size > 1 and batch is None:
        raise ArgumentError("decode: batch_size > 1 decodes in a batch: give batch=serving.batch."
                            "Batch(...), or call serving.scheduler.decode, which makes it")
    batch = batch if batch_size > 1 else None
    for ids in (stop_ids, stop_ids if answer_stop_ids is None else answer_stop_ids):
        check_sampling("decode", ids, temperature, top_p)
    stops = stop_rule(stop_ids, answer_stop_ids, ends_line)
    # between: requests not answering, just admitted or whose answer just ended
    requests, active, between = iter(requests), [], []
    while True:
        between += islice(requests, batch_size - len(active) - len(between))  # admitted
        if not active and not between:
            return
        for r in between:  # their next question, alone, then into the batch
            yield from between_answers(model, r)
            if r.out is not None:
                if batch:
                    batch.join(r.cache)
                active.append(r)
        between = []
        for r in active:  # every answering request samples its next token: appended, or it stops
            token = next_token(r.logits, r.cache.dtype, len(r.out), temperature, top_p, r.generator)
            if stops(r, token):
                between.append(r)
                continue
            r.out.append(token)
            yield "token", r
            if len(r.out) == r.max_new_tokens:
                between.append(r)
        for r in between:  # those whose answer ended leave the batch
            if batch:
                batch.leave(r.cache)
            active.remove(r)
        if active:  # one forward for every request still answering: one token each
            decode_step(model, batch, active)


def check_answer(cache, question_ids, max_new_tokens, last_logits):
    """What answer needs, else an ArgumentError: a prefilled cache (an empty one would answer from
    nothing), a question of token ids or the prefill's last logits, a length."""
    if cache.n_seen == 0:
        raise ArgumentError("answer: the cache holds no prompt; prefill it first "
                            "(generate.prefill) or load a saved one (formats.cache_file)")
    vocab, empty = cache.cfg.vocab_size, hasattr(question_ids, "__len__") and not len(question_ids)
    if empty and (last_logits is None or last_logits.shape[-1] != vocab):
        raise ArgumentError(f"answer: give question_ids, or the prefill's last_logits ({vocab} "
                            f"values) to continue the context")
    if not empty:
        check_ids("answer", question_ids, vocab)
    if not is_count(max_new_tokens):
        raise ArgumentError(f"answer: max_new_tokens must be an integer >= 0, got "
                            f"{max_new_tokens!r}")


def check_sampling(call, stop_ids, temperature, top_p):
    """How tokens are chosen, else an ArgumentError naming the argument: stop ids a collection of
    token ids; temperature a number >= 0 (0 greedy); top_p in (0, 1]."""
    number = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    if not (isinstance(stop_ids, (set, frozenset, list, tuple)) and all(map(is_count, stop_ids))):
        raise ArgumentError(f"{call}: stop_ids must be a set of token ids, e.g. "
                            f"set(model.config.eos_token_ids), got {stop_ids!r:.60}")
    if not (number(temperature) and temperature >= 0):
        raise ArgumentError(f"{call}: temperature must be a number >= 0 (0 = greedy), got "
                            f"{temperature!r}")
    if not (number(top_p) and 0 < top_p <= 1):
        raise ArgumentError(f"{call}: top_p must be a number in (0, 1], got {top_p!r}")


# -------------------------------------------------------------------------------------------------
# wiring: model, cache, scorer

def make_cache(method, model, n_protected, gates=None, level=None, decode_tokens_per_head=None,
               seed=0, decode_window=None, decode_level=None, decode_redundancy=None):
    """An empty cache for `method` in model's dtype and device. fastkvzip: scored by `gates` (a
    gate.Gates: formats.gate_file.resolve_gate loads the bundled, a released or a given gate);
    random: scores seeded by seed; level: the eviction structure (default: the scorer's own);
    decode_level: decode-time eviction's (default: `level` if given, else the scorer's own on this
    model, Scorer.level_at_decode); decode_window: the last tokens decoding always keeps (default: the
    scorer's own on this model, Scorer.window_at_decode); decode_redundancy: the gate's λ at decode
    (GateScorer.at_decode; default: GateScorer.make's; 0: none); decode_tokens_per_head: EvictingCache."""
    check_method(method, gates, decode_tokens_per_head, decode_redundancy)
    cfg, weight = model.config, model.model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    kind = METHODS[method]  # gate.py: each method's Scorer class, None for the full cache
    if kind is None:
        return KVCache(cfg, dtype, device)
    # KVzip's teacher scores the whole context after prefill (prefill_kvzip): no scorer in the cache
    scorer = kind.make(cfg, gates, seed) if kind.prefill else None
    if decode_redundancy is not None:
        scorer.redundancy = float(decode_redundancy)
    # the authors run the baselines per head, the gate and KVzip with one global threshold; a
    # level named applies at decode too
    decode_level = decode_level or level or kind.level_at_decode(cfg)
    if decode_window is None:
        decode_window = kind.window_at_decode(cfg)
    return EvictingCache(cfg, scorer, dtype, device, n_protected=n_protected,
                         level=level or kind.level, decode_tokens_per_head=decode_tokens_per_head,
                         decode_window=decode_window, decode_level=decode_level)


def check_method(method, gates, decode_tokens_per_head, decode_redundancy=None):
    """What make_cache needs, else an ArgumentError: a method, the gates fastkvzip scores with, no
    decode-time eviction for KVzip (it scores the prompt only), λ for the gate only (the rest: EvictingCache)."""
    if method not in METHODS:
        raise ArgumentError(f"make_cache: method {method!r} is not one of {tuple(METHODS)}")
    if method == "fastkvzip" and not isinstance(gates, gate.Gates):
        raise ArgumentError(f"make_cache: fastkvzip needs its gates (a gate.Gates: "
                            f"formats.gate_file.resolve_gate), got {type(gates).__name__}")
    if METHODS[method] is not None and not METHODS[method].decode \
            and decode_tokens_per_head is not None:
        raise ArgumentError(f"make_cache: {method} scores the context once: it cannot evict during "
                            "decoding; give decode_tokens_per_head=None")
    lam = decode_redundancy
    if lam is not None and not (method == "fastkvzip" and isinstance(lam, numbers.Real)
                                and not isinstance(lam, bool) and math.isfinite(lam) and lam >= 0):
        raise ArgumentError(f"make_cache: decode_redundancy is fastkvzip's λ, a finite number >= 0 "
                            f"(0: none), or None; got {lam!r} for {method}")


# -------------------------------------------------------------------------------------------------
# the program: python generate.py ... Its steps in order, here; the flags and their checks, the
# requests, saved caches and the printing are the command line's (commands/generate.py), which
# imports no program: this file is loaded once (as __main__) and imports never run back up.

def main(argv=None):
    from commands import generate as command  # the program's edge: its command line

    def run(args):
        job = command.prepare(args)  # flags checked, requests read, the gate and model loaded
        model, seed = job.model, args.seed
        compression = Compression(args.method, job.gates, job.teacher, args.level,
                                  args.decode_tokens_per_head, args.decode_level,
                                  args.decode_window, args.decode_redundancy,
                                  wrap_scorer=job.time_scorer)

        def start(req, i):  # prefilled alone, or loaded from the file it was saved to
            if "cache_file" not in req:
                return prefill_request(model, req, compression, seed)
            load = lambda scorer: command.load_saved(model, req, scorer, job.loaded, i)
            return load_request(model, req, compression, seed, load)

        # each made when decode() admits it, timed for the report by the command line
        requests = (command.started(job, i, lambda: start(req, i))
                    for i, req in enumerate(job.requests))
        if args.save_cache is not None:  # prefill, save, then answer (if asked) from that cache
            requests = [next(requests)]
            command.save(args, job, requests[0])
        events = decode(model, requests, job.batch_size, job.stop_ids, job.stop_ids,
                        args.temperature, args.top_p, job.ends_line, job.batch)
        command.show(args, job, events)

    return command.main(argv, run)


if __name__ == "__main__":
    sys.exit(main())
