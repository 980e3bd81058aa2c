"""
The quality harness of bench.py: how much each method loses against the full cache, and how closely
the gate agrees with its teacher (gate_agreement, also train_gate.py's report); the report of it is
harness/quality_report.py.

METHOD.md §11's query-agnostic setting, scaled to a CPU. Contexts are cut from text the gates never
saw in training (--text): Jane Austen's novels, or held-out prose of their training corpus
(prose_texts), with needles inserted at many depths. The context is compressed before any question
is seen; then every question is answered from the same compressed cache, rolled back after each
answer. Tasks:
    passkey     pass keys hidden at many depths; accuracy = the greedy answer contains the key
    kv          a JSON object of random key-value pairs (SCBench.KV style); accuracy as above
    nll_next    teacher-forced NLL of the document's next tokens (context fidelity)
    nll_repeat  NLL of a passage of the context repeated back (what KVzip's teacher measures)
    agreement   fraction of greedy answers identical, token for token, to the full cache's
relative = score / full-cache score; for NLL, exp(NLL_full - NLL) = ppl_full / ppl, so 1.0 means
lossless and higher is better everywhere. Task "average" = the mean relative over passkey, kv,
nll_next and nll_repeat (those the full cache scores above 0), as the paper's Figure 10 averages
datasets. Intervals (95%): `ci` of relative scores is a percentile bootstrap over contexts
(questions of one context are not independent); `score_ci` is Wilson's for accuracies, the bootstrap
for NLLs.

Why it fits a CPU: a context shorter than one prefill chunk is prefilled in one forward and evicted
once (generate.prefill). So each context is prefilled ONCE into a full cache that also captures
every compressed layer's attention input, q and k; each method scores those (KVzip from one teacher
pass on the same cache), and each (method, level, budget) cache is made by `Replay`ing that forward
through generate.prefill: the same plan, the same evict call, a bit-identical cache
(tests/test_bench.py; for KVzip the same kept positions as generate.prefill_kvzip, whose separate
last-token forward changes keys and values by rounding only). Speed and memory go through the real
path instead (bench.py).
"""
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import generate
from cache import Budget, EvictingCache
from cli import UsageError, write_text
from formats.gate_file import resolve_gate
from gate import METHODS, KVzipScorer
from harness.timing import TokenClock
from prompts import encode_prompt, encode_text, question_ids
from teacher import KVzipTeacher, TeacherCache, agreement, pool_agreement, token_marks

AVERAGED = ("passkey", "kv", "nll_next", "nll_repeat")  # tasks in the Figure-10 style average
TASKS = AVERAGED + ("agreement",)
# owners of the pass keys: names that occur in no Austen novel. A name right before "'s pass key is"
# lets even the 270M base model tell needles apart (with "the pass key of the red/blue room" it
# repeats the last one)
# the repeat probe's first tokens, given as its cue (the rest of --probe-tokens is scored)
CUE_TOKENS = 16
OWNERS = ("Colonel Brandt", "Mrs. Hollis", "Doctor Fenwick", "Lady Marsh", "Captain Orme",
          "Miss Quarles", "Mr. Tresham", "Professor Lindqvist", "Madame Roux", "Father Keane",
          "Judge Albery", "Nurse Pryce")


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- 1. Samples: a context with needles, its questions, and its fidelity probes ------------------

@dataclass
class Question:
    task: str          # "passkey" | "kv" | "continue" (the last only counts for agreement)
    prompt: list       # ids appended after the compressed context
    answer: str  # the string a correct greedy answer contains ("" = no correctness, agreement only)
    max_new: int
    depth: float = -1  # where the needle sits in the context, 0 = start, 1 = end


@dataclass
class Sample:
    ids: list          # system prompt ⊕ context
    n_protected: int   # system-prompt length (never evicted)
    questions: list
    probes: dict       # nll task -> (prompt ids, target ids)
    doc: str           # the document the context was cut from


