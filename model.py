"""Qwen3, Gemma3 (text), Llama and Qwen2 decoders in plain PyTorch, loaded straight from Hugging
Face checkpoints.

No transformers at run time: module names equal the checkpoint's tensor names, so weights load with
safetensors + `load_state_dict(assign=True)` onto a model built on the meta device. Tokens are flat,
(T,): one sequence's T tokens, or one token of each of the T sequences of a batch (batched decoding:
serving/batch.py). Every attention layer goes through ONE call,
`cache.attend(layer, q, k, v, hidden, scale, window)` (cache.py): the cache decides what is kept and
scores it; the model never knows.

Qwen3 (`model_type` "qwen3"):
- RMSNorm `w * norm(x)` (normalised in fp32, cast back BEFORE the multiply); pre-norm blocks.
- QK-norm: an RMSNorm over head_dim on q and k, before RoPE.
- GQA / MQA: num_key_value_heads divides num_attention_heads; query head h*G+g reads KV head h.
- RoPE (rotate_half), rope_theta 1e6 in released models; `yarn` scaling (the authors run Qwen3-8B
  with factor 4 over an original 32768 positions, METHOD.md §9), including its cos/sin attention
  factor.
- SwiGLU MLP; scale head_dim**-0.5; tied (small models) or untied embeddings.

Gemma3 (`model_type` "gemma3_text", or "gemma3" multimodal whose text decoder we load):
- RMSNorm `norm(x) * (1 + w)` computed in fp32; FOUR norms per block ("sandwich": before and after
  both attention and MLP) plus QK-norm (same (1+w) form) before RoPE.
- Embeddings multiplied by sqrt(hidden_size), the factor first rounded to the weight dtype.
- Sliding-window layers (a window of W keys including the current one) interleaved 5:1 with global
  layers; two RoPE bases (1e4 local, 1e6 global), `linear` scaling on global layers of the >= 4B
  models.
- Attention scale query_pre_attn_scalar**-0.5; tanh-GELU MLP; optional final logit soft-capping.
  attn_logit_softcapping is NOT applied (transformers 5.24 ignores it too).

Llama (`model_type` "llama": Llama 3.x, SmolLM2) and Qwen2 ("qwen2": Qwen2.5) are Qwen3 without
QK-norm:
- Llama: optional bias on all four attention projections (attention_bias) and on the MLP
  (mlp_bias); Llama 3.1's `llama3` RoPE scaling (low frequencies divided by the factor, high ones
  kept, a smooth blend between).
- Qwen2: bias on q/k/v (always), none on o_proj.

This module trusts its checkpoint and states what it assumes as asserts; formats/checkpoint.py
checks a folder first and refuses a bad one with one ModelError line (what the programs call).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn

# -------------------------------------------------------------------------------------------- norms

class RMSNorm(nn.Module):
    """Qwen3: w * norm(x).to(dtype).
    Gemma3 (unit_offset): (norm(x) * (1 + w)) in fp32, then cast."""

    def __init__(self, dim: int, eps: float, unit_offset: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # in place: h is this call's own tensor (x * c is a new one), and w·h = h·w exactly
        if self.unit_offset:  # Gemma: the multiply happens in fp32 too
            return h.mul_(1.0 + self.weight.float()).type_as(x)
        # Qwen: cast first, then the (possibly bf16) weight
        return h.to(x.dtype).mul_(self.weight)


# --------------------------------------------------------------------------------------------- rope

def rope_inv_freq(p: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) and the cos/sin attention factor for one RoPE dict.
    Mirrors transformers' default / linear / llama3 / yarn initialisers value for value."""
    base, dim = p["rope_theta"], head_dim
    # explicit device: the model may be built under torch.device("meta"), these must be real numbers
    exps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim  # (dim/2,)
    if p["rope_type"] == "default":
        return 1.0 / (base ** exps), 1.0
    if p["rope_type"] == "linear":  # position interpolation: positions / factor
        return 1.0 / (base ** exps) / p["factor"], 1.0
    if p["rope_type"] == "llama3":
        # Llama 3.1: wavelengths beyond orig/low_freq_factor are interpolated, those below
        # orig/high_freq_factor kept, a linear blend in between
        inv_freq = 1.0 / (base ** exps)
        orig, factor, low, high = (p[k] for k in ("original_max_position_embeddings", "factor",
                                                  "low_freq_factor", "high_freq_factor"))
        wavelen = 2 * math.pi / inv_freq
        smooth = ((orig / wavelen - low) / (high - low)).clamp(0, 1)  # 0 = interpolate, 1 = keep
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    # yarn (arXiv 2309.00071): interpolate low frequencies, keep high ones, blend on a linear ramp
    assert p["rope_type"] == "yarn", f"unsupported rope_type {p['rope_type']!r}"
    orig, factor = p["original_max_position_embeddings"], p["factor"]  # factor: context extension

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:  # scales cos and sin, i.e. the logits by its square
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (mscale(factor, m) / mscale(factor, m_all) if m and m_all
                            else mscale(factor))

    def correction_dim(n_rotations: float) -> float:  # the dim that turns n times over orig tokens
        return dim * math.log(orig / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # avoid a zero-width ramp
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ramp = ramp.clamp(0, 1)
    pos_freqs = base ** exps
    keep = 1 - ramp  # 1 = extrapolate (high frequency, unchanged), 0 = interpolate (/ factor)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention_factor)


class Rotary(nn.Module):
    """cos/sin tables for one layer type, computed per call from absolute positions."""

    def __init__(self, p: dict, head_dim: int):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(p, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # not a checkpoint tensor

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # (T, d/2), fp32 like transformers
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, d): rotate_half layout, halves share one
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, d); cos, sin (T, d) -> x·cos + rotate_half(x)·sin, rotate_half(x) = (-x2, x1) for
    the halves x1, x2 of x (transformers' layout). Written half by half into x·cos, so that the
    negated copy and the concatenation are never built: the same numbers, since (-a)·b = -(a·b)
    and c + (-e) = c - e exactly."""
    h = x.shape[-1] // 2
    out = x * cos[:, None, :]                        # (T, H, d)
    out[..., :h] -= x[..., h:] * sin[:, None, :h]    # x1·cos - x2·sin
    out[..., h:] += x[..., :h] * sin[:, None, h:]    # x2·cos + x1·sin
    return out


# ---------------------------------------------------------------------------------------- attention

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d, bias = cfg.head_dim, cfg.qkv_bias
        self.layer, self.head_dim = layer, d
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.scale, self.window = cfg.attn_scale, cfg.window(layer)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, unit_offset=cfg.arch == "gemma3")
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, unit_offset=cfg.arch == "gemma3")

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache) -> torch.Tensor:
        """h (T, D): the attention input (after input_layernorm), also handed to the cache (the
        gate's input)."""
        T = h.shape[0]
        q = self.q_proj(h).view(T, self.n_heads, self.head_dim)  # (T, Hq, d)
        k = self.k_proj(h).view(T, self.n_kv_heads, self.head_dim)  # (T, Hkv, d)
        v = self.v_proj(h).view(T, self.n_kv_heads, self.head_dim)  # (T, Hkv, d)
        if self.qk_norm:  # Qwen3, Gemma3: QK-norm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = cache.attend(self.layer, q, k, v, h, self.scale, self.window)  # (T, Hq, d)
        return self.o_proj(out.reshape(T, self.n_heads * self.head_dim))  # (T, D)


# ---------------------------------------------------------------------------------------------- mlp

class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x));
    act = SiLU (Qwen3, Llama, Qwen2) or tanh-GELU (Gemma3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.hidden_act in ACTIVATIONS, f"unsupported activation {cfg.hidden_act!r}"
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in place on the projection's own output: two (T, I) tensors fewer to write
        g = self.gate_proj(x)  # (T, I)
        g = F.gelu(g, approximate="tanh", out=g) if self.gelu else F.silu(g, inplace=True)
        return self.down_proj(g.mul_(self.up_proj(x)))  # (T, D)


# -------------------------------------------------------------------------------------------- block

class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        gemma, eps, D = cfg.arch == "gemma3", cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(D, eps, gemma)
        # Qwen3: the pre-MLP norm, despite its name
        self.post_attention_layernorm = RMSNorm(D, eps, gemma)
        # Gemma3 also normalises each sub-layer's OUTPUT before the residual add
        self.sandwich = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(D, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(D, eps, gemma)

    def forward(self, x: torch.Tensor, rope, cache) -> torch.Tensor:
        if self.sandwich:
            h = self.self_attn(self.input_layernorm(x), rope, cache)
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), rope, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# -------------------------------------------------------------------------------------------- model

class Decoder(nn.Module):
    """The checkpoint's `model.*`: embeddings, blocks, final norm
    (and the RoPE tables, not stored)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.arch == "gemma3")
        self.rotary = nn.ModuleDict({t: Rotary(cfg.rope[t], cfg.head_dim)
                                     for t in sorted(set(cfg.layer_types))})


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:  # lm_head reads the (unscaled) embedding matrix
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, cache=None,
                num_logits: int | None = None) -> torch.Tensor:
        """input_ids (T,) -> logits (T, vocab) float32, or (num_logits, vocab) for the last
        positions. Positions come from the cache: one sequence's next T (cache.n_seen on), or, for a
        batch (serving/batch.py), each member's next position (one token per member); cache None = a
        temporary full KVCache."""
        assert input_ids.dim() == 1, \
            f"flat tokens only: pass input_ids of shape (T,), got {tuple(input_ids.shape)}"
        cfg, emb = self.config, self.model.embed_tokens.weight
        if cache is None:
            from cache import KVCache  # lazy: only a forward without a cache needs one
            cache = KVCache(cfg, emb.dtype, emb.device)
        T = input_ids.shape[0]
        pos = cache.positions(T)  # (T,) absolute positions
        x = self.model.embed_tokens(input_ids)  # (T, D)
        if cfg.arch == "gemma3":  # sqrt(D) rounded to the weight dtype first (bf16: 34, not 33.94)
            x = x * torch.tensor(cfg.hidden_size ** 0.5).to(emb.dtype)
        # layer type -> (cos, sin), each (T, d)
        rope = {t: r(pos, x.dtype) for t, r in self.model.rotary.items()}
        for layer, block in enumerate(self.model.layers):
            x = block(x, rope[cfg.layer_types[layer]], cache)  # (T, D)
        cache.advance(T)
        if num_logits is not None:  # a 16K-token prefill must not build (16K, vocab) logits
            x = x[T - num_logits:]  # (n, D); n = 0 gives no logits at all
        logits = self.lm_head(self.model.norm(x))  # (n, V)
        if cfg.final_logit_softcapping:
            c = cfg.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits.float()


# ------------------------------------------------------------------------------------------- config

class ModelError(Exception):
    """Bad model input (folder, config, weights, tokenizer);
    the message is one line that says how to fix it."""


class NonFiniteLogits(ModelError):
    """Logits that turned inf/NaN while answering (generate.next_token): the compute dtype's range
    may be too small."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# transformers' defaults for keys a config.json may omit (Qwen3Config / Gemma3TextConfig, 5.24).
# Published Gemma3 multimodal configs rely on them: their text_config lists only a few sizes.
_DEFAULTS = {
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, head_dim=128, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  sliding_window=4096, max_window_layers=28, rope_theta=10000.0,
                  bos_token_id=None, eos_token_id=None),
    "gemma3": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                   rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   bos_token_id=2, eos_token_id=1),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, sliding_window=4096, max_window_layers=28,
                  rope_theta=10000.0, bos_token_id=None, eos_token_id=None),
}
_ARCHS = {"qwen3": "qwen3", "gemma3_text": "gemma3", "gemma3": "gemma3", "llama": "llama",
          "qwen2": "qwen2"}
