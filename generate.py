"""
Generate with a compressed KV cache: the method's path from a prompt to its answers.

The context is prefilled in chunks; after every chunk the tokens that left the local window are
scored and the least important KV pairs are evicted (METHOD.md §6). Questions are then answered one
by one from the same compressed cache, each rolled back afterwards (METHOD.md §11's query-agnostic
setting). Many requests decode together: each is prefilled alone, then their rows join one ragged
cache (cache.Batch), one forward of one token each per step.

Read first: prefill, then decode. `python generate.py ...` keeps its command line (flags, requests,
batch files, saved caches, printing) in commands/generate.py.
"""
import sys
import time
from dataclasses import dataclass, field

import torch

import gate
from cache import Batch, Budget, EvictingCache, KVCache, check_ids, is_count
from gate import METHODS
from kernels import ArgumentError
from model import ModelError

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
    check_prompt(cache, ids, n_protected, budget)
    cache.prefilled_ids = torch.tensor(list(ids), dtype=torch.long)
    n_context = len(ids) - n_protected
    evicting = isinstance(cache, EvictingCache) and n_context > 0
    plan = budget.plan(n_context) if evicting else None
    start = n_protected  # first position not evaluated yet
    for i in range(0, len(ids), budget.chunk_size):
        chunk = torch.tensor(ids[i:i + budget.chunk_size], device=cache.device)
        logits = model(chunk, cache, num_logits=1)[-1]
        if evicting:  # evict what just left the window: the explicit step of the method
            end = cache.n_seen - plan.window  # tokens older than the window are evaluated now
            if end > start:
                cache.evict(start, end, plan.segment_ratio)
                start = end
    return logits


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
    return last


def check_prompt(cache, ids, n_protected, budget=Budget()):
    """What a prefill needs, else an ArgumentError (library misuse fails here, not deep inside): an
    empty cache, token ids of its model, a system prompt within them, the one the cache protects,
    a Budget."""
    if not isinstance(budget, Budget):
        raise ArgumentError(f"prefill: budget must be a cache.Budget, e.g. Budget(0.3), got "
                            f"{budget!r}")
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
    logits = model(torch.tensor([token], device=cache.device), cache)[-1]
    if isinstance(cache, EvictingCache):
        cache.after_step()  # every 128 tokens: gate the buffer, evict to --decode-tokens-per-head
    return logits


def decode_batch(model, batch, tokens):
    """One forward, a token for each member of a cache.Batch in join order -> logits (B, vocab)."""
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
        return last_logits
    return model(torch.tensor(question_ids, device=cache.device), cache, num_logits=1)[-1]


# -------------------------------------------------------------------------------------------------
# requests: one setup (cache + prefill), one decode loop for a lone request and for a batch

@dataclass
class Method:
    """What scores and evicts the KV pairs of every request of a run (make_cache)."""
    name: str = "fastkvzip"  # one of gate.METHODS
    gates: object = None  # fastkvzip: the gate.Gates (formats.gate_file.resolve_gate loads them)
    teacher: object = None  # kvzip: the teacher.KVzipTeacher that scores the context
    level: str = None  # eviction structure (cache.LEVELS); None: the scorer's own
    decode_tokens_per_head: int = None  # decode-time eviction (EvictingCache); None: keep all
    # scorer -> the scorer to use: how a caller measures it from outside the method (the command
    # line's gate_seconds: harness/timing.py); None: the scorer as made
    wrap_scorer: object = None