class SampleMaker:
    """Builds contexts of n tokens from held-out documents (token ids), with needles at chosen
    depths.

    Needles are inserted at sentence ends, so the text around them stays natural. The context ends
    where the document goes on: the document's next tokens are the nll_next target."""

    def __init__(self, tok, fmt, docs, seed, n_passkeys=3, n_pairs=8, n_kv_questions=3, n_probe=64,
                 n_continue=12, n_cue=CUE_TOKENS):
        self.tok, self.fmt, self.docs = tok, fmt, docs  # docs: list of (name, ids)
        self.rng = random.Random(seed)
        self.n_passkeys, self.n_pairs, self.n_kv_questions = n_passkeys, n_pairs, n_kv_questions
        self.n_probe, self.n_continue, self.n_cue = n_probe, n_continue, n_cue
        self.system = encode_prompt(tok, fmt.system)
        self.next_doc = 0

    def enc(self, text):
        return encode_text(self.tok, text)  # every piece alone (METHOD.md §4.1)

    def question(self, text, cue):
        """The question turn (METHOD.md §11's "\\n\\nQ: ..." + postfix), then the start of the
        answer, so that even a base model answers in a checkable form."""
        return question_ids(self.tok, self.fmt, text, cue)

    def sentence_end(self, hay, i):
        for j in range(i, min(len(hay), i + 200)):  # the next sentence end, or i itself
            if self.tok.decode(hay[j - 1:j]).rstrip().endswith((".", "!", "?", '"')):
                return j
        return i

    def make(self, n):
        rng, enc = self.rng, self.enc
        # -- needles: pass keys at stratified depths, one JSON block of key-value pairs --
        needles, questions = [], []
        for i, who in enumerate(rng.sample(OWNERS, self.n_passkeys)):
            depth = (i + rng.random()) / self.n_passkeys  # stratified over depth
            key = "".join(rng.choice("0123456789") for _ in range(5))
            needles.append([depth, enc(f" {who}'s pass key is {key}. Remember it: {who}'s pass "
                                       f"key is {key}.")])
            q = self.question(f"What is {who}'s pass key?", f"{who}'s pass key is")
            questions.append(Question("passkey", q, key, 6, depth))  # "▁" and 5 digits
        pairs = [("".join(rng.choice("0123456789abcdef") for _ in range(8)),
                  "".join(rng.choice("0123456789abcdef") for _ in range(8)))
                 for _ in range(self.n_pairs)]
        block = "\n\nJSON data:\n{" + ", ".join(f'"{k}": "{v}"' for k, v in pairs) + "}\n\n"
        depth = rng.random()
        needles.append([depth, enc(block)])
        for k, v in rng.sample(pairs, self.n_kv_questions):
            # the answer starts as the JSON does, so the model can copy (an English cue: 0 of 9
            # right at full cache)
            q = self.question(f'In the JSON data above, what is the value of the key "{k}"?',
                              f'"{k}": "')
            questions.append(Question("kv", q, v, 9, depth))  # up to 8 hex tokens and '"'
        # -- the hay: a window of the next document that leaves room for needles and the
        # continuation --
        n_hay = n - sum(len(x[1]) for x in needles)
        # the repeat probe's passage (below)
        if n_hay < 1 or int(0.9 * n) - self.n_probe <= int(0.05 * n):
            least = max(n - n_hay + 1, int((self.n_probe + 2) / 0.85) + 1)
            raise UsageError(f"--lengths {n} is too short for its needles ({n - n_hay} "
                             f"tokens) and a {self.n_probe}-token probe; use at least {least}")
        long_enough = [d for d in self.docs if len(d[1]) >= n_hay + self.n_probe]
        if not long_enough:
            raise UsageError(f"--lengths {n}: no document has the {n_hay + self.n_probe} tokens it "
                             f"needs (the longest has {max(len(d[1]) for d in self.docs)}); use "
                             "shorter --lengths")
        name, doc = long_enough[self.next_doc % len(long_enough)]  # a different document each time
        self.next_doc += 1
        off = rng.randrange(0, len(doc) - n_hay - self.n_probe + 1)
        hay, after = doc[off:off + n_hay], doc[off + n_hay:off + n_hay + self.n_probe]
        ctx, last = [], 0
        for depth, ids in sorted(needles, key=lambda x: x[0]):
            at = max(last, self.sentence_end(hay, max(1, int(depth * len(hay)))))
            ctx += hay[last:at] + ids
            last = at
        ctx += hay[last:]
        # -- probes: the document's continuation; a passage of the context repeated back --
        start = rng.randrange(int(0.05 * len(ctx)), int(0.9 * len(ctx)) - self.n_probe)
        passage = ctx[start:start + self.n_probe]
        cue = (enc("\n\nHere is a passage copied word for word from the text above:\n")
               + passage[:self.n_cue])
        probes = {"nll_next": (after[:1], after[1:]), "nll_repeat": (cue, passage[self.n_cue:])}
        if self.n_continue:  # agreement on free continuation of the document
            questions.append(Question("continue", after[:8], "", self.n_continue))
        return Sample(self.system + ctx, len(self.system), questions, probes, name)