# <|im_end|> / <end_of_turn>: chat models stop on them (Llama 3 lists <|eot_id|> in its
# generation_config)
_END_OF_TURN = {"qwen3": 151645, "qwen2": 151645, "gemma3": 106}
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# the chat layout a tokenizer's own template writes, by its turn marker,
# and each family's when it has none
_CHAT_MARKERS = (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"),
                 ("<start_of_turn>", "gemma"))
_FAMILY_CHAT = {"qwen3": "chatml", "qwen2": "chatml", "llama": "llama3", "gemma3": "gemma"}


@dataclass
class ModelConfig:
    arch: str                     # "qwen3" | "gemma3" | "llama" | "qwen2": norm form, MLP, biases
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int                 # not always hidden/heads: Gemma3 270M, 4 heads x 256 on 640
    rms_norm_eps: float
    hidden_act: str               # "silu" (Qwen3) | "gelu_pytorch_tanh" (Gemma3)
    layer_types: list[str]        # per layer: "full_attention" | "sliding_attention"
    sliding_window: int | None    # W keys including the current one, on sliding layers only
    rope: dict[str, dict]         # layer type -> {"rope_type", "rope_theta", "factor", ...}
    max_position_embeddings: int
    query_pre_attn_scalar: float  # attention scale = this**-0.5 (Qwen3: head_dim)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c) when set
    attention_bias: bool = False  # bias on q/k/v/o (False in released models)
    qkv_bias: bool = False        # bias on q/k/v: Qwen2 always, the others with attention_bias
    mlp_bias: bool = False        # bias on the MLP's three projections (Llama's mlp_bias)
    qk_norm: bool = True          # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma3)
    chat_format: str = "chatml"   # "chatml" | "llama3" | "gemma": the tokenizer template's layout
    # whether the tokenizer has a chat template: False for a tokenizer_config.json without one (a
    # base model, as the offline Gemma 3 270M), None when the folder has no tokenizer_config.json
    chat_template: bool | None = None
    tie_word_embeddings: bool = False  # lm_head shares model.embed_tokens.weight
    # stop ids: config + generation_config + end of turn
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def group_size(self) -> int:
        """G = query heads per KV head (GQA; 1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def compressed_layers(self) -> list[int]:
        """Layers whose KV is scored and evicted:
        every layer; Gemma3's global layers only (METHOD.md §9)."""
        if self.arch == "gemma3":
            return [layer for layer, t in enumerate(self.layer_types) if t == "full_attention"]
        return list(range(self.num_hidden_layers))

    @property
    def attn_scale(self) -> float:
        """Softmax scale of every attention layer (every family uses one scale for all layers)."""
        return self.query_pre_attn_scalar ** -0.5

    def window(self, layer: int) -> int | None:
        """Sliding window W of layer `layer`, None on full-attention layers."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """config.json (or its folder); eos ids from a sibling generation_config.json are merged
        in, the chat layout is read from the tokenizer's own template when the folder has one."""
        path = Path(path)
        path = path / "config.json" if path.is_dir() else path
        gen_path = path.parent / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        cfg = cls.from_dict(json.loads(path.read_text()), gen)
        template = chat_template(path.parent)
        cfg.chat_template = None if template is None else bool(template.strip())
        cfg.chat_format = next((fmt for marker, fmt in _CHAT_MARKERS if marker in (template or "")),
                               cfg.chat_format)
        return cfg

    @classmethod
    def from_dict(cls, d: dict, generation_config: dict | None = None) -> "ModelConfig":
        """Accepts both transformers-5 keys (rope_parameters, layer_types) and the legacy keys of
        released checkpoints (rope_theta, rope_local_base_freq, rope_scaling,
        sliding_window_pattern)."""
        eos = _ids(d.get("eos_token_id")) + _ids((generation_config or {}).get("eos_token_id"))
        arch, d = config_keys(d)
        assert arch is not None, f"unsupported model_type {d.get('model_type')!r}"
        assert not d.get("use_bidirectional_attention"), "a causal decoder, not EmbeddingGemma"
        n_layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        assert heads % kv_heads == 0, "every KV head serves the same number of query heads"

        if arch == "gemma3":
            window = d["sliding_window"]
            pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
            derived = ["full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
                       for layer in range(n_layers)]
        else:  # Qwen3/Qwen2 slide only with use_sliding_window (never in released checkpoints)
            window = d["sliding_window"] if d.get("use_sliding_window") else None
            derived = ["sliding_attention" if window and layer >= d["max_window_layers"]
                       else "full_attention" for layer in range(n_layers)]
        layer_types = list(d.get("layer_types") or derived)
        assert len(layer_types) == n_layers, "one layer type per layer"

        eos += _ids(d["eos_token_id"])  # the text config's own (or the family default)
        end_of_turn = _END_OF_TURN.get(arch)
        if end_of_turn is not None and end_of_turn < d["vocab_size"]:  # not in tiny vocabularies
            eos.append(end_of_turn)
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        return cls(
            arch=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=n_layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=d["rms_norm_eps"],
            hidden_act=d.get("hidden_activation") or d["hidden_act"],
            layer_types=layer_types, sliding_window=window, rope=rope_parameters(arch, d),
            max_position_embeddings=d["max_position_embeddings"],
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") or head_dim,
            final_logit_softcapping=d.get("final_logit_softcapping") if arch == "gemma3" else None,
            attention_bias=bool(d.get("attention_bias", False)),
            qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=arch in ("qwen3", "gemma3"),
            chat_format=_FAMILY_CHAT[arch],
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            eos_token_ids=sorted(set(eos)), bos_token_id=d.get("bos_token_id"))