@dataclass(eq=False)
class Request:
    """One request while it is answered, its whole state declared here: the cache it prefilled
    alone, the question being answered and its answer so far, the answers given, the time spent."""
    cache: object
    questions: list  # [(text, ids)]; text "" continues the context, until the plain stop ids
    max_new_tokens: int
    logits: torch.Tensor  # the next token is sampled from these; at first the prefill's last logits
    generator: torch.Generator = None  # sampling: seeded per request, as a run of it alone
    rollback: bool = True  # roll the cache back after each answer (answer() leaves it in)
    index: int = 0  # in the list of requests
    ids: list = ()  # system prompt ⊕ context
    n_protected: int = 0
    method: str = "full"
    budget: float = 1.0
    prefill_s: float = 0.0
    kv_bytes: int = 0  # held after prefill
    peak_kv_bytes: int = 0
    q: int = -1  # the question being answered
    out: list = None  # its answer so far; None between answers
    state: dict = None  # the cache's checkpoint from before the question
    answers: list = field(default_factory=list)  # [{"question", "output_ids"}]
    decode_s: float = 0.0  # the decode steps this request took part in
    n_decoded: int = 0
    n_steps: int = 0  # decode forwards that gave it a token (an answer's first is its question's)

    def begin(self, model):
        """Start question self.q alone: checkpoint, then the question's forward."""
        if self.rollback:
            self.state = self.cache.checkpoint()
        self.logits = begin_answer(model, self.cache, self.questions[self.q][1], self.logits,
                                   self.max_new_tokens)
        self.out = []

    def sample(self, temperature, top_p):
        if not torch.isfinite(self.logits).all():  # argmax of NaN is token 0: never answer that
            dtype = self.cache.dtype  # a wider dtype is advice only where one exists
            wider = {torch.float16: "; its range may be too small: try --dtype bfloat16 or "
                     "float32", torch.bfloat16: "; try --dtype float32"}.get(dtype, "")
            raise ModelError(f"the model's logits are inf/NaN after {len(self.out)} generated "
                             f"tokens, computed in {dtype}{wider}")
        return sample(self.logits, temperature, top_p, self.generator)


def setup(model, req, method=Method(), seed=0, index=0):
    """A request made ready to answer, from plain values: req {"ids": system prompt ⊕ context ids,
    "n_protected": system prompt length, "questions": [(text, ids)], "budget": a cache.Budget,
    "max_new_tokens"} -> a Request whose cache for `method` is prefilled alone. Budget 1.0 without
    decode-time eviction keeps every pair: the full cache, no scorer (and no gate) needed."""
    ids, n_protected, budget = req["ids"], req["n_protected"], req["budget"]
    keeps_all = budget.ratio == 1.0 and method.decode_tokens_per_head is None
    name = "full" if keeps_all else method.name
    if name == "kvzip" and method.teacher is None:
        raise ArgumentError("setup: kvzip needs its teacher (Method(teacher=KVzipTeacher(...)))")
    cache = make_cache(name, model, n_protected, level=method.level,
                       decode_tokens_per_head=method.decode_tokens_per_head, seed=seed,
                       gates=method.gates)
    if method.wrap_scorer is not None and getattr(cache, "scorer", None) is not None:
        cache.scorer = method.wrap_scorer(cache.scorer)
    t0 = time.perf_counter()
    if name == "kvzip":
        logits = prefill_kvzip(model, method.teacher, cache, ids, n_protected, budget)
    else:
        logits = prefill(model, cache, ids, n_protected, budget)
    return Request(cache, req["questions"], req["max_new_tokens"], logits,
                   torch.Generator().manual_seed(seed), index=index, ids=ids,
                   n_protected=n_protected, method=name, budget=budget.ratio,
                   prefill_s=time.perf_counter() - t0, kv_bytes=cache.nbytes,
                   peak_kv_bytes=cache.peak_nbytes)


def resume(model, req, method, seed, index, load):
    """setup() for a request whose cache was saved: load(scorer) -> (cache, info) reads it
    (formats.cache_file.load_cache, through the command line). The file decides what its prefill
    did (method, budget, decode-time eviction); `method` only lends the scorer that goes on
    evicting while decoding (the same gate; the file checks it is the scorer it had)."""
    state, scorer = req["cache_state"], None
    if state.get("decode_tokens_per_head") is not None:
        scorer = make_cache(state["method"], model, state["n_protected"],
                            decode_tokens_per_head=state["decode_tokens_per_head"], seed=seed,
                            gates=method.gates).scorer
        scorer = method.wrap_scorer(scorer) if method.wrap_scorer else scorer
    cache, info = load(scorer)
    return Request(cache, req["questions"], req["max_new_tokens"], info["last_logits"],
                   torch.Generator().manual_seed(seed), index=index, ids=info["ids"],
                   n_protected=info["n_protected"], method=info["method"] or "full",
                   budget=info["budget"] or 1.0, prefill_s=None, kv_bytes=cache.nbytes,
                   peak_kv_bytes=cache.peak_nbytes)