TEXTS = ("austen", "prose")  # bench.py --text: the haystack the needles are hidden in
# what each text's documents are called in messages and reports ("held-out ..." there)
TEXT_NAMES = {"austen": "Austen chapters", "prose": "prose texts of the gates' corpus"}
# what each context holds and is asked, by default (bench.py's --passkeys ... --continue-tokens)
NEEDLES = dict(passkeys=3, kv_pairs=8, kv_questions=3, probe_tokens=64, continue_tokens=12)
# held-out prose: the last 45 corpus documents of each source, 3 to a text
PROSE_PER_SOURCE, PROSE_JOIN = 45, 3


def prose_texts():
    """Held-out prose, not Austen: the last PROSE_PER_SOURCE documents of each source of the gates'
    training corpus (Wikipedia leads, State of the Union addresses, the Python library reference;
    offline/fetch_assets.py), consecutive ones of a source joined PROSE_JOIN at a time into texts of
    ~6K-21K tokens, as (name, text). train_gate.py takes documents in file order, and the first of
    these is document 672 of 1,272 (the sources are interleaved there), so a gate trained on fewer
    documents never saw them (the bundled gates' selections end before document 100)."""
    from offline import fetch_assets
    by_source = {}
    for path in fetch_assets.text_docs("corpus"):  # NNNNN-<source>.txt, in file order
        by_source.setdefault(path.stem.split("-", 1)[1], []).append(path)
    texts = []
    for source, paths in sorted(by_source.items()):
        held = paths[-PROSE_PER_SOURCE:]
        for i in range(0, len(held) - PROSE_JOIN + 1, PROSE_JOIN):
            group = held[i:i + PROSE_JOIN]
            texts.append((f"{source} {group[0].stem.split('-')[0]}-{group[-1].stem.split('-')[0]}",
                          "\n\n".join(p.read_text(encoding="utf-8").strip() for p in group)))
    return texts


def load_docs(tok, text="austen", _memo={}):
    """Held-out documents as (name, token ids): "austen", the novels cut at chapters (5K-20K tokens
    each), or "prose" (prose_texts)."""
    from offline import fetch_assets
    if (id(tok), text) not in _memo:
        named = ([(p.stem, p.read_text(encoding="utf-8"))
                  for p in fetch_assets.text_docs("austen_parts")]
                 if text == "austen" else prose_texts())
        _memo[id(tok), text] = [(name, encode_text(tok, t)) for name, t in named]
    return list(_memo[id(tok), text])


# ---- 2. The fast path: one captured full prefill, replayed into every method's evicting cache ----

class CaptureCache(TeacherCache):
    """A full cache (it can also run the KVzip teacher) that keeps, for each compressed layer, the
    attention input, q and k of every forward it sees while `capturing` — all a scorer reads."""

    def __init__(self, cfg, dtype, device):
        super().__init__(cfg, dtype, device)
        self.capturing, self.captured = True, {}

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        if self.capturing and layer in self.index:
            new = (hidden, q, k, self.positions(q.shape[0]))
            old = self.captured.get(layer)  # a context of several prefill chunks: join them
            self.captured[layer] = (new if old is None
                                    else tuple(torch.cat(x) for x in zip(old, new)))
        return super().attend(layer, q, k, v, hidden, scale, window)


class Replay:
    """Stands in for the model inside generate.prefill. Its one forward installs a copy of the
    captured full prefill into the evicting cache (EvictingCache.take_over_prefill: every layer's
    KV, scored by the cache's own scorer from the captured inputs, exactly as attend would have)
    and returns the last logits; generate.prefill then evicts as usual."""

    def __init__(self, full, logits):
        self.full, self.logits = full, logits

    def __call__(self, chunk, cache, num_logits=None):
        assert chunk.shape[0] == self.full.n_seen and cache.n_seen == 0, \
            "Replay covers a prompt prefilled in one chunk (context < --chunk-size)"
        cache.take_over_prefill(self.full, inputs=self.full.captured, keep_full=True)
        return self.logits


def method_cache(model, method, level, n_protected, model_name, gate_file, seed,
                 teacher_scores=None):
    """An empty evicting cache for one method, made by generate.make_cache as `generate.py --method`
    makes it (gate_file None: the bundled or released gate of model_name). KVzip's scores arrive
    after prefill; for the replay they come precomputed."""
    gates = (resolve_gate(gate_file, model.config, model_name, device=model_info(model)[2])
             if method == "fastkvzip" else None)
    cache = generate.make_cache(method, model, n_protected, gates, level=level, seed=seed)
    # only KVzip: every other method keeps its own scorer
    if method == "kvzip" and teacher_scores is not None:
        cache.scorer = KVzipScorer(teacher_scores)
    return cache


