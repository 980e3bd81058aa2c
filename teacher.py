r"""
The KVzip teacher: how important each context KV pair is, judged by the model itself (METHOD.md §4).
KVzip asks the model to repeat the context and reads, for every context KV pair, the largest
attention probability any query of that repetition gives it. Pairs the model needs to reproduce its
context score high; the gates (gate.py) are trained to predict these scores from one hidden state.
It is also a scorer at inference (`generate.py --method kvzip`), at ~2x a prefill.

    1. prefill system prompt ⊕ context with a full cache (chunks of 16,000 tokens, none evicted)
    2. cut the context into chunks of 2,000 tokens; for chunk i run the repeat input
           (i = 0)  "\n\nRepeat the previous context exactly." ⊕ postfix ⊕ chunk_0
           (i > 0)  "\n\nRepeat the part of the previous context exactly, starting with "
                        ⊕ last 8 tokens of chunk_{i-1} ⊕ postfix ⊕ chunk_i
       on top of the full cache. In each compressed layer its queries (all of them: instruction,
       template and copied chunk) attend over keys [system prompt ; chunk i ; the repeat input
       itself] with logits q·k/√d_h and a causal mask inside the repeat; the softmax probabilities
       of the chunk's keys, maximised over the G query heads of each KV head and over all repeat
       queries, are chunk i's scores (H, chunk). Other chunks are not in that softmax.
    3. roll the cache back: the repeat tokens never stay.

Output: (compressed layers, KV heads, context length) in [0, 1]. Memory beyond the model's own
forward: one chunk's score matrix (Hq, repeat length, system + chunk + repeat length), never the
whole context's. Compressed layers: all for Qwen3, only the global ones for Gemma3 (METHOD.md §9).

Softmax dtype: fp32 by default. The authors compute the logits and the softmax in the model dtype
(bf16, METHOD.md §4.3, §12.10), whose rounding errors the max over a chunk's queries picks when
they went up (METHOD.md §13.5). In fp32 the targets depend only on the model, not on the device
(CPU fp32 and GPU bf16 runs agree up to the model's own rounding), at the cost of one fp32 (Hq, 2K,
4K) matrix per layer, small next to the forward pass. softmax_dtype="model" reproduces the authors.

Cost: one prefill plus one forward of (context + ~1.1% prompt tokens) on top of the full cache, i.e.
about two prefills (the cost Fast KVzip's gate removes at inference).

Also here, the agreement with this teacher (spearman, kept_by_rule, top_at_counts, agreement,
pool_agreement, token_marks): how closely a scorer (the gate) ranks and keeps one context's KV pairs
as it does, per layer and head, at the cache's cut and at the teacher's own counts; and the
calibration of a trained gate's heads to the shares this teacher's cut gives them (calibrate_heads).
"""
import math
import re

import torch

from cache import Budget, KVCache, select_segment
from prompts import encode_prompt

REPEAT_FIRST = "\n\nRepeat the previous context exactly."  # METHOD.md §4.2
# ends with a space: the previous chunk's last tokens follow
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with "
PREV_TOKENS = 8         # the next repeat starts from the previous chunk's last 8 tokens
SCORE_CHUNK = 2000      # context tokens scored per repeat input (METHOD.md §4.2)
PREFILL_CHUNK = 16000   # prefill chunk of the authors' pipeline (METHOD.md §4.3, §6)