def generate_batch(model, requests, method=Method(), batch_size=1, stop_ids=(),
                   answer_stop_ids=None, temperature=0.0, top_p=1.0, seed=0, ends_line=None):
    """Answer requests (setup's dicts), at most batch_size decoding at once: each is prefilled when
    it is admitted, then decode() answers it; yields decode's events."""
    reqs = (setup(model, req, method, seed, i) for i, req in enumerate(requests))
    return decode(model, reqs, batch_size, stop_ids, answer_stop_ids, temperature, top_p,
                  ends_line)


@torch.no_grad()
def decode(model, requests, batch_size=1, stop_ids=(), answer_stop_ids=None, temperature=0.0,
           top_p=1.0, ends_line=None):
    """The decode loop, for one request or many: each Request's questions are answered in turn from
    its cache, each rolled back afterwards (METHOD.md §11); at most batch_size requests (taken from
    the iterator `requests` as slots free) answer at once, their rows in one cache.Batch, one
    forward of one token each per step (batch_size 1: on the request's own cache). A request whose
    answer ends leaves the batch, starts its next question alone and rejoins. Greedy answers are
    the ones each request gets alone (tests/test_batch.py). Yields (event, request): "question"
    (request.q starts), "token" (request.out[-1]), "answer" (request.answers[-1], before the
    rollback), "done" (its cache still readable). answer_stop_ids (default stop_ids) end an
    answer to a question; stop_ids end a continuation of the context (question text "").
    ends_line(answer so far, token) -> bool, for a base model's one-line answers (one_line): also
    ends an answer to a question."""
    emb = model.model.embed_tokens.weight
    batch = Batch(model.config, emb.dtype, emb.device) if batch_size > 1 else None
    stops = set(stop_ids)
    answer_stops = stops if answer_stop_ids is None else set(answer_stop_ids)
    requests, active, starting = iter(requests), [], []
    while True:
        while len(active) + len(starting) < batch_size and (r := next(requests, None)) is not None:
            starting.append(r)
        if not active and not starting:
            return
        for r in starting:  # those between questions: their next one, alone, then into the batch
            while True:
                if r.out is not None:  # the answer that just ended
                    r.answers.append({"question": r.questions[r.q][0], "output_ids": r.out})
                    r.n_decoded += len(r.out)
                    yield "answer", r
                    if r.rollback:
                        r.cache.rollback(r.state)
                    r.out = None
                if r.q + 1 == len(r.questions):
                    yield "done", r
                    r.cache = None  # its memory is free before the next request is prefilled
                    break
                r.q += 1
                yield "question", r
                r.begin(model)
                if r.max_new_tokens > 0:  # else an empty answer, as asked
                    if batch:
                        batch.join(r.cache)
                    active.append(r)
                    break
        # every answering request samples its next token; those that stop leave the batch
        t0, stepped, starting, tokens = time.perf_counter(), list(active), [], []
        for r in stepped:
            token = r.sample(temperature, top_p)
            asked = bool(r.questions[r.q][0])
            stop = token in (answer_stops if asked else stops) or (
                asked and ends_line is not None and ends_line(r.out, token))
            if not stop:
                r.out.append(token)
                yield "token", r
            if stop or len(r.out) == r.max_new_tokens:
                if batch:
                    batch.leave(r.cache)
                active.remove(r)
                starting.append(r)
            else:
                tokens.append(token)
        if tokens:  # one forward for every request still answering: one token each
            logits = (decode_batch(model, batch, tokens) if batch else  # (B, vocab)
                      decode_one(model, active[0].cache, tokens[0])[None])
            for r, row in zip(active, logits):
                r.logits = row
        secs = time.perf_counter() - t0
        for r in active:  # those a decode forward ran for (the others only sampled a last token)
            r.decode_s, r.n_steps = r.decode_s + secs, r.n_steps + 1


def answer(model, cache, question_ids, max_new_tokens, stop_ids, temperature=0.0, top_p=1.0,
           generator=None, on_token=None, last_logits=None):
    """Append the question to a cache and generate until a stop id (decode() for one question, the
    answer left in the cache); returns (output ids, decode seconds). With no question ids,
    generation continues the prefill (whose last logits are last_logits)."""
    check_answer(cache, question_ids, max_new_tokens, last_logits)
    r = Request(cache, [("", question_ids)], max_new_tokens, last_logits, generator, rollback=False)
    for event, _ in decode(model, [r], 1, stop_ids, temperature=temperature, top_p=top_p):
        if event == "token" and on_token:
            on_token(r.out[-1])
    return r.answers[0]["output_ids"], r.decode_s


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