def capture_prefill(model, ids, chunk_size, teacher=None, n_protected=0):
    """Prefill ids once into a full CaptureCache -> (cache, last logits, teacher scores (L_g, H, n)
    with +inf on the system prompt, or None). The cache then serves as the full-cache reference."""
    cfg, dtype, device = model_info(model)
    full = CaptureCache(cfg, dtype, device)
    logits = generate.prefill(model, full, ids, n_protected, Budget(1.0, chunk_size))
    full.capturing = False
    scores = None
    if teacher is not None:
        # (L_g, H, n_context); cache unchanged
        s = teacher.score(full, n_protected, ids[n_protected:])
        scores = torch.cat([torch.full(s.shape[:2] + (n_protected,), math.inf), s.cpu()], dim=-1)
    return full, logits, scores


def prefill_from_capture(model, full, logits, cache, method, sample, budget, chunk_size, window):
    """Fill one method's evicting cache with the context, as `generate.py --method` would. A context
    of one prefill chunk replays the captured full prefill (every method's scores are computed from
    the same inputs, then the usual eviction); a longer one runs the real chunked prefill
    (generate.prefill), so the gate scores hidden states computed against an already compressed
    cache. KVzip is not chunked (generate.prefill_kvzip): its teacher scores the full prefill, then
    one eviction, either way."""
    ids, p = sample.ids, sample.n_protected
    if method == "kvzip":  # cache.scorer holds the teacher's precomputed scores (KVzipScorer)
        cache.take_over_prefill(full, inputs=full.captured, keep_full=True)
        generate.evict_once(cache, len(ids), p, Budget(budget, chunk_size, window))
    elif len(ids) <= chunk_size:
        # evicts as the real path
        generate.prefill(Replay(full, logits), cache, ids, p, Budget(budget, chunk_size, window))
    else:
        generate.prefill(model, cache, ids, p, Budget(budget, chunk_size, window))


def captured_scores(model, scorer, full):
    """A scorer's scores of every compressed layer, (L_c, H, T), from a CaptureCache's prefill
    inputs."""
    return torch.stack([scorer.score(l, *full.captured[layer])
                        for l, layer in enumerate(model.config.compressed_layers)])


def gate_agreement(model, tok, full, tscores, sample, model_name, gate_file, chunk_size, window):
    """The gate's (gate_file, or model_name's bundled gate) agreement with its teacher on this
    context (agreement), from the captured full prefill, its scores as the prefill's cut compares
    them (GateScorer.cut_scores: a calibrated gate's offsets); counts, pooled over contexts in the
    report."""
    scorer = method_cache(model, "fastkvzip", "global", sample.n_protected, model_name, gate_file,
                          0).scorer
    p = sample.n_protected
    student = scorer.cut_scores(captured_scores(model, scorer, full).float())
    is_digit, is_identifier = token_marks(tok, sample.ids[p:])
    return agreement(student[..., p:].cpu(), tscores[..., p:].float(), is_digit,
                     chunk_size=chunk_size, window=window, is_identifier=is_identifier)


def model_info(model):
    p = next(model.parameters())
    return model.config, p.dtype, p.device


# ---- 3. Answering from one cache: greedy answers and teacher-forced NLL, each rolled back --------

@torch.no_grad()
def evaluate(model, tok, cache, sample, stop_ids):
    """-> dict: outputs (list of id lists), correct (list of 0/1 or None), nll {task: (sum, n)},
    decode (tokens, seconds)."""
    res = dict(outputs=[], correct=[], nll={}, decode=[0, 0.0])
    for q in sample.questions:
        state = cache.checkpoint()
        clock = TokenClock()  # the steps after the first token, timed as the tokens arrive
        out = generate.answer(model, cache, q.prompt, q.max_new, stop_ids, on_token=clock.token)
        cache.rollback(state)
        text = tok.decode(out) if out else ""
        res["outputs"].append(out)
        res["correct"].append(int(q.answer in text) if q.answer else None)
        res["decode"][0] += clock.steps
        res["decode"][1] += clock.seconds
    for task, (prompt, target) in sample.probes.items():
        state = cache.checkpoint()
        if isinstance(cache, EvictingCache):
            # appended tokens are the query side: never scored, never evicted
            cache.start_decoding()
        logits = model(torch.tensor(prompt + target[:-1], device=cache.device), cache,
                       num_logits=len(target))
        cache.rollback(state)
        nll = torch.nn.functional.cross_entropy(logits.float(),
                                                torch.tensor(target, device=logits.device),
                                                reduction="sum")
        res["nll"][task] = (float(nll), len(target))
    return res


# ---- 4. Scores, relative performance, bootstrap intervals ----------------------------------------

def wilson(k, n, z=1.96):
    """Binomial 95% interval (Wilson): sound even at 0 or n successes."""
    if n == 0:
        return (float("nan"), float("nan"))
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