def config_keys(d: dict) -> tuple[str | None, dict]:
    """config.json -> (family, its keys over the family's defaults); a Gemma3 multimodal config's
    text decoder (with the top level's token ids). Family None for an unsupported model_type, d
    then as given."""
    if d.get("model_type") == "gemma3" and "text_config" in d:  # multimodal: the text decoder only
        d = {"model_type": "gemma3_text", **{k: v for k, v in d.items() if k.endswith("token_id")},
             **(d["text_config"] or {})}
    arch = _ARCHS.get(d.get("model_type"))
    if arch is None:
        return None, d
    return arch, {**_DEFAULTS[arch], **{k: v for k, v in d.items() if v is not None}}


def _ids(x) -> list[int]:
    """An eos_token_id (one id, a list, or None) as a list."""
    return [] if x is None else x if isinstance(x, list) else [x]


def chat_template(folder: Path) -> str | None:
    """The tokenizer's own chat template (tokenizer_config.json's chat_template, and
    chat_template.jinja): "" when tokenizer_config.json has none, None when neither file is there.
    SmolLM2 is a Llama whose template is ChatML: the template, not the architecture, decides the
    prompt, and a model without one is a base model."""
    template, path = None, folder / "tokenizer_config.json"
    if path.is_file():
        t = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(t, list):  # named templates: [{"name": ..., "template": ...}]
            t = " ".join(x["template"] for x in t)
        template = t or ""
    if (folder / "chat_template.jinja").is_file():
        template = (template or "") + (folder / "chat_template.jinja").read_text(errors="replace")
    return template


