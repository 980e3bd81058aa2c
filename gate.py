"""
How important is each KV pair? The gate that predicts it from one hidden state. The evicting cache
asks it through a Scorer (GateScorer, section 2, beside the baselines' scorers); it learns from the
KVzip teacher (teacher.py), which also measures how closely they agree. Its files (our safetensors
format, the authors' released .pt, the gate's hash, finding a model's gate) live in
formats/gate_file.py.

Sections:
1. The gate (METHOD.md §1): a tiny "sink attention" per compressed layer. Each token's
   attention-input hidden state h (the same tensor that enters q/k/v_proj, §1.7) is projected to G
   low-rank queries and one low-rank key per KV head; the score is the probability that the token's
   queries attend to its own key rather than to S learned sink keys:

       s_g = q_g·k/√D' + b_g        t_{g,r} = q_g·k_base_r/√D'
       score = mean_g  exp(s_g) / (exp(s_g) + Σ_r exp(t_{g,r}))  =  mean_g sigmoid(s_g − logsumexp_r t_{g,r})

   One class, `Gates`, holds the parameters of all compressed layers stacked on a leading axis L, so
   training runs every layer as one batched op (`forward`) and inference scores one layer
   (`score_layer`) — both through the same function `sink_gate`.
2. Scorers: what the evicting cache asks for each new KV pair: the gate's score (GateScorer) or a
   baseline's (StreamingLLM, SnapKV, R-KV, random, key norm); KVzip's teacher's scores.
3. METHODS: each method's scorer by name, read by everything that runs a method.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

# =================================================================================================
# 1. The gate
# =================================================================================================

RMS_EPS = 1e-6  # Qwen3RMSNorm default, used by the authors' gate norms (METHOD.md §1.2)


def rms_norm(x, weight, eps=RMS_EPS):
    """Qwen3RMSNorm exactly (METHOD.md §1.3): normalise in fp32, round back to x's dtype, then
    multiply by the fp32 weight — so the result is fp32 whose values were rounded to x's dtype
    (bf16) first."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def sink_gate(x, q_weight, q_bias, k_weight, q_norm, k_norm, k_base, b):
    """The gate's math, for L layers at once (METHOD.md §1.4). Returns (L, H, N) float32 in (0, 1).

    x (L, N, D) hidden states; q_weight (L, H·G·D', D), q_bias (L, H·G·D'), k_weight (L, H·D', D),
    q_norm/k_norm (L, D'), k_base (L, H, S, D'), b (L, H, G). Projections run in the weights' dtype
    (bf16 for released gates); everything after the norms is fp32."""
    L, N, _ = x.shape
    _, H, S, Dp = k_base.shape
    G = b.shape[-1]
    x = x.to(q_weight.dtype)
    # -- low-rank projections, one (N, D) @ (D, out) per layer --
    if L == 1:  # one layer (inference): two plain linear layers, the same numbers, faster on CPUs
        q = F.linear(x[0], q_weight[0], q_bias[0])[None]                  # (1, N, H·G·D')
        k = F.linear(x[0], k_weight[0])[None]                             # (1, N, H·D')
    else:
        q = torch.baddbmm(q_bias.unsqueeze(1), x, q_weight.transpose(1, 2))  # (L, N, H·G·D')
        k = torch.bmm(x, k_weight.transpose(1, 2))                            # (L, N, H·D')
    # q_proj's output is head-major: column h·G·D' + g·D' + i (METHOD.md §1.4 step 1)
    q = rms_norm(q.view(L, N, H, G, Dp), q_norm.view(L, 1, 1, 1, Dp))    # (L, N, H, G, D') fp32
    k = rms_norm(k.view(L, N, H, Dp), k_norm.view(L, 1, 1, Dp))          # (L, N, H, D') fp32
    # -- own-key logit, b added ONCE in training and inference alike (§1.5) --
    s = torch.einsum("lnhgd,lnhd->lhng", q, k) / math.sqrt(Dp)            # (L, H, N, G)
    s = s + b.float().unsqueeze(2)
    # -- sink logits: the same queries against the S learned sink keys (k_base is not normalised) --
    t = torch.einsum("lnhgd,lhsd->lhngs", q, k_base.float()) / math.sqrt(Dp)  # (L, H, N, G, S)
    # 1 / (1 + Σ_r exp(t_r − s)) written stably; tests/test_gate.py checks it against the literal
    score = torch.sigmoid(s - torch.logsumexp(t, dim=-1))                 # (L, H, N, G)
    return score.mean(-1)  # MEAN over the G query groups, not max (§1.4 step 4, §12.3)


