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
(CPU fp32 and GPU bf16 runs agree up to the model's own rounding), at the cost of one fp32
(Hq, 2K, 4K) matrix per layer, small next to the forward pass. softmax_dtype="model" reproduces the
authors.

Cost: one prefill plus one forward of (context + ~1.1% prompt tokens) on top of the full cache, i.e.
about two prefills (the cost Fast KVzip's gate removes at inference).

Also here, the agreement with this teacher (spearman, kept_by_rule, agreement, pool_agreement,
digit_tokens): how closely a scorer (the gate) ranks and keeps one context's KV pairs as it does.
"""
import math

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

AGREEMENT_BUDGETS = (0.5, 0.3)


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


def spearman(a, b):
    """Rank correlation of two 1-D tensors (ordinal ranks: ties, which almost never occur in float
    scores, are broken by position)."""
    ra = torch.empty_like(a, dtype=torch.float64)
    rb = torch.empty_like(b, dtype=torch.float64)
    ra[a.argsort(stable=True)] = torch.arange(len(a), dtype=torch.float64, device=a.device)
    rb[b.argsort(stable=True)] = torch.arange(len(b), dtype=torch.float64, device=b.device)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-300))


def agreement(student, teacher, is_digit, budgets=AGREEMENT_BUDGETS, chunk_size=16384, window=4096):
    """Per compressed layer, for one context: student and teacher scores (L, H, n), is_digit (n,)
    bool (tokens whose text holds a digit: names, dates, numbers, pass keys). Counts, so that
    callers can pool contexts (`pool_agreement`), keyed by the budget written as f"{r:g}"
    (JSON-ready):
      spearman   rank correlation over the layer's H·n pairs;
      at budget r, both sides kept by the cache's rule (kept_by_rule), counted outside the local
      window that both keep: teacher = pairs the teacher keeps, both = of those, the ones the
      student keeps too, student = pairs the student keeps, segment = pairs in the evicted segment;
      digits = digit-token pairs there, digits_teacher / digits_student = of those, the ones each
      side keeps."""
    out = dict(spearman=[spearman(s.flatten().double(), t.flatten().double())
                         for s, t in zip(student, teacher)])
    for r in budgets:
        ks, w = kept_by_rule(student, r, chunk_size, window)
        kt, _ = kept_by_rule(teacher, r, chunk_size, window)
        seg = torch.zeros(student.shape[-1], dtype=torch.bool, device=student.device)
        seg[:student.shape[-1] - w] = True
        digit = seg & is_digit.to(student.device)
        count = lambda m, where: m[..., where].flatten(1).sum(1).tolist()
        out[f"{r:g}"] = dict(teacher=count(kt, seg), both=count(kt & ks, seg),
                             student=count(ks, seg), segment=[int(seg.sum()) * student.shape[1]]
                             * student.shape[0], digits=[int(digit.sum()) * student.shape[1]]
                             * student.shape[0], digits_teacher=count(kt, digit),
                             digits_student=count(ks, digit))
    return out


def pool_agreement(per_context, budgets=AGREEMENT_BUDGETS):
    """Pool agreement() over contexts, per layer: mean Spearman; at each budget, overlap = the share
    of the teacher's kept pairs the student keeps too (chance level: the student's kept share), the
    share of the layer's segment each side keeps, and the share of digit-token pairs each side
    keeps. None where a denominator is zero."""
    ratio = lambda a, b: a / b if b else None
    L = len(per_context[0]["spearman"])
    out = dict(spearman=[sum(c["spearman"][li] for c in per_context) / len(per_context)
                         for li in range(L)])
    for r in budgets:
        tot = {k: [sum(c[f"{r:g}"][k][li] for c in per_context) for li in range(L)]
               for k in per_context[0][f"{r:g}"]}
        out[f"overlap@{r}"] = [ratio(tot["both"][li], tot["teacher"][li]) for li in range(L)]
        out[f"chance@{r}"] = [ratio(tot["student"][li], tot["segment"][li]) for li in range(L)]
        out[f"kept_teacher@{r}"] = [ratio(tot["teacher"][li], tot["segment"][li])
                                    for li in range(L)]
        out[f"digits_student@{r}"] = [ratio(tot["digits_student"][li], tot["digits"][li])
                                      for li in range(L)]
        out[f"digits_teacher@{r}"] = [ratio(tot["digits_teacher"][li], tot["digits"][li])
                                      for li in range(L)]
    return out


def digit_tokens(tokenizer, ids):
    """(n,) bool: which tokens' text holds a digit."""
    return torch.tensor([any(c.isdigit() for c in tokenizer.id_to_token(i) or "") for i in ids],
                        dtype=torch.bool)