def rope_parameters(arch: str, d: dict) -> dict[str, dict]:
    """One RoPE dict per layer type, the way transformers 5.24 standardises old and new configs."""
    def clean(p: dict | None, theta: float) -> dict:
        p = dict(p or {})
        p["rope_type"] = p.get("rope_type") or p.pop("type", None) or "default"
        p.setdefault("rope_theta", theta)
        if p["rope_type"] in ("yarn", "llama3"):  # pre-training length; a top-level key wins
            orig = p["original_max_position_embeddings"] = (
                d.get("original_max_position_embeddings")
                or p.get("original_max_position_embeddings") or d["max_position_embeddings"])
            if p["rope_type"] == "yarn":
                p["factor"] = p.get("factor") or d["max_position_embeddings"] / orig
        return p

    rp = d.get("rope_parameters")
    if arch != "gemma3":  # one RoPE for every layer
        p = clean(rp if rp else d.get("rope_scaling"), d["rope_theta"])
        return {"full_attention": p, "sliding_attention": p}
    if rp:  # Gemma3, transformers-5 form: nested per layer type
        return {"full_attention": clean(rp.get("full_attention"), d["rope_theta"]),
                "sliding_attention": clean(rp.get("sliding_attention"),
                                           d["rope_local_base_freq"])}
    # legacy Gemma3: rope_scaling (linear x8 on >= 4B) applies to global layers only; local base 1e4
    return {"full_attention": clean(d.get("rope_scaling"), d["rope_theta"]),
            "sliding_attention": clean(None, d["rope_local_base_freq"])}


