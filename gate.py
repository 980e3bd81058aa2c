"""
How important is each KV pair? The gate that predicts it from one hidden state, and the gate's
files. The evicting cache asks it through a Scorer (GateScorer, section 2, beside the baselines'
scorers); it learns from the KVzip teacher (teacher.py), which also measures how closely they agree.

Sections, method first:
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
   baseline's (StreamingLLM, SnapKV, random).
3. Gate files: our format (safetensors + JSON metadata), the authors' released `.pt` files (read
   without unpickling code), and `resolve_gate` (explicit path → bundled gate → the authors'
   released gate).
"""
import hashlib
import json
import math
import os
import pickle
import re
import stat
from pathlib import Path

import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from cli import ALIASES, atomic_path


class GateError(Exception):
    """A gate that cannot be used (missing, unsafe, or shaped for another model). One-line
    messages."""


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
    # 1 / (1 + Σ_r exp(t_r − s)) written stably; equal to the literal form to ~1e-7
    # (tests/test_gate.py)
    score = torch.sigmoid(s - torch.logsumexp(t, dim=-1))                 # (L, H, N, G)
    return score.mean(-1)  # MEAN over the G query groups, not max (§1.4 step 4, §12.3)


class Gates(nn.Module):
    """The gates of all compressed layers, parameters stacked over L = #compressed layers.

    Per layer this is exactly the authors' `Weight` module (METHOD.md §1.2): q_proj (with bias) and
    k_proj (no bias) in `dtype` (the LLM's dtype: bf16 for released gates), q_norm/k_norm weights
    and the S sink keys k_base in fp32, the per-group bias b in `dtype`. Index l is the position in
    cfg.compressed_layers (Qwen3: every layer; Gemma3: the global layers only, §9).
    The bias b is added once, as in every inference path of the authors (their training script adds
    it twice, §1.5): a gate trained here computes at inference exactly the function that was
    trained.
    """

    def __init__(self, n_layers, hidden, n_kv_heads, group, dim=16, sinks=16, dtype=torch.float32,
                 device=None):
        super().__init__()
        assert sinks >= 1, ("a gate needs at least one sink key (the authors' sink=0 branch is "
                            "unused, §1.5)")
        L, D, H, G, Dp, S = n_layers, hidden, n_kv_heads, group, dim, sinks
        self.n_layers, self.hidden, self.n_kv_heads, self.group, self.dim, self.sinks = (L, D, H, G,
                                                                                         Dp, S)
        self.meta = {}  # what the gate file said about itself (model, layers, training summary)
        kw = dict(device=device)
        # q_proj.weight
        self.q_weight = nn.Parameter(torch.empty(L, H * G * Dp, D, dtype=dtype, **kw))
        self.q_bias = nn.Parameter(torch.empty(L, H * G * Dp, dtype=dtype, **kw))  # q_proj.bias
        self.k_weight = nn.Parameter(torch.empty(L, H * Dp, D, dtype=dtype, **kw))  # k_proj.weight
        self.q_norm = nn.Parameter(torch.ones(L, Dp, **kw))  # q_norm.weight
        self.k_norm = nn.Parameter(torch.ones(L, Dp, **kw))  # k_norm.weight
        self.k_base = nn.Parameter(torch.zeros(L, H, S, Dp, **kw))  # the S sink keys, zeros at init
        # own-key bias, zeros at init
        self.b = nn.Parameter(torch.zeros(L, H, G, dtype=dtype, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """nn.Linear's default init, layer by layer in the order the authors build their per-layer
        modules (q_proj weight, q_proj bias, k_proj weight), so a seeded init draws the same numbers
        (§1.2)."""
        bound = 1 / math.sqrt(self.hidden)  # kaiming_uniform(a=√5) on fan_in D gives U(−1/√D, 1/√D)
        for l in range(self.n_layers):
            nn.init.kaiming_uniform_(self.q_weight[l], a=math.sqrt(5))
            nn.init.uniform_(self.q_bias[l], -bound, bound)
            nn.init.kaiming_uniform_(self.k_weight[l], a=math.sqrt(5))
        self.q_norm.fill_(1.0), self.k_norm.fill_(1.0), self.k_base.zero_(), self.b.zero_()

    @property
    def dtype(self):
        """The projections' dtype. (Module.to(dtype) would also cast the fp32 norms and sinks: to
        change it, reload with load_gate(..., dtype=...) instead.)"""
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

    def score_layer(self, l, hidden):
        """Inference form: hidden (N, D) of compressed layer l -> scores (H, N)."""
        assert hidden.dim() == 2, ("expected hidden (N, D) for one layer (batch 1), got "
                                   f"{tuple(hidden.shape)}")
        params = self._params(slice(l, l + 1))  # views, no copy
        return sink_gate(hidden.unsqueeze(0), *params)[0]

    # -- per-layer state dicts in the authors' key names and shapes (§1.2); used by both file
    # formats --
    def layer_state_dict(self, l):
        """Layer l as the authors' `Weight` state dict."""
        return {
            "q_proj.weight": self.q_weight[l].detach(),
            "q_proj.bias": self.q_bias[l].detach(),
            "k_proj.weight": self.k_weight[l].detach(),
            "q_norm.weight": self.q_norm[l].detach(),
            "k_norm.weight": self.k_norm[l].detach(),
            "k_base": self.k_base[l].detach().unsqueeze(1),                    # (H, 1, S, D')
            "b": self.b[l].detach().unsqueeze(1),                              # (H, 1, G)
        }

    @classmethod
    def from_layer_state_dicts(cls, layers, dtype=None, device=None):
        """Build from a list of the authors' per-layer state dicts. dtype None = the file's
        projection dtype. Shapes are inferred from layer 0 and every layer must match them."""
        dims = infer_dims(layers)
        dtype = dtype or layers[0]["q_proj.weight"].dtype
        with torch.device("meta"):  # no random init for parameters we are about to overwrite
            gates = cls(len(layers), dims["hidden"], dims["n_kv_heads"], dims["group"], dims["dim"],
                        dims["sinks"], dtype=dtype)

        def stack(key, dt, squeeze=False):
            ts = [sd[key].squeeze(1) if squeeze else sd[key] for sd in layers]
            return nn.Parameter(torch.stack(ts).to(device=device, dtype=dt))

        f32 = torch.float32
        gates.q_weight, gates.q_bias = stack("q_proj.weight", dtype), stack("q_proj.bias", dtype)
        gates.k_weight = stack("k_proj.weight", dtype)
        gates.q_norm, gates.k_norm = stack("q_norm.weight", f32), stack("k_norm.weight", f32)
        gates.k_base, gates.b = stack("k_base", f32, squeeze=True), stack("b", dtype, squeeze=True)
        return gates


# =================================================================================================
# 2. Scorers: the one interface the evicting cache calls to ask "how important is each new KV pair?"
#    (`Scorer.score`): Fast KVzip's (the gate's output) and the baselines' (StreamingLLM, SnapKV,
#    random). KVzip's teacher, the other scorer, works on a whole context at once: teacher.py.
# =================================================================================================

class Scorer:
    """score(l, hidden, q, k, pos) -> (H, T) float32, higher = more important, for the T new tokens
    of compressed layer l. hidden (T, D) is the attention input; q (T, Hq, d) and k (T, H, d) are
    post-RoPE; pos (T,) absolute positions. During decoding the cache scores its buffered hidden
    states without q/k (q = k = None); scorers that need them say so.

    `level` names the eviction structure the scorer is meant for, in cache.EvictingCache's terms:
    "global" = one threshold over all layers × heads (the authors' "pair"), "head" = per-head top-k
    ("pair-head", uniform budget per head)."""
    level = "global"

    def __init__(self, n_kv_heads=None):
        self.n_kv_heads = n_kv_heads  # needed only by scorers that ignore q/k when q/k are None

    def _heads(self, k):
        if k is not None:
            return k.shape[1]
        assert self.n_kv_heads is not None, (f"{type(self).__name__}(n_kv_heads=...) is needed "
                                             "when k is None")
        return self.n_kv_heads

    def score(self, l, hidden, q, k, pos):
        raise NotImplementedError


class GateScorer(Scorer):
    """Fast KVzip: the gate's output. Meant for "global" (one threshold over all layers × heads,
    §6): gate scores are comparable across layers and heads because they are trained to the same
    targets."""
    level = "global"

    def __init__(self, gates):
        super().__init__(gates.n_kv_heads)
        self.gates = gates

    @torch.no_grad()
    def score(self, l, hidden, q, k, pos):
        return self.gates.score_layer(l, hidden)  # (H, T) fp32


class StreamingScorer(Scorer):
    """StreamingLLM: score = absolute position, so the most recent tokens survive; the first tokens
    (attention sinks, the system prompt) are protected by the cache itself. Identical across layers
    and heads, so every level gives the same result; "head" matches the baseline's per-head budget
    (§10). fp32 holds positions exactly up to 2^24 tokens."""
    level = "head"

    def score(self, l, hidden, q, k, pos):
        return pos.to(torch.float32).unsqueeze(0).expand(self._heads(k), -1).contiguous()


class RandomScorer(Scorer):
    """Uniform random scores from a seeded generator (a floor for every other scorer). Any level."""
    level = "head"

    def __init__(self, seed=0, n_kv_heads=None):
        super().__init__(n_kv_heads)
        self.generator = torch.Generator().manual_seed(seed)

    def score(self, l, hidden, q, k, pos):
        s = torch.rand(self._heads(k), pos.shape[0], generator=self.generator)
        return s.to(pos.device)


class SnapKVScorer(Scorer):
    """SnapKV as the authors run it in chunked prefill (METHOD.md §10,
    Janghyun1230/FastKVzip:prefill/attention/baseline.py:SnapKV), query-agnostic: the chunk's own
    last queries (the observation window) vote for the chunk's keys.

    - window = the last 32 queries of the chunk (16 while the sequence, current chunk included, is
      shorter than 1000 tokens: the authors test the key length of their retain cache, = pos[-1] +
      1);
    - keys = the first 4 keys of the sequence (chunks after the first only) ⊕ the chunk's keys. The
      cache hands a scorer only the new keys, so the scorer remembers each layer's first 4 keys when
      it sees the chunk that starts at position 0 (post-RoPE keys never change, so this is exact);
    - logits q·k·scale, MAX over the G query heads of each KV head on the logits, fp32 softmax over
      the keys, mean over the window queries, drop the 4 sink columns, max_pool1d(kernel 7, stride
      1, pad 3);
    - as in the authors' code there is no causal mask inside the window (window queries see the
      whole chunk); the window tokens themselves get the head's maximum + 1 so they are always kept.
    Meant for "head" (per-head top-k with k = int(n·r'), the authors' level for SnapKV). Prefill
    only: it needs the chunk's queries, so it refuses the query-less decoding call.
    scale: the model's attention scale (default 1/√d; Gemma3 uses query_pre_attn_scalar^-1/2)."""
    level = "head"

    def __init__(self, scale=None, window=32, short_window=16, short_len=1000, n_sink=4, kernel=7):
        super().__init__()
        self.scale, self.window, self.short_window, self.short_len = (
            scale, window, short_window, short_len)
        self.n_sink, self.kernel = n_sink, kernel
        self.sink_keys = {}  # compressed layer -> first n_sink keys of the sequence (n_sink, H, d)

    @torch.no_grad()
    def score(self, l, hidden, q, k, pos):
        if q is None or k is None:
            raise GateError("SnapKVScorer scores prefill chunks from their queries; it has no "
                            "decoding form here")
        T, Hq, d = q.shape
        H = k.shape[1]
        G = Hq // H
        if int(pos[0]) == 0:  # a new sequence: remember its first keys, no sink keys for this chunk
            self.sink_keys[l] = k[:self.n_sink].clone()
            sinks = k[:0]
        else:
            sinks = self.sink_keys.get(l, k[:0])
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


# =================================================================================================
# 3. Gate files
# =================================================================================================

LAYER_KEYS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight",
              "k_base", "b")
GATE_FORMAT = "fastkvzip-gate/1"
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GATES_DIR = Path(__file__).resolve().parent / "gates"  # gates bundled with the repository
RELEASED_REPO = "Jang-Hyun/Fast-KVzip"  # the authors' released gates on the HF hub (METHOD.md §2)
RELEASED_MODELS = ("qwen2.5-7b-instruct-1m", "qwen2.5-14b-instruct-1m", "qwen3-8b", "qwen3-14b",
                   "qwen3-8b-fp8", "qwen3-4b-instruct-2507", "gemma-3-12b-it")


def infer_dims(layers):
    """D', H, G, S and D from the authors' per-layer state dicts, as their loader does (§1.2),
    checking that every layer has every key with exactly the expected shape."""
    if not isinstance(layers, (list, tuple)) or not layers:
        raise GateError("gate file holds no per-layer state dicts")
    sd = layers[0]
    if not isinstance(sd, dict) or any(key not in sd or not torch.is_tensor(sd[key])
                                       for key in LAYER_KEYS):
        raise GateError(f"gate layer 0 must be a state dict with tensors {', '.join(LAYER_KEYS)}")
    for i, layer in enumerate(layers):  # the gate computes in its file's dtype, beside the model's
        for key in LAYER_KEYS:
            t = layer.get(key) if isinstance(layer, dict) else None
            if torch.is_tensor(t) and t.dtype not in GATE_DTYPES:
                raise GateError(f"gate layer {i}: {key} is {str(t.dtype).removeprefix('torch.')}; "
                                f"a gate holds float32, bfloat16 or float16 tensors")
    if sd["k_proj.weight"].dim() != 2 or sd["q_norm.weight"].dim() != 1 or 0 in (
            sd["k_proj.weight"].shape[0], sd["q_norm.weight"].shape[0]):
        raise GateError("gate layer 0: k_proj.weight must be (H·D', D) and q_norm.weight "
                        "(D',), D' > 0")
    Dp = sd["q_norm.weight"].shape[-1]
    HDp, D = sd["k_proj.weight"].shape
    H, G = HDp // Dp, sd["q_proj.weight"].shape[0] // HDp
    S = sd["k_base"].shape[2] if sd["k_base"].dim() == 4 else -1
    expected = {"q_proj.weight": (H * G * Dp, D), "q_proj.bias": (H * G * Dp,),
                "k_proj.weight": (H * Dp, D), "q_norm.weight": (Dp,), "k_norm.weight": (Dp,),
                "k_base": (H, 1, S, Dp), "b": (H, 1, G)}
    for i, layer in enumerate(layers):
        for key, shape in expected.items():
            got = tuple(layer[key].shape) if isinstance(layer, dict) and key in layer else None
            if got != shape:
                raise GateError(f"gate layer {i}: {key} has shape {got}, expected {shape} "
                                f"(D'={Dp}, H={H}, G={G}, S={S}, hidden {D})")
    if S < 1:
        raise GateError("gate has no sink keys (the authors' unused sink=0 variant): not supported")
    return dict(dim=Dp, n_kv_heads=H, group=G, sinks=S, hidden=D)


def _model_dims(cfg):
    group = getattr(cfg, "group_size", cfg.num_attention_heads // cfg.num_key_value_heads)
    return dict(layers=len(cfg.compressed_layers), hidden=cfg.hidden_size,
                H=cfg.num_key_value_heads, G=group)


def check_fits(dims, n_layers, cfg, source):
    """Refuse a gate shaped for another model, naming both shapes in one line."""
    want = _model_dims(cfg)
    have = dict(layers=n_layers, hidden=dims["hidden"], H=dims["n_kv_heads"], G=dims["group"])
    if have != want:
        fmt = lambda d: f"{d['layers']} layers, hidden {d['hidden']}, H={d['H']}, G={d['G']}"
        raise GateError(f"gate {source} does not fit the model: the file has {fmt(have)}; "
                        f"the model has {fmt(want)} (compressed layers, hidden size, KV "
                        "heads, group)")


# their Weight.state_dict(): own parameters, then q_proj, k_proj, the norms
AUTHORS_KEY_ORDER = ("k_base", "b", "q_proj.weight", "q_proj.bias", "k_proj.weight",
                     "q_norm.weight", "k_norm.weight")


def authors_file_name(gates):
    """The name the authors' loaders look for (METHOD.md §2): q{G}_dim{D'}_sink{S}.pt. Keep it:
    kvpress reads the number of sink keys from "sink(\\d+)" in the name, not from the tensors."""
    return f"q{gates.group}_dim{gates.dim}_sink{gates.sinks}.pt"


def save_gate(path, gates, meta=None, curves=None):
    """Write `gates` to `path`, atomically (cli.atomic_path), in one of two layouts:
    - safetensors (any other suffix): per-layer tensors `layers.{i}.<authors' key>` in the authors'
      shapes and dtypes, plus JSON metadata in the header under "fastkvzip". meta: free-form
      JSON-able dict; conventional keys "model" (id), "layers" (compressed layer ids), "training"
      (summary).
    - the authors' layout (`path` ends in .pt, METHOD.md §2), which their code and kvpress's
      FastKVzipPress load: torch.save({"module": [layer l's state dict, in their key order]}), with
      the validation curves "loss" and "acc", (evaluations, layers), when `curves` = (loss, acc) is
      given. Only tensors inside, so torch.load(weights_only=True) reads it; `meta` does not travel
      in this layout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".pt":
        layers = []
        for l in range(gates.n_layers):
            sd = gates.layer_state_dict(l)
            layers.append({key: sd[key].to("cpu").clone().contiguous()
                           for key in AUTHORS_KEY_ORDER})
        obj = {"module": layers}
        if curves is not None:
            obj["loss"], obj["acc"] = (torch.tensor(c, dtype=torch.float32) for c in curves)
        with atomic_path(path) as tmp:
            torch.save(obj, tmp)
        return
    tensors = {f"layers.{l}.{key}": t.to("cpu").clone().contiguous()  # clone: no shared storage
               for l in range(gates.n_layers) for key, t in gates.layer_state_dict(l).items()}
    header = dict(meta or {})
    header.update(format=GATE_FORMAT, n_layers=gates.n_layers, hidden_size=gates.hidden,
                  n_kv_heads=gates.n_kv_heads, group=gates.group, dim=gates.dim, sinks=gates.sinks,
                  dtype=str(gates.dtype).removeprefix("torch."), bias="added once")
    with atomic_path(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp),
                                    metadata={"format": "pt", "fastkvzip": json.dumps(header)})


def gate_metadata(path):
    """The JSON metadata of one of our gate files, without reading its tensors ({} if it has
    none)."""
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("fastkvzip", "{}"))


def _read_safetensors(path):
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("fastkvzip", "{}"))
            if not isinstance(meta, dict):
                raise GateError(f"gate {path}: its \"fastkvzip\" metadata is a JSON "
                                f"{type(meta).__name__}, not an object")
            layers = {}
            for name in f.keys():
                m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
                if m is None:
                    raise GateError(f"gate {path}: unexpected tensor {name!r} (want "
                                    "layers.<i>.<key>)")
                layers.setdefault(int(m.group(1)), {})[m.group(2)] = f.get_tensor(name)
    except GateError:
        raise
    except Exception as e:  # a corrupt or foreign file
        raise GateError(f"gate {path} is not a readable safetensors gate ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if sorted(layers) != list(range(len(layers))):
        raise GateError(f"gate {path}: layer indices {sorted(layers)} are not 0..{len(layers) - 1}")
    return [layers[i] for i in range(len(layers))], meta


def _numpy_safe_globals():
    """The only non-torch globals a released gate file needs: numpy arrays (the "loss"/"acc" curves)
    and numpy scalars of plain numeric dtypes, under both numpy 1 and numpy 2 module names. Nothing
    here runs code: the array contents are bytes, and any other global in the pickle is still
    refused."""
    import numpy as np
    try:
        from numpy._core import multiarray as ma  # numpy >= 2
    except ImportError:
        from numpy.core import multiarray as ma
    dtypes = [getattr(np.dtypes, n) for n in ("Float16DType", "Float32DType", "Float64DType",
                                              "Int8DType", "Int16DType", "Int32DType", "Int64DType",
                                              "UInt8DType", "BoolDType") if hasattr(np.dtypes, n)]
    return [np.ndarray, np.dtype, *dtypes, ma._reconstruct, ma.scalar,
            # files written under numpy 1 name the same functions numpy.core.multiarray.*
            (ma._reconstruct, "numpy.core.multiarray._reconstruct"),
            (ma.scalar, "numpy.core.multiarray.scalar")]


def _read_authors_pt(path):
    """The authors' released file (METHOD.md §2): torch.save({"module": [state dict per gate layer],
    "loss": ..., "acc": ...}). Loaded with weights_only=True: a pickle that would import anything
    beyond tensors, containers and numpy arrays is refused before it can run."""
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        bad = re.findall(r"GLOBAL (\S+)", str(e)) or re.findall(r"got <class '([^']+)'>", str(e))
        raise GateError(f"refusing to load {path}: its pickle would import "
                        f"{', '.join(bad) or 'unsafe objects'}, which could run code (only tensors "
                        "and numpy arrays are allowed)") from None
    except Exception as e:
        raise GateError(f"gate {path} is not a readable torch file ({type(e).__name__})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("module"), (list, tuple)):
        raise GateError(f"gate {path}: expected a dict with a 'module' list of per-layer "
                        "state dicts")
    meta = {"format": "authors-pt"}
    # validation curves (steps/50, n_layers): keep the final value per layer
    for key in ("loss", "acc"):
        curve = obj.get(key)
        if getattr(curve, "ndim", 0) == 2 and len(curve):
            meta[f"val_{key}_final"] = [float(v) for v in curve[-1]]
    return [dict(sd) for sd in obj["module"]], meta


def _file_kind(path):
    """"safetensors", "torch" or None, decided strictly. A safetensors file is its own check: an
    8-byte little-endian header length N, then N bytes of JSON object inside the file. Only a file
    that fails it is taken for torch.save output: a zip ("PK\\x03\\x04") or, in the legacy format, a
    raw pickle (protocol byte 0x80). (Sniffing the first bytes alone misreads the ~1 in 256
    safetensors files whose header length starts with byte 0x80.)"""
    with open(path, "rb") as f:
        head = f.read(9)
        size = os.fstat(f.fileno()).st_size
    if len(head) == 9 and head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= size:
        return "safetensors"
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "torch"
    # a cut safetensors file: its reader says so
    return "safetensors" if head[8:9] == b"{" else None


def load_gate(path, cfg, dtype=None, device=None):
    """Load a gate for model config `cfg` from our safetensors format or the authors' .pt format.
    dtype None keeps the file's projection dtype (bf16 for released gates). Returns `Gates` with
    `.meta` holding the file's metadata. Raises GateError if the file is unsafe, malformed or shaped
    for another model (compressed-layer count, hidden size, KV heads, group size)."""
    path = Path(path)
    try:
        if not path.exists():
            raise GateError(f"gate file not found: {path}")
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise GateError(f"gate {path} is a folder, not a gate file")
        if stat.S_ISCHR(mode):  # /dev/null reads as empty, /dev/zero as endless zeros
            with open(path, "rb") as f:
                empty = not f.read(1)
        else:
            empty = stat.S_ISREG(mode) and path.stat().st_size == 0
        if empty:
            raise GateError(f"gate {path} is empty (0 bytes): not a gate file")
        if not stat.S_ISREG(mode):
            raise GateError(f"gate {path} is not a regular file (a device or a pipe)")
        kind = _file_kind(path)
    # also pathlib's PermissionError for a path inside a folder this user may not read
    except OSError as e:
        raise GateError(f"cannot read gate {path}: {e.strerror or e}") from None
    if kind == "safetensors":
        layers, meta = _read_safetensors(path)
    elif kind == "torch":
        layers, meta = _read_authors_pt(path)
    else:
        raise GateError(f"gate {path} is neither a safetensors file nor a torch.save file (the "
                        "authors' .pt)")
    dims = infer_dims(layers)
    # a diverged training writes NaN; a NaN score would evict at random
    for i, layer in enumerate(layers):
        for key in LAYER_KEYS:
            if not torch.isfinite(layer[key]).all():
                raise GateError(f"gate {path}: layer {i} {key} holds NaN or inf values; the gate "
                                f"is broken (retrain it, or pass another --gate)")
    check_fits(dims, len(layers), cfg, path)
    m = re.search(r"sink(\d+)", path.name)  # the authors' file names carry S (q4_dim16_sink16.pt)
    if m and int(m.group(1)) != dims["sinks"]:
        raise GateError(f"gate {path}: the name says {m.group(0)} but k_base holds "
                        f"{dims['sinks']} sink keys")
    ids = meta.get("layers")
    if ids is not None and not (isinstance(ids, list) and all(type(i) is int for i in ids)):
        raise GateError(f"gate {path}: its metadata's \"layers\" must be a list of layer ids, got "
                        f"{ids!r:.60}")
    if ids is not None and ids != list(cfg.compressed_layers):
        raise GateError(f"gate {path} was trained for layers {list(ids)}; the model "
                        f"compresses layers {list(cfg.compressed_layers)}")
    gates = Gates.from_layer_state_dicts(layers, dtype=dtype, device=device)
    gates.meta = {**meta, "source": str(path), "tensors_sha256": _tensors_sha256(layers)}
    return gates


def tensors_sha256(path):
    """sha256 of a gate file's tensors, the part that decides every score: a result names its gate
    by it, since the file's own sha256 also covers the metadata (a training summary, a corpus hash
    added later), and the same gate saved as .safetensors and as the authors' .pt hashes the
    same."""
    layers, _ = (_read_safetensors(path) if _file_kind(path) == "safetensors"
                 else _read_authors_pt(path))
    return _tensors_sha256(layers)


def _tensors_sha256(layers):
    h = hashlib.sha256()
    for i, layer in enumerate(layers):  # each tensor: its layer, key, dtype, shape, then its bytes
        for key in sorted(layer):
            t = layer[key].detach().to("cpu").contiguous()
            h.update(f"{i}.{key} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}\n".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def bundled_gate_path(model_name):
    """Where the repository bundles the gate of `model_name`: gates/<model slug>.safetensors (it may
    not exist)."""
    return GATES_DIR / f"{_model_slug(model_name)}.safetensors"


def _model_slug(model_name):
    """The authors' naming: the last path component, lower-cased (Qwen/Qwen3-8B -> qwen3-8b), of the
    repo id an alias stands for (qwen2.5-7b-1m -> Qwen/Qwen2.5-7B-Instruct-1M ->
    qwen2.5-7b-instruct-1m)."""
    name = ALIASES.get(str(model_name).lower(), str(model_name))
    return name.rstrip("/").split("/")[-1].lower()


def resolve_gate(arg, cfg, model_name, dtype=None, device=None):
    """Find the gate for a model: an explicit path (`arg`); else the gate bundled in the repository
    (gates/<model slug>.safetensors, e.g. gates/gemma3-270m-gguf.safetensors for the default model);
    else the authors' released gate for the models they published (downloaded from the HF hub).
    Anything else -> GateError telling how to get one."""
    if arg:
        return load_gate(arg, cfg, dtype, device)
    slug = _model_slug(model_name)
    bundled = bundled_gate_path(model_name)
    if bundled.is_file():
        return load_gate(bundled, cfg, dtype, device)
    how = f"train one with `python train_gate.py --model {model_name}` or pass --gate PATH"
    if slug not in RELEASED_MODELS:
        raise GateError(f"no gate for model {model_name!r} (none bundled in {GATES_DIR}, none "
                        f"released); {how}")
    filename = f"{slug}/q{_model_dims(cfg)['G']}_dim16_sink16.pt"  # METHOD.md §2
    try:
        from huggingface_hub import hf_hub_download
        local = hf_hub_download(repo_id=RELEASED_REPO, filename=filename, repo_type="model")
    except Exception as e:  # offline, missing file, no hub client
        raise GateError(f"could not download the released gate {RELEASED_REPO}/{filename} "
                        f"({type(e).__name__}); {how}") from None
    return load_gate(local, cfg, dtype, device)