# -------------------------------------------------------------------------------------------------
# wiring: model, cache, scorer

def make_cache(method, model, n_protected, gates=None, level=None, decode_tokens_per_head=None,
               seed=0):
    """An empty cache for `method` in model's dtype and device. fastkvzip: scored by `gates` (a
    gate.Gates: formats.gate_file.resolve_gate loads the bundled, a released or a given gate);
    random: scores seeded by seed; level: the eviction structure (default: the scorer's own);
    decode_tokens_per_head: see EvictingCache."""
    check_method(method, gates, decode_tokens_per_head)
    cfg, weight = model.config, model.model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    if method == "full":
        return KVCache(cfg, dtype, device)
    H = cfg.num_key_value_heads
    if method == "fastkvzip":
        scorer = gate.GateScorer(gates)
    elif method == "streaming":
        scorer = gate.StreamingScorer(n_kv_heads=H)
    elif method == "snapkv":
        scorer = gate.SnapKVScorer(scale=cfg.attn_scale)
    elif method == "rkv":
        scorer = gate.RKVScorer(scale=cfg.attn_scale)
    elif method == "random":
        scorer = gate.RandomScorer(seed, n_kv_heads=H)
    elif method == "kvzip":
        scorer = None  # the teacher scores the whole context after prefill (prefill_kvzip)
    # the authors run the baselines per head, the gate and KVzip with one global threshold
    level = level or (scorer.level if scorer else "global")
    return EvictingCache(cfg, scorer, dtype, device, n_protected=n_protected, level=level,
                         decode_tokens_per_head=decode_tokens_per_head)


def check_method(method, gates, decode_tokens_per_head):
    """What make_cache needs, else an ArgumentError: a method, the gates fastkvzip scores with, no
    decode-time eviction for KVzip, which scores the prompt only (the rest: EvictingCache)."""
    if method not in METHODS:
        raise ArgumentError(f"make_cache: method {method!r} is not one of {METHODS}")
    if method == "fastkvzip" and not isinstance(gates, gate.Gates):
        raise ArgumentError(f"make_cache: fastkvzip needs its gates (a gate.Gates: "
                            f"formats.gate_file.resolve_gate), got {type(gates).__name__}")
    if method == "kvzip" and decode_tokens_per_head is not None:
        raise ArgumentError("make_cache: kvzip scores the context once: it cannot evict during "
                            "decoding; give decode_tokens_per_head=None")


# -------------------------------------------------------------------------------------------------
# the program: python generate.py ... Its steps in order, here; the flags and their checks, the
# requests, saved caches and the printing are the command line's (commands/generate.py), which
# imports no program: this file is loaded once (as __main__) and imports never run back up.

def main(argv=None):
    from commands import generate as command  # the program's edge: its command line

    def run(args):
        job = command.prepare(args)  # flags checked, requests read, the gate and model loaded
        model, seed, files = job.model, args.seed, {}  # files: where saved caches came from
        method = Method(args.method, job.gates, job.teacher, args.level,
                        args.decode_tokens_per_head, job.time_scorer)

        def start(req, i):  # prefilled alone, or loaded from the file it was saved to
            if "cache_file" not in req:
                return setup(model, req, method, seed, i)
            load = lambda scorer: command.load_saved(model, req, scorer, files, i)
            return resume(model, req, method, seed, i, load)

        if args.save_cache is not None:  # prefill, save, then answer (if asked) from that cache
            requests = [setup(model, job.requests[0], method, seed)]
            files[0] = command.save(args, job, requests[0])
        else:  # each made when decode() admits it
            requests = (start(req, i) for i, req in enumerate(job.requests))
        events = decode(model, requests, job.batch_size, job.stop_ids, job.stop_ids,
                        args.temperature, args.top_p, job.ends_line)
        command.show(args, job, events, files)

    return command.main(argv, run)


if __name__ == "__main__":
    sys.exit(main())