# ------------------------------------------------------------------------------------------ loading

# where the text decoder's tensors live in Gemma3 multimodal checkpoints -> our names
_RENAMES = (("language_model.model.", "model."),  # transformers < 4.52 (the released checkpoints)
            ("model.language_model.", "model."),  # transformers >= 4.52
            ("language_model.lm_head.", "lm_head."))
_SKIP = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
         "model.multi_modal_projector.")


def checkpoint_name(key: str) -> str | None:
    """A checkpoint tensor's name -> ours; None for the vision tower's tensors."""
    for old, new in _RENAMES:
        if key.startswith(old):
            return new + key[len(old):]
    return None if key.startswith(_SKIP) else key


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names, or every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index maps tensor name -> shard file
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """A --dtype flag -> torch dtype;
    None: bf16 on GPU, fp32 on CPU (whose bf16 matmuls are emulated)."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(folder: str | Path, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None) -> Transformer:
    """Build on the meta device, then assign the checkpoint's tensors shard by shard (never two
    copies). dtype None: compute_dtype's default for the device."""
    folder = Path(folder).expanduser()
    cfg = ModelConfig.from_json(folder / "config.json")
    device = torch.device(device) if device is not None else default_device()
    device = torch.device("cpu") if device.type == "cpu" else device  # safetensors refuses "cpu:0"
    dtype = dtype or compute_dtype(None, device)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k for k in model.state_dict()
                if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    loaded = set()
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            names = {key: checkpoint_name(key) for key in f.keys()}
            # store-bf16 -> fp32 on CPU
            tensors = {name: f.get_tensor(key).to(dtype) for key, name in names.items()
                       if name in expected}
        model.load_state_dict(tensors, strict=False, assign=True)  # shapes checked here
        loaded |= tensors.keys()
        del tensors
    assert loaded == expected, f"{folder}: no weights for {sorted(expected - loaded)[:3]}"
    model.tie_weights()  # assign=True replaced embed_tokens.weight: tie again
    model = model.to(device).eval().requires_grad_(False)  # .to moves the RoPE buffers built on CPU
    model.identity = model_identity(folder)  # what a saved cache checks before it is answered from
    return model