class Tally:
    """Per-context sums for one (config, task): num/den arrays over contexts, so that the bootstrap
    can resample contexts. accuracy/agreement: num = correct, den = questions; nll: num = NLL sum,
    den = tokens."""

    def __init__(self):
        self.num, self.den = [], []

    def add(self, num, den):
        self.num.append(float(num)), self.den.append(float(den))

    def value(self, idx=None):
        num, den = np.array(self.num), np.array(self.den)
        if idx is None:
            return num.sum() / den.sum() if den.sum() else float("nan")
        with np.errstate(invalid="ignore", divide="ignore"):
            return num[idx].sum(-1) / den[idx].sum(-1)


def relative(task, score, full):
    """Relative performance (higher is better, 1 = lossless): score / full for accuracies,
    exp(full - score) = ppl_full / ppl for NLLs, the agreement itself (the full cache agrees with
    itself)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        if task.startswith("nll"):
            return np.exp(full - score)
        if task == "agreement":
            return score
        return np.where(full > 0, score / np.where(full > 0, full, 1), np.nan)


def ci(samples):
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    return [float(np.percentile(s, 2.5)), float(np.percentile(s, 97.5))] if len(s) else None


def finite_or_none(x):
    x = float(x)
    return x if math.isfinite(x) else None


def summarize(tallies, extras, n_boot, seed, averaged=AVERAGED):
    """tallies[(config, budget)][task] -> Tally; extras[(config, budget)] -> kept fractions, bytes,
    speed. Returns the result rows (one per task, config, budget, plus the "average" task over
    `averaged`)."""
    full, idx = tallies[("full", 1.0)], resamples(tallies, n_boot, seed)
    n_ctx = idx.shape[1]
    rows = []
    for (config, budget), tasks in tallies.items():
        method, _, level = config.partition("/")
        level = level or ("full" if method == "full" else METHODS[method].level)
        for task in TASKS:
            t = tasks[task]
            score, boot = t.value(), t.value(idx)
            f, f_boot = ((1.0, 1.0) if task == "agreement"
                         else (full[task].value(), full[task].value(idx)))
            rel, rb = relative(task, score, f), relative(task, boot, f_boot)
            row = dict(task=task, method=method, level=level, budget=budget,
                       score=finite_or_none(score), relative=finite_or_none(rel), n=int(sum(t.den)),
                       n_contexts=n_ctx, score_ci=ci(boot) if task.startswith("nll")
                       else list(wilson(sum(t.num), sum(t.den))), ci=ci(rb))
            if task.startswith("nll"):
                row["increase"] = finite_or_none(score - f)
            rows.append({**row, **extras[(config, budget)]})
        avg, avg_boot = average_relative(tasks, full, idx, averaged)
        rows.append(dict(task="average", method=method, level=level, budget=budget,
                         score=finite_or_none(avg), relative=finite_or_none(avg), n=n_ctx,
                         n_contexts=n_ctx, score_ci=ci(avg_boot), ci=ci(avg_boot),
                         **extras[(config, budget)]))
    return rows


def resamples(tallies, n_boot, seed):
    """(n_boot, n_contexts) context indices, shared by every configuration: a paired bootstrap."""
    n_ctx = len(tallies[("full", 1.0)]["nll_next"].num)
    return np.random.default_rng(seed).integers(0, n_ctx, size=(n_boot, n_ctx))


def average_relative(tasks, full, idx, averaged=AVERAGED):
    """The Figure-10 average: mean relative over the `averaged` tasks the full cache scores above 0
    -> (point, bootstrap values; NaN resamples are dropped by ci)."""
    point, boot = [], []
    for task in averaged:
        rel = relative(task, tasks[task].value(), full[task].value())
        if np.isfinite(rel):
            point.append(rel), boot.append(relative(task, tasks[task].value(idx),
                                                    full[task].value(idx)))
    if not point:
        return float("nan"), np.full(len(idx), np.nan)
    return float(np.mean(point)), np.mean(boot, axis=0)


# (a, b, what a - b asks): the paper's claim, and the calibrated level against the paper's own
CONTRASTS = (("fastkvzip", "kvzip", "the gate minus its teacher"),
             ("fastkvzip/calibrated", "fastkvzip",
              "calibrated minus the paper's global level (gate)"),
             ("kvzip/calibrated", "kvzip", "calibrated minus the paper's global level (teacher)"))


def contrasts(tallies, n_boot, seed, averaged=AVERAGED):
    """Paired differences of the average relative performance, a - b, per budget, with a 95%
    bootstrap interval over the same resampled contexts: a difference whose interval excludes 0 is
    beyond the noise."""
    full, idx = tallies[("full", 1.0)], resamples(tallies, n_boot, seed)
    out = []
    for a, b, question in CONTRASTS:
        for (config, budget) in tallies:
            if config != a or (b, budget) not in tallies:
                continue
            (pa, ba), (pb, bb) = (average_relative(tallies[(c, budget)], full, idx, averaged)
                                  for c in (a, b))
            out.append(dict(a=a, b=b, question=question, budget=budget,
                            diff=finite_or_none(pa - pb), ci=ci(ba - bb)))
    return out


# ---- 5. The quality run --------------------------------------------------------------------------

def answer_stops(cfg, tok):
    """Token ids that end a greedy answer: end of sequence, or a line break."""
    return set(cfg.eos_token_ids) | {i for s in ("\n", "\n\n") for i in encode_text(tok, s)}


@dataclass
class Experiment:
    """What makes two runs' contexts the same experiment (bench.py's flags of the same names): runs
    are resumed or merged only if these, the model and the gate are equal."""
    methods: list           # "full" first: every relative score needs it
    budgets: list
    extra_levels: list      # levels run beside each method's own, for fastkvzip and kvzip
    lengths: list           # context lengths in tokens
    contexts: int           # contexts per length
    passkeys: int
    kv_pairs: int
    kv_questions: int
    probe_tokens: int
    continue_tokens: int
    chunk_size: int
    window: int
    seed: int
    text: str = "austen"    # TEXTS
    chat: bool | None = None  # None: the model's default prompt format
    device: str = "cpu"     # cpu (fp32) or cuda (bf16): other numbers
    suite: str = "needle"   # needle (this module) or ruler (harness/ruler.py)
    dataset: str | None = None  # ruler: a file in kvpress's dataset layout, read as it is
    ruler_samples: int = 5  # ruler: samples generated per task and length
    ruler_tasks: tuple = ()  # ruler: the tasks generated
    ruler_prompt: str = "kvpress"  # ruler: kvpress's one user turn, or the harness's system prompt
    ruler_sizing: str = "ruler"  # ruler: RULER's sizing (Llama-3.1 tokens) or "model" (its tokens)


def make_samples(tok, fmt, exp):
    """-> (lengths, samples): exp.contexts contexts of each of exp.lengths, with their needles,
    questions and probes. Every sample is made up front, also those a shard skips (each depends on
    the ones before: one RNG), so a length that cannot be made fails now, not hours into the run."""
    docs = load_docs(tok, exp.text)
    random.Random(exp.seed).shuffle(docs)
    maker = SampleMaker(tok, fmt, docs, exp.seed, exp.passkeys, exp.kv_pairs, exp.kv_questions,
                        exp.probe_tokens, exp.continue_tokens)
    lengths = [n for n in exp.lengths for _ in range(exp.contexts)]
    return lengths, [maker.make(n) for n in lengths]


def run(model, tok, fmt, exp, model_name, gate_file, shard=(0, 1), done=(), on_context=None,
        samples=None):
    """Every configuration of `exp` on every context of this shard (k, n): contexts c with c % n ==
    k, but those in `done` (finished by an earlier run: resume). on_context(record) after each
    context, with one dict holding everything the summary needs of that context (its entries: see
    `entry`). samples: make_samples(tok, fmt, exp), when the caller made them first (to refuse
    lengths that cannot be made before any model work)."""
    cfg, _, _ = model_info(model)
    methods = [m for m in exp.methods if m != "full"]
    configs = [(m, METHODS[m].level) for m in methods]
    configs += [(m, lv) for m in methods if m in ("fastkvzip", "kvzip") for lv in exp.extra_levels
                if lv != METHODS[m].level]  # '--extra-levels global' would run the default twice
    teacher = KVzipTeacher(model, tok, fmt) if "kvzip" in methods else None
    stop_ids = answer_stops(cfg, tok)
    lengths, samples = samples or make_samples(tok, fmt, exp)
    k_shard, n_shard = shard
    todo = [c for c in range(len(lengths)) if c % n_shard == k_shard and c not in done]
    n_done, t_start = 0, time.perf_counter()
    for c, (n, sample) in enumerate(zip(lengths, samples)):
        if c not in todo:
            continue
        t0 = time.perf_counter()
        entries = {}
        with torch.no_grad():
            full, logits, tscores = capture_prefill(model, sample.ids, exp.chunk_size, teacher,
                                                    sample.n_protected)
            t_prefill = time.perf_counter() - t0
            log(f"quality context {c + 1}/{len(lengths)}: {n} tokens prefilled"
                f"{' and scored by the teacher' if teacher else ''} in {t_prefill:.0f} s; "
                f"answering from {1 + len(configs) * len(exp.budgets)} caches")
            ref = evaluate(model, tok, full, sample, stop_ids)
            entries[entry_key("full", 1.0)] = entry(sample, ref, ref,
                                                    [1.0] * len(cfg.compressed_layers), full.nbytes)
            for method, level in configs:
                config = method if level == METHODS[method].level else f"{method}/{level}"
                for budget in exp.budgets:
                    cache = method_cache(model, method, level, sample.n_protected, model_name,
                                         gate_file, exp.seed + c, tscores)
                    prefill_from_capture(model, full, logits, cache, method, sample, budget,
                                         exp.chunk_size, exp.window)
                    kept = cache.kept_fraction_per_layer(sample.n_protected, len(sample.ids))
                    # nothing evicted -> the cache is the full cache, row for row: reuse its answers
                    res = ref if min(kept) == 1.0 else evaluate(model, tok, cache, sample, stop_ids)
                    entries[entry_key(config, budget)] = entry(sample, res, ref, kept, cache.nbytes)
                    del cache
            agreement = (gate_agreement(model, tok, full, tscores, sample, model_name, gate_file,
                                        exp.chunk_size, exp.window)
                         if {"fastkvzip", "kvzip"} <= set(methods) else None)
        record = dict(context=c, n_tokens=len(sample.ids), doc=sample.doc,
                      seconds=time.perf_counter() - t0, entries=entries, agreement=agreement,
                      answers=[dict(task=q.task, depth=round(q.depth, 3), expected=q.answer,
                                                     full=tok.decode(o))
                                                for q, o in zip(sample.questions, ref["outputs"])])
        n_done += 1
        left = len(todo) - n_done
        log(f"quality context {c + 1}/{len(lengths)}: done ({sample.doc}) in "
            f"{record['seconds'] / 60:.1f} min; {left} left in this run, eta "
            f"{(time.perf_counter() - t_start) / n_done * left / 60:.0f} min")
        if on_context:
            on_context(record)


def entry_key(config, budget):
    return f"{config}@{budget:g}"


def entry(sample, res, ref, kept, nbytes):
    """One (config, budget) on one context: per task (numerator, denominator) — correct/questions
    for the accuracies and agreement, NLL sum/tokens for the NLLs — plus kept fractions, KV bytes,
    decode time."""
    tally = {}
    for task in ("passkey", "kv"):
        marks = [c for q, c in zip(sample.questions, res["correct"]) if q.task == task]
        tally[task] = [sum(marks), len(marks)]
    for task, (s, n) in res["nll"].items():
        tally[task] = [s, n]
    same = [a == b for a, b in zip(res["outputs"], ref["outputs"])]
    tally["agreement"] = [sum(same), len(same)]
    return dict(tally=tally, kept=kept, nbytes=nbytes, decode=list(res["decode"]))


def accumulate(records):
    """Records (one per context, any order) -> tallies[(config, budget)][task], extras[(config,
    budget)] with contexts in one fixed order for every configuration (the bootstrap pairs them)."""
    tallies, raw = {}, {}
    for rec in sorted(records, key=lambda r: r["context"]):
        for key, e in rec["entries"].items():
            config, budget = key.rsplit("@", 1)
            key = (config, float(budget))
            tasks = tallies.setdefault(key, {t: Tally() for t in TASKS})
            for task in TASKS:
                tasks[task].add(*e["tally"][task])
            r = raw.setdefault(key, dict(kept=[], nbytes=[], decode=[0, 0.0]))
            r["kept"].append(e["kept"]), r["nbytes"].append(e["nbytes"])
            r["decode"] = [r["decode"][0] + e["decode"][0], r["decode"][1] + e["decode"][1]]
    return tallies, finish_extras(raw)


def finish_extras(raw):
    """Means over contexts: kept fraction per compressed layer, KV bytes, decode tokens/s."""
    out = {}
    full_bytes = np.mean(raw[("full", 1.0)]["nbytes"])
    for key, r in raw.items():
        per_layer = [float(x) for x in np.mean(r["kept"], axis=0)]
        out[key] = dict(kept_fraction=float(np.mean(per_layer)), kept_fraction_per_layer=per_layer,
                        kv_bytes=float(np.mean(r["nbytes"])),
                        kv_fraction=float(np.mean(r["nbytes"]) / full_bytes),
                        decode_tok_s=r["decode"][0] / r["decode"][1]
                        if r["decode"][1] > 0 else None)
    return out


def quality_key(exp, config):
    """What makes two runs' contexts the same experiment: they may be resumed or merged only if
    equal."""
    key = dict(asdict(exp), model=config["model"]["sha256"], gate=config["gate"]["sha256"])
    del key["ruler_prompt"]  # how RULER rows are fed: no part of these contexts (ruler.run_key)
    return key


def write_record(folder, key, record):
    """A finished context kept the moment it ends (a killed run loses at most one): what
    load_records reads back."""
    (Path(folder) / "contexts").mkdir(exist_ok=True)
    write_text(Path(folder) / "contexts" / f"context-{record['context']:03d}.json",
               json.dumps({**record, "key": key}))


def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def bad_entries(rec):
    """Why a needle record's entries are not what quality.run writes (what accumulate reads), or
    None."""
    for name, e in rec["entries"].items():
        tally = e.get("tally")
        if not (isinstance(tally, dict) and all(
                isinstance(tally.get(t), list) and len(tally[t]) == 2
                and all(map(number, tally[t])) for t in TASKS)):
            return f"its entry {name!r} has no tally of {', '.join(TASKS)}"
    return None


def load_records(folder, key, n, fix="use a new --out, or the flags of the run that wrote it",
                 bad=None):
    """The finished contexts in folder/contexts/ (each written atomically when its context
    ended) of the experiment `key`, which has n contexts; a record of another experiment, that
    claims a context the experiment lacks, or is damaged (no entries, seconds not a number, or
    bad(record), the suite's own check, says why) is a UsageError naming its file, `fix` what to
    do."""
    records, contexts = {}, Path(folder) / "contexts"
    if contexts.exists() and not contexts.is_dir():
        raise UsageError(f"{contexts} is a file, not the run's folder of finished contexts; move "
                         "it away (or use a new folder)")
    for path in sorted(contexts.glob("context-*.json")):
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        # written atomically by us: damaged by something else (cut short, or a folder put there)
        except (ValueError, RecursionError, OSError):
            raise UsageError(f"{path} is unreadable{' (a folder)' if path.is_dir() else ''}; "
                             "delete it (its context is then run again)") from None
        if not isinstance(rec, dict) or rec.get("key") != key:
            theirs = rec.get("key") if isinstance(rec, dict) else None
            what = (", ".join(k for k in sorted(set(theirs) | set(key))
                              if theirs.get(k) != key.get(k)) + " differ"
                    if isinstance(theirs, dict) else "it names no settings")
            raise UsageError(f"{path} comes from another configuration ({what}); {fix}")
        c = rec.get("context")
        # each context in the file of its number (bench.py's finished())
        if not (type(c) is int and 0 <= c < n and path.name == f"context-{c:03d}.json"):
            claim = "names no context" if c is None else f"claims context {c!r}"
            raise UsageError(f"{path} {claim}, not that file's context of a run of {n} contexts "
                             f"(0-{n - 1}); delete it (its context is then run again)")
        entries = rec.get("entries")
        whole = isinstance(entries, dict) and entries and all(isinstance(e, dict)
                                                              for e in entries.values())
        why = ("its entries are missing or not objects" if not whole else
               "its seconds are not a number" if not number(rec.get("seconds")) else
               bad(rec) if bad else None)
        if why:
            raise UsageError(f"{path} is damaged ({why}); delete it (its context is then run "
                             "again)")
        records[c] = rec
    return records


def quality_results(records, n_boot, seed, averaged=AVERAGED):
    """The quality part of results.json, from the finished contexts' records (any order); intervals
    from n_boot bootstrap resamples, the relative average over the tasks in `averaged`."""
    tallies, extras = accumulate(records)
    # the tasks the average is over, as its title names them: those asked (--passkeys 0 asks none)
    # and scored above 0 by the full cache (average_relative leaves the others out)
    full = tallies[("full", 1.0)]
    averaged = [t for t in averaged if np.isfinite(relative(t, full[t].value(), full[t].value()))]
    out = dict(rows=summarize(tallies, extras, n_boot, seed, averaged), averaged=averaged,
               n_contexts=len(records), contrasts=contrasts(tallies, n_boot, seed, averaged),
               answers=[dict(doc=r["doc"], n_tokens=r["n_tokens"], questions=r["answers"])
                        for r in sorted(records, key=lambda r: r["context"])])
    agreements = [r["agreement"] for r in records if r.get("agreement")]
    if agreements:  # runs with both fastkvzip and kvzip
        out["agreement"] = pool_agreement(agreements)
    return out


def label(r):
    """A configuration's name in the reports: the method, with its level when not its own."""
    own = METHODS[r["method"]].level if METHODS.get(r["method"]) else "full"  # the scorer's level
    return (r["method"] if r["level"] in ("full", own)
            else f"{r['method']} ({r['level']})")