class TeacherCache(KVCache):
    """A full KV cache that, in compressed layers, can also
    - keep the attention-input hidden states of tokens at positions >= capture_from (gate features,
      METHOD.md §1.7, §3), moved to the CPU as they come (an 8B model's long document fills tens
      of GB, METHOD.md §5.5);
    - score a context chunk while a repeat input runs (span = (n_system, chunk start, chunk end)).
    """

    def __init__(self, cfg, dtype=torch.float32, device="cpu", softmax_dtype=torch.float32):
        super().__init__(cfg, dtype, device)
        # model layer -> row of the output
        self.index = {layer: li for li, layer in enumerate(cfg.compressed_layers)}
        self.softmax_dtype = softmax_dtype  # None = the cache (model) dtype, as the authors
        self.capture_from = None
        self.captured = [[] for _ in self.index]
        self.span = None
        self.scores = [[] for _ in self.index]

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        # the model's own attention, unchanged
        out = super().attend(layer, q, k, v, hidden, scale, window)
        li = self.index.get(layer)
        if li is None:
            return out
        if self.capture_from is not None:
            first = max(0, self.capture_from - self.n_seen)  # skip the system prompt's tokens
            if first < hidden.shape[0]:
                self.captured[li].append(hidden[first:].to("cpu", copy=True))
        if self.span is not None:
            self.scores[li].append(self.kvzip_scores(layer, q))
        return out

    def kvzip_scores(self, layer, q):
        """Scores (H, chunk) of the context chunk self.span for the repeat queries q (T, Hq, d) that
        were just appended (METHOD.md §4.3,
        Janghyun1230/FastKVzip:prefill/attention/score.py:KVScore._get_score)."""
        n_sys, start, end = self.span
        kv = self.layers[layer]
        T, n_q_heads, d = q.shape
        H = kv.n_heads
        G = n_q_heads // H
        n_rows = self.n_seen + T  # a full cache: every head holds positions 0 .. n_rows-1, in order
        assert bool((kv.lens == n_rows).all()), "KVzip scoring needs the full, unevicted cache"
        pos = torch.cat([torch.arange(n_sys), torch.arange(start, end),
                         torch.arange(n_rows - T, n_rows)])
        rows = (kv.starts[:, None] + pos[None, :]).to(kv.k.device)                # (H, K)
        dtype = self.softmax_dtype or kv.k.dtype
        keys = kv.k[rows].to(dtype)                                              # (H, K, d)
        qh = q.to(dtype).view(T, H, G, d).permute(1, 2, 0, 3)                    # (H, G, T, d)
        logits = qh @ keys[:, None].transpose(-1, -2) / math.sqrt(d)             # (H, G, T, K)
        # 1/sqrt(d_h) even for Gemma3 (whose attention uses query_pre_attn_scalar): METHOD.md §4.3
        # repeat query i sees repeat key j <= i
        causal = torch.ones(T, T, dtype=torch.bool, device=logits.device).tril()
        logits[..., -T:].masked_fill_(~causal, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # in `dtype` (not forced to fp32)
        c = end - start
        # (H, c): max over group and queries
        return probs[..., n_sys:n_sys + c].amax(dim=(1, 2)).float()


class KVzipTeacher:
    """KVzip scores (and optionally gate features) for one context.

    model: model.Transformer; tokenizer: tokenizers.Tokenizer; fmt: prompts.PromptFormat (system,
    postfix). softmax_dtype: "float32" or "model" (the authors compute logits and softmax in
    bf16)."""

    def __init__(self, model, tokenizer, fmt, chunk_size=SCORE_CHUNK, prefill_chunk=PREFILL_CHUNK,
                 softmax_dtype="float32"):
        self.model, self.tokenizer = model, tokenizer
        self.cfg = model.config
        # every piece alone (METHOD.md §4.1); only the template's control tokens make control ids
        self.system = encode_prompt(tokenizer, fmt.system)
        self.postfix = encode_prompt(tokenizer, fmt.postfix)
        self.chunk_size, self.prefill_chunk = chunk_size, prefill_chunk
        self.softmax_dtype = torch.float32 if softmax_dtype == "float32" else None

    def repeat_inputs(self, ctx):
        """[(start, end, repeat ids)] for the context chunks (METHOD.md §4.2,
        Janghyun1230/FastKVzip:prefill/model/wrapper.py:self_task)."""
        out = []
        for start in range(0, len(ctx), self.chunk_size):
            end = min(start + self.chunk_size, len(ctx))
            if start == 0:
                prompt = encode_prompt(self.tokenizer, REPEAT_FIRST)
            else:
                prev = list(ctx[max(0, start - PREV_TOKENS):start])
                prompt = encode_prompt(self.tokenizer, REPEAT_NEXT) + prev
            out.append((start, end, prompt + self.postfix + list(ctx[start:end])))
        return out

    def new_cache(self):
        w = self.model.model.embed_tokens.weight  # the model's dtype and device
        return TeacherCache(self.cfg, w.dtype, w.device, self.softmax_dtype)

    def prefill(self, cache, ids, on_chunk=None):
        """Feed ids in prefill_chunk pieces into a full cache."""
        for i in range(0, len(ids), self.prefill_chunk):
            piece = torch.tensor(ids[i:i + self.prefill_chunk], device=cache.device)
            self.model(piece, cache, num_logits=0)  # no logits needed
            if on_chunk:
                on_chunk(len(piece))

    def score(self, cache, n_system, ctx, on_chunk=None):
        """Scores (L_g, H, len(ctx)) float32 of a context already prefilled after n_system
        system-prompt tokens in `cache` (a TeacherCache holding exactly system ⊕ context). The cache
        is unchanged."""
        assert cache.n_seen == n_system + len(ctx), ("the cache must hold exactly system "
                                                     "prompt + context")
        cache.scores = [[] for _ in cache.index]
        for start, end, ids in self.repeat_inputs(ctx):
            state = cache.checkpoint()
            cache.span = (n_system, n_system + start, n_system + end)
            self.model(torch.tensor(ids, device=cache.device), cache, num_logits=0)
            cache.span = None
            cache.rollback(state)  # the repeat tokens never stay (sliding layers restored too)
            if on_chunk:
                on_chunk(end - start)
        scores = torch.stack([torch.cat(s, dim=-1) for s in cache.scores])  # (L_g, H, n)
        cache.scores = [[] for _ in cache.index]
        return scores

    def __call__(self, ctx, capture_hidden=False, on_chunk=None):
        """-> scores (L_g, H, n) float32 in [0, 1], and hidden (L_g, n, D) in the model dtype on the
        CPU (the attention inputs of the context tokens) when capture_hidden, else None.
        on_chunk(n) is called after each scored chunk of n context tokens (progress bars)."""
        cache = self.new_cache()
        if capture_hidden:
            cache.capture_from = len(self.system)
        self.prefill(cache, self.system + list(ctx))
        cache.capture_from = None
        hidden = torch.stack([torch.cat(h) for h in cache.captured]) if capture_hidden else None
        cache.captured = [[] for _ in cache.index]
        return self.score(cache, len(self.system), ctx, on_chunk), hidden


# ---- Agreement: how closely a scorer (the gate) ranks one context's KV pairs as its teacher does

AGREEMENT_BUDGETS = (0.5, 0.3, 0.2, 0.1)
MARKS = ("digits", "identifiers")  # the kinds of tokens whose kept share is counted (token_marks)


def kept_by_rule(scores, ratio, chunk_size=16384, window=4096, level="global"):
    """(L, H, n) context scores -> (keep mask (L, H, n), window length): what EvictingCache keeps of
    a context prefilled in one chunk (METHOD.md §6): the last `window` tokens (2% of n for a context
    shorter than a chunk) in every head, and of the rest exactly ⌊r'·L·H·s⌋ pairs, r' chosen so that
    a fraction `ratio` of the context is kept in all."""
    L, H, n = scores.shape
    plan = Budget(ratio, chunk_size, window).plan(n)
    keep = torch.ones(L, H, n, dtype=torch.bool, device=scores.device)
    # the window: no layer goes empty
    others = torch.full((L,), plan.window * H, device=scores.device)
    keep[..., :n - plan.window] = select_segment(scores[..., :n - plan.window], plan.segment_ratio,
                                                 level, others)
    return keep, plan.window


def top_at_counts(scores, counts):
    """(L, H, s) scores, (L, H) counts -> mask of each head's counts[l, h] highest scores (ties: the
    earlier position first)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    places = torch.arange(scores.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, places)  # 0 = the head's highest
    return rank < counts[..., None]


def spearman(a, b):
    """Rank correlation of two 1-D tensors (ordinal ranks: ties, which almost never occur in float
    scores, are broken by position)."""
    ra = torch.empty_like(a, dtype=torch.float64)
    rb = torch.empty_like(b, dtype=torch.float64)
    ra[a.argsort(stable=True)] = torch.arange(len(a), dtype=torch.float64, device=a.device)
    rb[b.argsort(stable=True)] = torch.arange(len(b), dtype=torch.float64, device=b.device)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-300))


def agreement(student, teacher, is_digit, budgets=AGREEMENT_BUDGETS, chunk_size=16384, window=4096,
              is_identifier=None):
    """Counts of how a student's scores (L, H, n) keep one context's pairs as its teacher's do, so
    that callers can pool contexts (`pool_agreement`); is_digit, is_identifier: (n,) bool
    (token_marks; is_identifier None: none counted). Per compressed layer:
      spearman   rank correlation over the layer's H·n pairs;
    and at each budget r (keyed f"{r:g}", JSON-ready), counted outside the local window that both
    keep (the segment), per layer (lists of L):
      teacher, student  the pairs each side keeps by the cache's rule (kept_by_rule: one cut over
                        all layers and heads); both: of the teacher's, the ones the student keeps;
      topk_both         of the teacher's, the ones among the student's top-k of the head, k = the
                        teacher's count there (top_at_counts): the ranking inside each head,
                        whatever shares the two cuts give the heads and layers;
      segment           pairs in the segment;
      digits, identifiers (MARKS) the marked tokens' pairs there, and <mark>_teacher,
                        <mark>_student, <mark>_topk the ones each of the three kept sets keeps;
      heads             teacher, student, both, topk_both and segment per head (L × H lists)."""
    out = dict(spearman=[spearman(s.flatten().double(), t.flatten().double())
                         for s, t in zip(student, teacher)])
    n = student.shape[-1]
    none = torch.zeros(n, dtype=torch.bool)
    marks = dict(digits=is_digit, identifiers=none if is_identifier is None else is_identifier)
    for r in budgets:
        ks, w = kept_by_rule(student, r, chunk_size, window)
        kt, _ = kept_by_rule(teacher, r, chunk_size, window)
        ks, kt = ks[..., :n - w], kt[..., :n - w]  # the segment
        kk = top_at_counts(student[..., :n - w], kt.sum(-1))
        heads = dict(teacher=kt, student=ks, both=kt & ks, topk_both=kt & kk,
                     segment=torch.ones_like(kt))
        heads = {k: v.sum(-1) for k, v in heads.items()}  # (L, H)
        counts = {k: v.sum(-1).tolist() for k, v in heads.items()}
        for name, mark in marks.items():
            m = mark[:n - w].to(kt.device)
            counts.update({name: [int(m.sum()) * kt.shape[1]] * kt.shape[0],
                           **{f"{name}_{side}": (kept & m).flatten(1).sum(1).tolist()
                              for side, kept in (("teacher", kt), ("student", ks), ("topk", kk))}})
        out[f"{r:g}"] = dict(counts, heads={k: v.tolist() for k, v in heads.items()})
    return out


# the shares pool_agreement reports: name -> (numerator, denominator), agreement()'s counts
SHARES = dict(overlap=("both", "teacher"), chance=("student", "segment"),
              kept_teacher=("teacher", "segment"), topk_overlap=("topk_both", "teacher"),
              **{f"{m}_{side}": (f"{m}_{side}", m) for m in MARKS
                 for side in ("student", "teacher", "topk")})


def pool_agreement(per_context, budgets=AGREEMENT_BUDGETS):
    """Pool agreement() over contexts by summing their counts (a ratio of sums, never a mean of
    ratios; Spearman: the mean over contexts). Per layer (lists of L), None where a denominator is
    zero; at each budget r (keys "<name>@r"):
      overlap       of the teacher's kept pairs, the share the student keeps too, both by the
                    cache's rule (chance level: the student's kept share, chance);
      chance, kept_teacher  the share of the layer's segment each side keeps by the rule;
      share_error   chance − kept_teacher: how far the student's cut moves the layer's share;
      topk_overlap  of the teacher's kept pairs, the share among the student's top-k of each head
                    at the teacher's count there (agreement's topk_both / teacher);
      digits_student, digits_teacher, digits_topk (and identifiers_*): the share of the marked
                    tokens' pairs each of those kept sets keeps.
    "heads": overlap, chance, kept_teacher, topk_overlap and share_error per head (L × H lists).
    "all": every share with the layers pooled (sums over layers), the mean Spearman over layers and
    abs_share_error, the mean |share_error| over layers: the summary a gate file keeps.
    A budget or a count that some contexts lack (counted by an older version) is left out."""
    L = len(per_context[0]["spearman"])
    spearman = [sum(c["spearman"][li] for c in per_context) / len(per_context) for li in range(L)]
    out = dict(spearman=spearman, heads={}, all=dict(spearman=sum(spearman) / L))
    for r in budgets:
        if not all(f"{r:g}" in c for c in per_context):
            continue
        counts = [c[f"{r:g}"] for c in per_context]
        shared = set.intersection(*(set(c) for c in counts)) - {"heads"}
        layer = {k: torch.tensor([c[k] for c in counts]).sum(0) for k in shared}  # (L,)
        views = [(out, layer), (out["all"], {k: v.sum() for k, v in layer.items()})]
        if all("heads" in c for c in counts):
            views.append((out["heads"], {k: torch.tensor([c["heads"][k] for c in counts]).sum(0)
                                         for k in counts[0]["heads"]}))  # (L, H)
        for into, c in views:
            into.update({f"{name}@{r}": _ratio(c[num], c[den])
                         for name, (num, den) in SHARES.items() if num in c and den in c})
            if {"student", "teacher", "segment"} <= c.keys():
                into[f"share_error@{r}"] = _ratio(c["student"] - c["teacher"], c["segment"])
        if f"share_error@{r}" in out:
            errors = [abs(e) for e in out[f"share_error@{r}"] if e is not None]
            out["all"][f"abs_share_error@{r}"] = sum(errors) / len(errors) if errors else None
    return out


def _ratio(num, den):
    """num / den elementwise (tensors of counts): a number or nested lists, None where den is 0."""
    q = torch.where(den > 0, num.double() / den.double().clamp_min(1), torch.nan).tolist()
    fix = lambda x: [fix(y) for y in x] if isinstance(x, list) else None if math.isnan(x) else x
    return fix(q)


def token_marks(tokenizer, ids):
    """(is_digit, is_identifier), each (n,) bool over the tokens `ids` of a context:
      digit       the token's text holds a digit (names, dates, numbers, pass keys);
      identifier  the token's text overlaps an identifier word. Words are the maximal runs of ASCII
                  letters, digits and underscores of the context's text; a word is an identifier
                  when it mixes letters and digits (sha256, x86, 0x1F, A7K2Q, but also 3rd, 1990s),
                  holds an underscore beside a letter or digit (snake_case, __init__), or is
                  camelCase: a lowercase letter followed by an uppercase one (camelCase, getHTTP,
                  iPhone). Pure numbers (2024, 3.14) and plain words (Paris, HTTP) are not.
    A token's text is what it adds to the decoded text after its predecessor (token_texts), so a
    word split over several tokens marks each of them."""
    texts = token_texts(tokenizer, ids)
    is_digit = torch.tensor([any(c.isdigit() for c in t) for t in texts], dtype=torch.bool)
    text = "".join(texts)
    inside = torch.zeros(len(text) + 1, dtype=torch.int64)  # 1 at i + 1: text[i] in an identifier
    for word in IDENT_WORD.finditer(text):
        if is_identifier_word(word.group()):
            inside[word.start() + 1:word.end() + 1] = 1
    before = inside.cumsum(0)  # before[i]: identifier characters in text[:i]
    lens = torch.tensor([len(t) for t in texts], dtype=torch.int64)
    ends = lens.cumsum(0)
    return is_digit, before[ends] > before[ends - lens]


IDENT_WORD = re.compile(r"[A-Za-z0-9_]+")


def is_identifier_word(word):
    """Whether an ASCII word ([A-Za-z0-9_]+) is an identifier (token_marks' rule)."""
    letters, digits = re.search(r"[A-Za-z]", word), re.search(r"[0-9]", word)
    return bool((letters and digits) or ("_" in word and (letters or digits))
                or re.search(r"[a-z][A-Z]", word))


def token_texts(tokenizer, ids):
    """Each token's text in context: what decoding it after its predecessor adds (a tokenizer may
    drop a leading space when a token is decoded alone, or decode a byte only with its neighbours);
    where that is not a suffix of the pair's text (bytes of one character split across tokens), the
    token decoded alone."""
    ids = list(ids)
    alone = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    pairs = tokenizer.decode_batch([ids[j - 1:j + 1] for j in range(1, len(ids))],
                                   skip_special_tokens=False)
    return alone[:1] + [p[len(a):] if p.startswith(a) else b
                        for a, b, p in zip(alone, alone[1:], pairs)]


def digit_tokens(tokenizer, ids):
    """(n,) bool: which tokens' text holds a digit (token_marks)."""
    return token_marks(tokenizer, ids)[0]


# ---- Calibration: each head of a trained gate moved to the share its teacher's cut gives it ------

CALIBRATE_BUDGETS, CALIBRATE_ITERS = (0.2, 0.3), 3  # train_gate.py --calibrate-heads (§13.17)


def logit(p, floor=1e-12):
    """log(p / (1 - p)) in float64, p kept inside [floor, 1 - 1e-9] (a score of 0 or 1 stays finite)."""
    p = p.double().clamp(floor, 1 - 1e-9)
    return torch.log(p) - torch.log1p(-p)


def cut_margins(scores, starts, lengths, docs, ratio, offset=None):
    """The cache's cut (kept_by_rule, each document one context) at budget `ratio` on
    z = logit(scores) + offset (L, H) (a calibrated gate's cut, Gates.cut_scores) -> (kept (L, H),
    total pairs, margins (L, H, M)): per head, the pairs kept outside each document's window,
    summed over `docs`; their count; each such pair's z − z(its document's weakest kept pair),
    >= 0 where kept, the documents' pairs end to end."""
    kept, total, margins = 0, 0, []
    for d in docs:
        a, n = int(starts[d]), int(lengths[d])
        s = logit(scores[..., a:a + n])  # the same cut as on the scores: logit is monotone
        if offset is not None:
            s = s + offset[..., None]
        keep, w = kept_by_rule(s, ratio)
        keep, s = keep[..., :n - w], s[..., :n - w]
        tau = s[keep].min() if keep.any() else s.max()
        kept, total = kept + keep.sum(-1), total + (n - w)
        margins.append(s - tau)
    return kept, total, torch.cat(margins, -1)


@torch.no_grad()
def calibrate_heads(gates, store, device, log=print, budgets=CALIBRATE_BUDGETS,
                    iters=CALIBRATE_ITERS, max_step=4.0, block=8192):
    """train_gate.py --calibrate-heads (ours, METHOD.md §13.17), after training: the prefill cut's
    allocation among the heads made the teacher's. The cache keeps the pairs above one threshold
    over all layers and heads, so a head whose scores sit too low loses pairs the teacher keeps,
    whatever its order inside. On the training documents (all, where none is held out), at each
    budget r: k_T, each head's share kept by the teacher's cut; per head the shift giving it that
    share at the gate's current thresholds, c_r = -(the (1 - k_T)-quantile of its cut_margins), and
        gates.cut_offset[l, h] += clamp(mean over r of c_r, ±max_step)
    The offsets move the prefill's cut only (Gates.cut_scores, monotone inside each head); the
    gate's scores, and decoding, stay as trained. The thresholds move with every shift: this
    repeats `iters` times and keeps the step with the least per-head share error on the training
    documents (the gate's own offsets included: never worse there). Returns per step the mean
    absolute per-head share error at each budget, on the training and the held-out documents (None
    without), and which step was kept."""
    starts, lengths = store.starts, store.lengths
    val = store.is_val_doc[starts]
    train_docs = [d for d in range(len(starts)) if not val[d]]
    val_docs = [d for d in range(len(starts)) if val[d]]
    share = lambda k, n: k.double() / max(n, 1)
    teacher = {}
    for r in budgets:
        kt, nt, _ = cut_margins(store.scores, starts, lengths, train_docs, r)
        kv, nv, _ = (cut_margins(store.scores, starts, lengths, val_docs, r) if val_docs
                     else (None, 0, None))
        teacher[r] = share(kt, nt), None if kv is None else share(kv, nv)
    pred = torch.empty_like(store.scores, dtype=torch.float32)  # the gate's own scores, once
    for li in range(store.n_layers):  # one layer's features in memory at a time
        x = store.load_layers(slice(li, li + 1))[0]
        for a in range(0, x.shape[0], block):
            pred[li, :, a:a + block] = gates.score_layer(
                li, x[a:a + block].to(device, gates.dtype)).float().cpu()
    offset = gates.cut_offset.detach().double().cpu().clone()  # (L, H): where the gate starts
    rows, best = [], None
    for it in range(iters + 1):
        shift, row = 0, dict(step=it)
        for r in budgets:
            kt, kv = teacher[r]
            kg, n, margins = cut_margins(pred, starts, lengths, train_docs, r, offset)
            row[f"train@{r:g}"] = float((share(kg, n) - kt).abs().mean())
            if kv is not None:
                k, m, _ = cut_margins(pred, starts, lengths, val_docs, r, offset)
                row[f"val@{r:g}"] = float((share(k, m) - kv).abs().mean())
            else:
                row[f"val@{r:g}"] = None
            # the head's pair at rank round(k_T · M) from the top sits at the threshold after c_r
            rank = (kt * margins.shape[-1]).round().long().clamp(1, margins.shape[-1])
            top = margins.sort(-1, descending=True).values
            shift = shift - top.gather(-1, rank[..., None] - 1)[..., 0] / len(budgets)
        error = sum(row[f"train@{r:g}"] for r in budgets)
        if best is None or error < best[0]:
            best = error, it, offset.clone()
        rows.append(row)
        log(f"--calibrate-heads step {it}: mean abs per-head share error " + ", ".join(
            f"@{r:g} {row[f'train@{r:g}']:.4f}" + (
                f" (held out {row[f'val@{r:g}']:.4f})" if val_docs else "") for r in budgets))
        if it < iters:
            offset += shift.clamp(-max_step, max_step)
    gates.cut_offset.copy_(best[2])
    log(f"--calibrate-heads: kept step {best[1]}")
    for row in rows:
        row["kept"] = row["step"] == best[1]
    return rows