def model_identity(folder: str | Path) -> dict[str, str | None]:
    """Which model a saved KV cache belongs to (formats.cache_file.load_cache checks): sha256 of
    config.json (as JSON), of tokenizer.json (None without one) and of a weight sample: each file's
    name, size and first, middle and last MiB (the first holds its header), enough to tell two
    fine-tunes of one config apart in milliseconds where hashing every weight takes a minute."""
    folder, h, piece = Path(folder).expanduser(), hashlib.sha256(), 2**20
    config = json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True)
    tok = folder / "tokenizer.json"
    tok_sha256 = hashlib.sha256(tok.read_bytes()).hexdigest() if tok.is_file() else None
    out = {"config_sha256": hashlib.sha256(config.encode()).hexdigest(),
           "tokenizer_sha256": tok_sha256}
    for path in weight_files(folder):
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            h.update(f"{path.name}\t{size}\n".encode())
            for start in [0] if size <= 3 * piece else [0, size // 2, size - piece]:
                f.seek(start)
                h.update(f.read(size if size <= 3 * piece else piece))
    out["weights_sha256"] = h.hexdigest()
    return out


# --------------------------------------------------------------------------------------- tokenizer
# User text is data. A context, a question, a --batch request or a training document may hold the
# text of a control token ("<|im_end|>\n<|im_start|>assistant", "<end_of_turn>"): parsed, it would
# end the user's turn and write the model's, and Gemma 3's "<image_soft_token>" (id 262144 in the
# published tokenizer.json, whose config says vocab_size 262144) would index past the embedding.
# So user text is encoded with the tokenizer's special tokens left unparsed (prompts.encode_text),
# and only a template's own control tokens (prompts.CONTROL_TOKENS) become control ids
# (prompts.encode_prompt). formats/checkpoint.py refuses another model's tokenizer.

def load_tokenizer(folder: str | Path) -> Tokenizer:
    """tokenizers.Tokenizer from the folder's tokenizer.json;
    encode with prompts.encode_text / encode_prompt."""
    return Tokenizer.from_file(str(Path(folder).expanduser() / "tokenizer.json"))