class Gates(nn.Module):
    """The gates of all compressed layers, parameters stacked over L = #compressed layers.

    Per layer this is exactly the authors' `Weight` module (METHOD.md §1.2): q_proj (with bias) and
    k_proj (no bias) in `dtype` (the LLM's dtype: bf16 for released gates), q_norm/k_norm weights
    and the S sink keys k_base in fp32, the per-group bias b in `dtype`. Index li is the position
    in cfg.compressed_layers (Qwen3: every layer; Gemma3: the global layers only, §9). The bias b
    is added once, as in every inference path of the authors (their training script adds it twice,
    §1.5): a gate trained here computes at inference exactly the function that was trained.
    """

    def __init__(self, n_layers, hidden, n_kv_heads, group, dim=16, sinks=16, dtype=torch.float32,
                 device=None):
        super().__init__()
        # the authors' sink=0 branch is unused (§1.5)
        assert sinks >= 1, "a gate needs at least one sink key"
        L, D, H, G, Dp, S = n_layers, hidden, n_kv_heads, group, dim, sinks
        self.n_layers, self.hidden, self.n_kv_heads = L, D, H
        self.group, self.dim, self.sinks = G, Dp, S
        self.meta = {}  # what the gate file said about itself (model, layers, training summary)
        kw = dict(device=device)
        # in the authors' names: q_proj.weight, q_proj.bias, k_proj.weight
        self.q_weight = nn.Parameter(torch.empty(L, H * G * Dp, D, dtype=dtype, **kw))
        self.q_bias = nn.Parameter(torch.empty(L, H * G * Dp, dtype=dtype, **kw))
        self.k_weight = nn.Parameter(torch.empty(L, H * Dp, D, dtype=dtype, **kw))
        self.q_norm = nn.Parameter(torch.ones(L, Dp, **kw))  # q_norm.weight
        self.k_norm = nn.Parameter(torch.ones(L, Dp, **kw))  # k_norm.weight
        self.k_base = nn.Parameter(torch.zeros(L, H, S, Dp, **kw))  # the S sink keys, zeros at init
        self.b = nn.Parameter(torch.zeros(L, H, G, dtype=dtype, **kw))  # own-key bias, zero at init
        # ours (METHOD.md §13.17): each head's logit offset at the prefill's cut, set after training
        self.register_buffer("cut_offset", torch.zeros(L, H, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """nn.Linear's default init, layer by layer in the order the authors build their per-layer
        modules (q_proj weight, q_proj bias, k_proj weight), so a seeded init draws the same numbers
        (§1.2)."""
        bound = 1 / math.sqrt(self.hidden)  # kaiming_uniform(a=√5) on fan_in D gives U(−1/√D, 1/√D)
        for li in range(self.n_layers):
            nn.init.kaiming_uniform_(self.q_weight[li], a=math.sqrt(5))
            nn.init.uniform_(self.q_bias[li], -bound, bound)
            nn.init.kaiming_uniform_(self.k_weight[li], a=math.sqrt(5))
        self.q_norm.fill_(1.0), self.k_norm.fill_(1.0), self.k_base.zero_(), self.b.zero_()

    @property
    def dtype(self):
        """The projections' dtype (Module.to(dtype) would cast the fp32 norms and sinks too: reload
        with formats.gate_file.load_gate(..., dtype=...) to change it)."""
        return self.q_weight.dtype

    def extra_repr(self):
        return (f"layers={self.n_layers}, hidden={self.hidden}, H={self.n_kv_heads}, "
                f"G={self.group}, D'={self.dim}, S={self.sinks}, dtype={self.dtype}")

    def _params(self, layers=slice(None)):
        return (self.q_weight[layers], self.q_bias[layers], self.k_weight[layers],
                self.q_norm[layers], self.k_norm[layers], self.k_base[layers], self.b[layers])

    def forward(self, hidden):
        """Training form: hidden (L, N, D), the same N tokens in every layer -> scores (L, H, N)."""
        assert hidden.dim() == 3 and hidden.shape[0] == self.n_layers, \
            f"expected hidden (L={self.n_layers}, N, D), got {tuple(hidden.shape)}"
        return sink_gate(hidden, *self._params())

    def score_layer(self, li, hidden):
        """Inference form: hidden (N, D) of compressed layer li -> scores (H, N)."""
        assert hidden.dim() == 2, f"expected hidden (N, D) for one layer, got {tuple(hidden.shape)}"
        params = self._params(slice(li, li + 1))  # views, no copy
        return sink_gate(hidden.unsqueeze(0), *params)[0]

    def cut_scores(self, scores):
        """What the prefill's cut compares (ours, METHOD.md §13.17): scores (L, H, N), each head's
        moved by its offset o, sigmoid(logit(s) + o) in float64 (+inf, a protected row, stays):
        monotone inside each head, so only where the heads sit against each other moves. Without
        offsets (an uncalibrated gate), `scores` itself."""
        if not self.cut_offset.any():
            return scores
        p = scores.double()
        z = torch.log(p) - torch.log1p(-p) + self.cut_offset.double().unsqueeze(-1)
        return torch.where(p.isinf(), p, torch.sigmoid(z))

    # -- per-layer state dicts in the authors' key names and shapes (§1.2): both file formats --
    def layer_state_dict(self, li):
        """Layer li as the authors' `Weight` state dict, and its heads' "cut_offset" (H,) where the
        gate has offsets (ours: the authors' layout has no place for it)."""
        sd = {
            "q_proj.weight": self.q_weight[li].detach(),
            "q_proj.bias": self.q_bias[li].detach(),
            "k_proj.weight": self.k_weight[li].detach(),
            "q_norm.weight": self.q_norm[li].detach(),
            "k_norm.weight": self.k_norm[li].detach(),
            "k_base": self.k_base[li].detach().unsqueeze(1),                    # (H, 1, S, D')
            "b": self.b[li].detach().unsqueeze(1),                              # (H, 1, G)
        }
        if self.cut_offset.any():
            sd["cut_offset"] = self.cut_offset[li].detach()                     # (H,)
        return sd

    @classmethod
    def from_layer_state_dicts(cls, layers, dtype=None, device=None):
        """Build from a list of the authors' per-layer state dicts (the inverse of
        layer_state_dict). dtype None = the file's projection dtype. Shapes are read from layer 0,
        as the authors' loader does (§1.2); a file's loader checks every layer first
        (formats/gate_file.py: infer_dims)."""
        first = layers[0]
        Dp = first["q_norm.weight"].shape[-1]
        HDp, D = first["k_proj.weight"].shape
        H, G, S = HDp // Dp, first["q_proj.weight"].shape[0] // HDp, first["k_base"].shape[2]
        dtype = dtype or first["q_proj.weight"].dtype
        with torch.device("meta"):  # no random init for parameters we are about to overwrite
            gates = cls(len(layers), D, H, G, Dp, S, dtype=dtype)

        def stack(key, dt, squeeze=False):
            ts = [sd[key].squeeze(1) if squeeze else sd[key] for sd in layers]
            return nn.Parameter(torch.stack(ts).to(device=device, dtype=dt))

        f32 = torch.float32
        gates.q_weight, gates.q_bias = stack("q_proj.weight", dtype), stack("q_proj.bias", dtype)
        gates.k_weight = stack("k_proj.weight", dtype)
        gates.q_norm, gates.k_norm = stack("q_norm.weight", f32), stack("k_norm.weight", f32)
        gates.k_base, gates.b = stack("k_base", f32, squeeze=True), stack("b", dtype, squeeze=True)
        gates.cut_offset = (torch.stack([sd["cut_offset"] for sd in layers]).to(device, f32)
                            if "cut_offset" in first else torch.zeros(len(layers), H, device=device))
        return gates


def load_gates(path, dtype=None, device=None):
    """A gate file of ours (safetensors: the authors' per-layer tensors as layers.<i>.<key>) ->
    Gates, as it is: formats/gate_file.py's load_gate checks a file (shapes, finite values, the
    model it fits, scores that rank) and reads the authors' .pt too; resolve_gate finds a model's."""
    layers = {}
    for name, t in load_file(str(path)).items():
        _, li, key = name.split(".", 2)  # layers.<i>.<key>
        layers.setdefault(int(li), {})[key] = t
    return Gates.from_layer_state_dicts([layers[li] for li in range(len(layers))], dtype, device)


# =================================================================================================
# 2. Scorers: the one interface the evicting cache calls to ask "how important is each new KV pair?"
#    (`Scorer.score`): Fast KVzip's (the gate's output) and the baselines' (StreamingLLM, SnapKV,
#    R-KV, random, key norm). KVzip's teacher, the other scorer, works on a whole context at once:
#    teacher.py; KVzipScorer is its place among them.
# =================================================================================================

class Scorer:
    """score(li, hidden, q, k, pos) -> (H, T) float32, higher = more important, for the T new tokens
    of compressed layer li. hidden (T, D) is the attention input; q (T, Hq, d) and k (T, H, d) are
    post-RoPE; pos (T,) absolute positions. During decoding the cache scores its buffered hidden
    states without q/k (q = k = None); scorers that need them say so.

    `level` names the eviction structure the scorer is meant for (cache.EvictingCache): "global" =
    one threshold over all layers × heads (the authors' "pair"), "head" = per head ("pair-head").

    At decode time (METHOD.md §7) the cache always keeps the last `decode_window` tokens: 128 for
    the gate, 8 for the baselines, as the authors run them
    (Janghyun1230/FastKVzip:math/run_math.py, `args.window_size = 8` for every method but
    fastkvzip); `window_at_decode(cfg)` may choose per model. A scorer with `rescores` set scores
    every held row again at each decode-time eviction from the last decode_window queries
    (`rescore`); the others score each new token once.

    `prefill`: it scores each prefill chunk as the chunk arrives (False: KVzip, whose teacher
    scores the whole context after prefill, so its cache holds no scorer). `decode`: it can evict
    during decoding (generate.py --decode-tokens-per-head). `make` builds it for a model from
    the model's config (model.ModelConfig), the gates (Fast KVzip's) and a seed (random scores).
    METHODS, at the end of this file, names each scorer: a new one is a class and a line there
    (docs/usage.md, "Add a scorer")."""
    level = "global"
    decode_window = 8
    rescores = False
    prefill = True
    decode = True

    def __init__(self, n_kv_heads=None):
        self.n_kv_heads = n_kv_heads  # needed only by scorers that ignore q/k when q/k are None

    @classmethod
    def make(cls, cfg, gates=None, seed=0):
        return cls(n_kv_heads=cfg.num_key_value_heads)

    @classmethod
    def level_at_decode(cls, cfg):
        """The level of decode-time eviction on cfg's model when the caller names none: `level`."""
        return cls.level

    @classmethod
    def window_at_decode(cls, cfg):
        """The last tokens decode-time eviction always keeps on cfg's model when the caller names
        no window: `decode_window`."""
        return cls.decode_window

    def _heads(self, k):
        if k is not None:
            return k.shape[1]
        assert self.n_kv_heads is not None, (f"{type(self).__name__}(n_kv_heads=...) is needed "
                                             "when k is None")
        return self.n_kv_heads

    def score(self, li, hidden, q, k, pos):
        raise NotImplementedError


def every_layer_compressed(cfg):
    """Whether cfg's model compresses every layer (no sliding-window layers beside, METHOD.md §9)."""
    return len(cfg.compressed_layers) == cfg.num_hidden_layers


@torch.no_grad()
def key_redundancy(keys, threshold=0.5):
    """R-KV's redundancy (Janghyun1230/FastKVzip:math/method/utils.py:cal_similarity): keys (n, d)
    of one head -> (n,) softmax over rows of each key's mean cosine similarity to the others, after
    zeroing each row's similarity to its last key above `threshold` (none: to row 0, as theirs)."""
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = k @ k.T                                                              # (n, n)
    sim.fill_diagonal_(0.0)
    rows = torch.arange(sim.shape[0], device=sim.device)
    sim[rows, torch.where(sim > threshold, rows, 0).amax(-1)] = 0
    return sim.mean(0).softmax(-1)


class GateScorer(Scorer):
    """Fast KVzip: the gate's output. Meant for "global" (one threshold over all layers × heads,
    §6): gate scores are comparable across layers and heads because they are trained to the same
    targets."""
    level = "global"
    decode_window = 128  # the authors' local window at decode (METHOD.md §7; on Gemma 3 too: §13.18)

    def __init__(self, gates, redundancy=0.0):
        # a path or a state dict: formats.gate_file loads one. TypeError, not kernels.ArgumentError:
        # gate.py imports nothing of the project (it lifts out alone)
        if not isinstance(gates, Gates):
            raise TypeError(f"GateScorer: gates must be a gate.Gates "
                            f"(formats.gate_file.load_gate), got {type(gates).__name__}")
        super().__init__(gates.n_kv_heads)
        self.gates = gates
        self.redundancy = redundancy  # λ of the decode-time factor (ours: at_decode); 0: none

    @classmethod
    def make(cls, cfg, gates=None, seed=0):
        """The authors' gate; on a hybrid model, our redundancy factor at decode: λ = 4."""
        return cls(gates, redundancy=0.0 if every_layer_compressed(cfg) else 4.0)

    @classmethod
    def level_at_decode(cls, cfg):
        """One pool where every layer is compressed, as the authors run it; "calibrated" (each
        layer's scores over their mean before the one cut, METHOD.md §13.9) on a hybrid model,
        whose few compressed layers score on scales far apart (Gemma 3 270M: layer 17's ~50x below
        layer 5's), so that one pool starves the lowest of them: ours, measured in
        benchmarks/decode-cpu/ablation-gemma3-270m (METHOD.md §7)."""
        return "global" if every_layer_compressed(cfg) else "calibrated"

    @torch.no_grad()
    def score(self, li, hidden, q, k, pos):
        return self.gates.score_layer(li, hidden)  # (H, T) fp32

    def cut_scores(self, scores):
        """The prefill's cut on Gates.cut_scores (EvictingCache.evict); rows keep raw scores."""
        return self.gates.cut_scores(scores)

    def at_decode(self, scores, keys):
        """What decode-time eviction compares for one head (ours, METHOD.md §13.18): its held rows'
        scores (n,), +inf where protected, times (r̄/r)^λ, r each key's key_redundancy, r̄ its mean:
        rows whose keys repeat others' are lowered, the average row unmoved; λ = 0: the scores."""
        if not self.redundancy:
            return scores
        r = key_redundancy(keys)
        return scores * (r.mean() / r) ** self.redundancy


class StreamingScorer(Scorer):
    """StreamingLLM: score = absolute position, so the most recent tokens survive; the cache itself
    protects the first (sinks, the system prompt). The same in every layer and head, so every level
    gives one result; "head" as the baseline's budget (§10). fp32 holds positions up to 2^24."""
    level = "head"

    def score(self, li, hidden, q, k, pos):
        return pos.to(torch.float32).unsqueeze(0).expand(self._heads(k), -1).contiguous()


class RandomScorer(Scorer):
    """Uniform random scores from a seeded generator (a floor for every other scorer). Any level."""
    level = "head"

    def __init__(self, seed=0, n_kv_heads=None):
        super().__init__(n_kv_heads)
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def make(cls, cfg, gates=None, seed=0):
        return cls(seed, n_kv_heads=cfg.num_key_value_heads)

    def score(self, li, hidden, q, k, pos):
        return torch.rand(self._heads(k), pos.shape[0], generator=self.generator).to(pos.device)


class SnapKVScorer(Scorer):
    """SnapKV as the authors run it in chunked prefill (METHOD.md §10,
    Janghyun1230/FastKVzip:prefill/attention/baseline.py:SnapKV), query-agnostic: the chunk's own
    last queries (the observation window) vote for the chunk's keys.

    - window = the last 32 queries of the chunk (16 while the sequence, current chunk included, is
      shorter than 1000 tokens: the authors test their retain cache's key length, pos[-1] + 1);
    - keys = the first 4 keys of the sequence (chunks after the first only) ⊕ the chunk's keys. The
      cache hands a scorer only the new keys, so the scorer remembers each layer's first 4 keys when
      it sees the chunk that starts at position 0 (post-RoPE keys never change, so this is exact);
    - logits q·k·scale, MAX over the G query heads of each KV head on the logits, fp32 softmax over
      the keys, mean over the window queries, drop the 4 sink columns, max_pool1d(kernel 7, stride
      1, pad 3);
    - as in the authors' code there is no causal mask inside the window (window queries see the
      whole chunk); the window tokens themselves get the head's maximum + 1 so they are always kept.
    Meant for "head" (per-head top-k with k = int(n·r'), the authors' level for SnapKV).
    At decode time it rescores every held row (`rescore`, the authors' decode-time SnapKV).
    scale: the model's attention scale (default 1/√d; Gemma3 uses query_pre_attn_scalar^-1/2)."""
    level = "head"
    rescores = True

    def __init__(self, scale=None, window=32, short_window=16, short_len=1000, n_sink=4, kernel=7):
        super().__init__()
        self.scale, self.window, self.short_window, self.short_len = (
            scale, window, short_window, short_len)
        self.n_sink, self.kernel = n_sink, kernel
        self.sink_keys = {}  # compressed layer -> first n_sink keys of the sequence (n_sink, H, d)

    @classmethod
    def make(cls, cfg, gates=None, seed=0):
        return cls(scale=cfg.attn_scale)

    @torch.no_grad()
    def score(self, li, hidden, q, k, pos):
        assert q is not None and k is not None, \
            "SnapKVScorer scores prefill chunks from their queries; it has no decoding form here"
        T, Hq, d = q.shape
        H = k.shape[1]
        G = Hq // H
        if int(pos[0]) == 0:  # a new sequence: remember its first keys, no sink keys for this chunk
            self.sink_keys[li] = k[:self.n_sink].clone()
            sinks = k[:0]
        else:
            sinks = self.sink_keys.get(li, k[:0])
        keys = torch.cat([sinks, k]).float()                              # (n_s + T, H, d)
        w = self.window if int(pos[-1]) + 1 >= self.short_len else self.short_window
        w = min(w, T)
        qw = q[-w:].float().view(w, H, G, d)                              # query head = h·G + g
        scale = self.scale if self.scale is not None else 1 / math.sqrt(d)
        logits = torch.einsum("whgd,khd->hgwk", qw, keys) * scale         # (H, G, w, n_s + T)
        logits = logits.amax(dim=1)  # max over the group, on logits
        attn = torch.softmax(logits, dim=-1, dtype=torch.float32).mean(dim=1)  # (H, n_s + T)
        attn = attn[:, sinks.shape[0]:]  # (H, T): drop the sink columns
        # smooth: a token next to an attended token is kept too (clusters of information)
        score = F.max_pool1d(attn.unsqueeze(0), self.kernel, stride=1, padding=self.kernel // 2)[0]
        score[:, T - w:] = score.amax(dim=-1, keepdim=True) + 1  # the observation window stays
        return score

    @torch.no_grad()
    def attention(self, keys, queries):
        """Decode-time SnapKV (Janghyun1230/FastKVzip:math/method/compression/snapkv.py): keys
        (n, d) one KV head's held rows in position order, queries (w, G, d) its group's last w
        queries -> (n - w,) how much they attend to each row before the last w: logits maxed over
        the group, fp32 softmax over those rows, mean over the queries, max_pool1d(7). No causal
        mask, as the authors'."""
        w, _, d = queries.shape
        scale = self.scale if self.scale is not None else 1 / math.sqrt(d)
        logits = torch.einsum("wgd,nd->gwn", queries.float(), keys.float()).amax(0) * scale
        attn = torch.softmax(logits[:, :keys.shape[0] - w], dim=-1).mean(0)      # (n - w,)
        return F.max_pool1d(attn[None], self.kernel, stride=1, padding=self.kernel // 2)[0]

    def rescore(self, li, keys, queries):
        """keys (n, d), queries (w, G, d) -> (n,): held() for the rows before the last w, which
        score +inf (the authors keep top (B - w) of the others and the last w)."""
        w = queries.shape[0]
        return torch.cat([self.held(keys, queries), keys.new_full((w,), math.inf).float()])

    def held(self, keys, queries):
        """SnapKV's decode-time score of the rows before the last w: attention()."""
        return self.attention(keys, queries)


class RKVScorer(SnapKVScorer):
    """R-KV at decode time, as the authors run it (Janghyun1230/FastKVzip:math/method/compression/
    r1_kv.py; λ = 0.1, the default of math/run_math.py): λ·(decode-time SnapKV attention) − (1 − λ)·
    key_redundancy. A decode-time method: prefill chunks get SnapKV's chunk scores (R-KV
    compresses only the reasoning trace)."""
    level = "head"

    def __init__(self, scale=None, mix=0.1, threshold=0.5, **kwargs):
        super().__init__(scale, **kwargs)
        self.mix, self.threshold = mix, threshold

    def held(self, keys, queries):
        """R-KV's score of the rows before the last w (rescore pads the last w with +inf)."""
        n, w = keys.shape[0], queries.shape[0]
        return self.mix * self.attention(keys, queries) \
            - (1 - self.mix) * key_redundancy(keys, self.threshold)[:n - w]


class KVzipScorer(Scorer):
    """KVzip: its teacher (teacher.py) scores the whole context at once, after a prefill that
    evicts nothing (generate.prefill_kvzip hands the scores to the cache, then one eviction), so
    its cache holds no scorer (`prefill` False) and it cannot evict during decoding (`decode`
    False). This class holds such scores, (L_c, H, n) by position, where a benchmark replays a
    prefill (harness/quality.py). Meant for "global", the paper's level for KVzip."""
    level = "global"
    prefill = False
    decode = False

    def __init__(self, scores):
        super().__init__(scores.shape[1])
        self.scores = scores

    def score(self, li, hidden, q, k, pos):
        return self.scores[li][:, pos.cpu()].to(pos.device)


class KnormScorer(Scorer):
    """Key norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression"; NVIDIA/kvpress:kvpress/presses/knorm_press.py): keys with a small L2 norm draw
    the most attention, so score = −‖k‖₂ and the smallest norms are kept. No queries, no
    gate: the query-agnostic baseline that costs nothing. RoPE rotates pairs of dimensions, so the
    post-RoPE key has the pre-RoPE key's norm. Meant for "head", as kvpress prunes it (each KV head
    keeps its own top-k), with the baselines' decode window of 8. At decode time the new tokens'
    keys live only in the cache, so it is handed every held row's keys (`rescores`): the rows
    score what they scored when they arrived, the new ones their own norm."""
    level = "head"
    rescores = True

    def score(self, li, hidden, q, k, pos):
        return -k.float().norm(dim=-1).T.contiguous()                      # (T, H) -> (H, T)

    def rescore(self, li, keys, queries):
        return -keys.float().norm(dim=-1)  # keys (n, d) of one head -> (n,); queries unused


# =================================================================================================
# 3. The methods by name: the one list the command lines, the benchmarks, the saved-cache format and
#    the quality harness read (a new scorer: a class above and a line here)
# =================================================================================================

# method -> its scorer class (generate.make_cache: cls.make(cfg, gates, seed)). "full" keeps every
# pair: a plain cache.KVCache, no scorer. The decode suite's "cut" (the full cache, its answer
# forced within the budget) evicts nothing and is no method here: harness/decode.py
METHODS = {
    "full": None,
    "fastkvzip": GateScorer,
    "kvzip": KVzipScorer,
    "snapkv": SnapKVScorer,
    "rkv": RKVScorer,  # evicts at decode time only: R-KV compresses a reasoning trace (§10)
    "streaming": StreamingScorer,
    "random": RandomScorer,
    "knorm": KnormScorer,
}
