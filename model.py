"""Qwen3, Gemma3 (text), Llama and Qwen2 decoders in plain PyTorch, loaded straight from Hugging Face
checkpoints.

No transformers at run time: module names equal the checkpoint's tensor names, so weights load with
safetensors + `load_state_dict(assign=True)` onto a model built on the meta device. Tokens are flat, (T,):
one sequence's T tokens, or one token of each of the T sequences of a `cache.Batch` (batched decoding).
Every attention layer goes through ONE call, `cache.attend(layer, q, k, v, hidden, scale, window)`
(cache.py): the cache decides what is kept and scores it; the model never knows.

Qwen3 (`model_type` "qwen3"):
- RMSNorm `w * norm(x)` (normalised in fp32, cast back BEFORE the multiply); pre-norm blocks.
- QK-norm: an RMSNorm over head_dim on q and k, before RoPE.
- GQA / MQA: num_key_value_heads divides num_attention_heads; query head h*G+g reads KV head h.
- RoPE (rotate_half), rope_theta 1e6 in released models; `yarn` scaling (the authors run Qwen3-8B with
  factor 4 over an original 32768 positions, METHOD.md §9), including its cos/sin attention factor.
- SwiGLU MLP; scale head_dim**-0.5; tied (small models) or untied embeddings.

Gemma3 (`model_type` "gemma3_text", or "gemma3" multimodal whose text decoder we load):
- RMSNorm `norm(x) * (1 + w)` computed in fp32; FOUR norms per block ("sandwich": before and after
  both attention and MLP) plus QK-norm (same (1+w) form) before RoPE.
- Embeddings multiplied by sqrt(hidden_size), the factor first rounded to the weight dtype.
- Sliding-window layers (a window of W keys including the current one) interleaved 5:1 with global
  layers; two RoPE bases (1e4 local, 1e6 global), `linear` scaling on global layers of the >= 4B models.
- Attention scale query_pre_attn_scalar**-0.5; tanh-GELU MLP; optional final logit soft-capping.
  attn_logit_softcapping is NOT applied (transformers 5.24 ignores it too).

Llama (`model_type` "llama": Llama 3.x, SmolLM2) and Qwen2 ("qwen2": Qwen2.5) are Qwen3 without QK-norm:
- Llama: optional bias on all four attention projections (attention_bias) and on the MLP (mlp_bias);
  Llama 3.1's `llama3` RoPE scaling (low frequencies divided by the factor, high ones kept, a smooth
  blend between).
- Qwen2: bias on q/k/v (always), none on o_proj.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer
from torch import nn

from cli import ModelError, default_device

# ------------------------------------------------------------------------------------------- config

# transformers' defaults for keys a config.json may omit (Qwen3Config / Gemma3TextConfig, 5.24).
# Published Gemma3 multimodal configs rely on them: their text_config lists only a few sizes.
_DEFAULTS = {
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096, max_window_layers=28,
                  rope_theta=10000.0, bos_token_id=None, eos_token_id=None),
    "gemma3": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                   sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   bos_token_id=2, eos_token_id=1),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096, max_window_layers=28,
                  rope_theta=10000.0, bos_token_id=None, eos_token_id=None),
}
_ARCHS = {"qwen3": "qwen3", "gemma3_text": "gemma3", "gemma3": "gemma3", "llama": "llama", "qwen2": "qwen2"}
# <|im_end|> / <end_of_turn>: chat models stop on them (Llama 3 lists <|eot_id|> in its generation_config)
_END_OF_TURN = {"qwen3": 151645, "qwen2": 151645, "gemma3": 106}
_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# the chat layout a tokenizer's own template writes, by its turn marker, and each family's when it has none
_CHAT_MARKERS = (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"), ("<start_of_turn>", "gemma"))
_FAMILY_CHAT = {"qwen3": "chatml", "qwen2": "chatml", "llama": "llama3", "gemma3": "gemma"}


@dataclass
class ModelConfig:
    arch: str                     # "qwen3" | "gemma3" | "llama" | "qwen2" (the family: norm form, MLP, biases)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int                 # not always hidden/heads: Gemma3 270M has 4 heads x 256 on hidden 640
    rms_norm_eps: float
    hidden_act: str               # "silu" (Qwen3) | "gelu_pytorch_tanh" (Gemma3)
    layer_types: list[str]        # per layer: "full_attention" | "sliding_attention"
    sliding_window: int | None    # W keys including the current one, on sliding layers only
    rope: dict[str, dict]         # layer type -> {"rope_type", "rope_theta", "factor", ...} (5.x form)
    max_position_embeddings: int
    query_pre_attn_scalar: float  # attention scale = this**-0.5 (Qwen3: head_dim)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c) when set (Gemma)
    attention_bias: bool = False  # bias on q/k/v/o (config key attention_bias; False in released models)
    qkv_bias: bool = False        # bias on q/k/v: Qwen2 always, the others with attention_bias
    mlp_bias: bool = False        # bias on the MLP's three projections (Llama's mlp_bias)
    qk_norm: bool = True          # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma3; not Llama, Qwen2)
    chat_format: str = "chatml"   # "chatml" | "llama3" | "gemma": the layout of the tokenizer's chat template
    # whether the tokenizer has a chat template: False for a tokenizer_config.json without one (a
    # base model, as the offline Gemma 3 270M), None when the folder has no tokenizer_config.json
    chat_template: bool | None = None
    tie_word_embeddings: bool = False  # lm_head shares model.embed_tokens.weight
    eos_token_ids: list[int] = field(default_factory=list)  # stop ids: config + generation_config + end of turn
    bos_token_id: int | None = None

    @property
    def group_size(self) -> int:
        """G = query heads per KV head (GQA; 1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def compressed_layers(self) -> list[int]:
        """Layers whose KV is scored and evicted: every layer; Gemma3's global layers only (METHOD.md §9)."""
        if self.arch == "gemma3":
            return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]
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
        """config.json (or its folder); eos ids from a sibling generation_config.json are merged in, the
        chat layout is read from the tokenizer's own template when the folder has one."""
        path = Path(path)
        try:
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ModelError(f"no config.json in {path.parent}: pass a Hugging Face model folder "
                                 "(config.json, tokenizer.json, *.safetensors)")
            d = json.loads(path.read_text())
            gen_path = path.parent / "generation_config.json"
            gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        except OSError as e:  # a folder or file this user may not read
            raise ModelError(f"cannot read {e.filename or path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{path.parent}: unreadable JSON ({e}); re-download the config files") from None
        for name, obj in (("config.json", d), ("generation_config.json", gen)):
            if not isinstance(obj, dict):
                raise ModelError(f"{path.parent / name} holds a JSON {type(obj).__name__}, not an object; "
                                 f"re-download the config files")
        cfg = cls.from_dict(d, gen)
        template = _chat_template(path.parent)
        cfg.chat_template = None if template is None else bool(template.strip())
        cfg.chat_format = next((fmt for marker, fmt in _CHAT_MARKERS if marker in (template or "")),
                               cfg.chat_format)
        return cfg

    @classmethod
    def from_dict(cls, d: dict, generation_config: dict | None = None) -> "ModelConfig":
        """Accepts both transformers-5 keys (rope_parameters, layer_types) and the legacy keys of
        released checkpoints (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern)."""
        eos = _ids(d.get("eos_token_id"))
        eos += _ids((generation_config or {}).get("eos_token_id"), "generation_config.json")
        model_type = d.get("model_type")
        if model_type == "gemma3" and "text_config" in d:  # multimodal: keep the text decoder only
            if not isinstance(d["text_config"] or {}, dict):
                raise ModelError("config.json: text_config must be an object")
            d = {"model_type": "gemma3_text", **{k: v for k, v in d.items() if k.endswith("token_id")},
                 **(d["text_config"] or {})}
            model_type = "gemma3_text"
        arch = _ARCHS.get(model_type)
        if arch is None:
            raise ModelError(f"unsupported model_type {model_type!r} (architectures {d.get('architectures')}): "
                             "only Qwen3, Gemma3, Llama and Qwen2 decoders are implemented")
        if d.get("use_bidirectional_attention"):
            raise ModelError("bidirectional Gemma3 (EmbeddingGemma) is not a causal decoder: unsupported")
        d = {**_DEFAULTS[arch], **{k: v for k, v in d.items() if v is not None}}
        _check_types(d)
        n_layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")

        if arch == "gemma3":
            window = d["sliding_window"]
            pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
            derived = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
        else:  # Qwen3/Qwen2 slide only with use_sliding_window (never in released checkpoints); Llama never
            window = d["sliding_window"] if d.get("use_sliding_window") else None
            derived = ["sliding_attention" if window and i >= d["max_window_layers"] else "full_attention"
                       for i in range(n_layers)]
        layer_types = list(d.get("layer_types") or derived)
        if len(layer_types) != n_layers:
            raise ModelError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")

        eos += _ids(d["eos_token_id"])  # the text config's own (or the family default)
        end_of_turn = _END_OF_TURN.get(arch)
        eos += [end_of_turn] if end_of_turn is not None and end_of_turn < d["vocab_size"] else []  # not in tiny vocabs
        return cls(
            arch=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d["rms_norm_eps"], hidden_act=d.get("hidden_activation") or d["hidden_act"],
            layer_types=layer_types, sliding_window=window, rope=_rope_parameters(arch, d),
            max_position_embeddings=d["max_position_embeddings"],
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") or d.get("head_dim") or d["hidden_size"] // heads,
            final_logit_softcapping=d.get("final_logit_softcapping") if arch == "gemma3" else None,
            attention_bias=bool(d.get("attention_bias", False)),
            qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=arch in ("qwen3", "gemma3"),
            chat_format=_FAMILY_CHAT[arch],
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            eos_token_ids=sorted(set(eos)), bos_token_id=d.get("bos_token_id"))


def _ids(x, where="config.json") -> list[int]:
    ids = [] if x is None else x if isinstance(x, list) else [x]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelError(f"{where}: eos_token_id must be an integer >= 0 or a list of them, got {x!r}")
    return ids


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "sliding_window_pattern")
_POSITIVE = ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "final_logit_softcapping")


def _check_types(d: dict) -> None:
    """Refuse config.json values of the wrong type or sign (a string size, a negative head count), which
    would otherwise fail later in a traceback or build a silently wrong model."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    for key in _SIZES:
        v = d.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ModelError(f"config.json: {key} must be a positive integer, got {v!r}")
    if d.get("max_window_layers") is not None and not (isinstance(d["max_window_layers"], int) and
                                                       not isinstance(d["max_window_layers"], bool)):
        raise ModelError(f"config.json: max_window_layers must be an integer, got {d['max_window_layers']!r}")
    for key in _POSITIVE:
        v = d.get(key)
        if v is not None and not (number(v) and v > 0):
            raise ModelError(f"config.json: {key} must be a positive number, got {v!r}")
    if not (number(d.get("rms_norm_eps")) and d["rms_norm_eps"] >= 0):
        raise ModelError(f"config.json: rms_norm_eps must be a number >= 0, got {d.get('rms_norm_eps')!r}")
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ModelError(f"config.json: {key} must be an object, got {d[key]!r}")
    types = d.get("layer_types")
    if types is not None and not (isinstance(types, list) and
                                  all(t in ("full_attention", "sliding_attention") for t in types)):
        raise ModelError("config.json: layer_types must be a list of 'full_attention' / 'sliding_attention'")
    for key in ("hidden_act", "hidden_activation"):
        if d.get(key) is not None and not isinstance(d[key], str):
            raise ModelError(f"config.json: {key} must be a string, got {d[key]!r}")


def _chat_template(folder: Path) -> str | None:
    """The tokenizer's own chat template (tokenizer_config.json's chat_template, and
    chat_template.jinja): "" when tokenizer_config.json has none, None when neither file is there.
    SmolLM2 is a Llama whose template is ChatML: the template, not the architecture, decides the
    prompt, and a model without one is a base model; so a tokenizer_config.json that cannot be read
    is refused rather than read as "no template" (which would silently give another prompt)."""
    template, path = None, folder / "tokenizer_config.json"
    try:
        if path.is_file():
            d = json.loads(path.read_text(encoding="utf-8"))
            t = d.get("chat_template") if isinstance(d, dict) else None
            if isinstance(t, list) and all(isinstance(x, dict) and isinstance(x.get("template"), str) for x in t):
                t = " ".join(x["template"] for x in t)  # named templates: [{"name": ..., "template": ...}]
            if not isinstance(d, dict) or not isinstance(t, (str, type(None))):
                raise ModelError(f"{path}: expected an object whose chat_template is a string or a list of "
                                 f"{{name, template}} objects; re-download the tokenizer files")
            template = t or ""
        if (folder / "chat_template.jinja").is_file():
            jinja = (folder / "chat_template.jinja").read_text(errors="replace")
            template = (template or "") + jinja
    except OSError as e:
        raise ModelError(f"cannot read {e.filename or path}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ModelError(f"{path} is not valid JSON ({e}); re-download the tokenizer files: its chat template "
                         f"decides the prompt layout") from None
    return template


def _rope_parameters(arch: str, d: dict) -> dict[str, dict]:
    """One RoPE dict per layer type, the way transformers 5.24 standardises old and new configs."""
    def clean(p: dict | None, theta: float) -> dict:
        p = dict(p or {})
        p["rope_type"] = p.get("rope_type") or p.pop("type", None) or "default"
        p.setdefault("rope_theta", theta)
        if p["rope_type"] not in _ROPE_TYPES:
            raise ModelError(f"unsupported rope_type {p['rope_type']!r}: implemented {', '.join(_ROPE_TYPES)}")
        if p["rope_type"] in ("yarn", "llama3"):  # pre-training length; a top-level key wins (transformers)
            orig = p["original_max_position_embeddings"] = d.get("original_max_position_embeddings") or \
                p.get("original_max_position_embeddings") or d["max_position_embeddings"]
            if p["rope_type"] == "yarn":
                p["factor"] = p.get("factor") or d["max_position_embeddings"] / orig
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if p.get(k) is None]
        if p["rope_type"] == "llama3" and missing:
            raise ModelError(f"rope_type 'llama3' without {', '.join(missing)} in config.json")
        if p["rope_type"] == "linear" and not p.get("factor"):
            raise ModelError("rope_type 'linear' without a factor in config.json")
        return p

    rp = d.get("rope_parameters")
    if arch != "gemma3":  # one RoPE for every layer
        p = clean(rp if rp else d.get("rope_scaling"), d["rope_theta"])
        return {"full_attention": p, "sliding_attention": p}
    if rp:  # Gemma3, transformers-5 form: nested per layer type
        return {"full_attention": clean(rp.get("full_attention"), d["rope_theta"]),
                "sliding_attention": clean(rp.get("sliding_attention"), d["rope_local_base_freq"])}
    # legacy Gemma3: rope_scaling (linear x8 on >= 4B) applies to global layers only; local base 1e4
    return {"full_attention": clean(d.get("rope_scaling"), d["rope_theta"]),
            "sliding_attention": clean(None, d["rope_local_base_freq"])}


# -------------------------------------------------------------------------------------------- norms

class RMSNorm(nn.Module):
    """Qwen3: w * norm(x).to(dtype). Gemma3 (unit_offset): (norm(x) * (1 + w)) in fp32, then cast."""

    def __init__(self, dim: int, eps: float, unit_offset: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma: the multiply happens in fp32 too
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)  # Qwen: cast first, then the (possibly bf16) weight


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
    if p["rope_type"] == "llama3":  # Llama 3.1: wavelengths beyond orig/low_freq_factor are interpolated,
        inv_freq = 1.0 / (base ** exps)  # those below orig/high_freq_factor kept, a linear blend in between
        orig, factor, low, high = (p[k] for k in ("original_max_position_embeddings", "factor",
                                                  "low_freq_factor", "high_freq_factor"))
        wavelen = 2 * math.pi / inv_freq
        smooth = ((orig / wavelen - low) / (high - low)).clamp(0, 1)  # 0 = interpolate, 1 = keep
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    # yarn (arXiv 2309.00071): interpolate low frequencies, keep high ones, blend on a linear ramp
    orig, factor = p["original_max_position_embeddings"], p["factor"]  # factor: context extension

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:  # scales cos and sin, i.e. the logits by its square
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(n_rotations: float) -> float:  # dim index that turns n times over `orig` tokens
        return dim * math.log(orig / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** exps
    keep = 1 - ramp  # 1 = extrapolate (high frequency, unchanged), 0 = interpolate (divide by factor)
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
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, d): rotate_half layout, halves share a frequency
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, d); cos, sin (T, d)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


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

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache) -> torch.Tensor:
        """h (T, D): the attention input (after input_layernorm), also handed to the cache (gate input)."""
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
    """Gated MLP: down(act(gate(x)) * up(x)); act = SiLU (Qwen3, Llama, Qwen2) or tanh-GELU (Gemma3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ModelError(f"unsupported activation {cfg.hidden_act!r}")
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x)  # (T, I)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down_proj(g * self.up_proj(x))  # (T, D)


# -------------------------------------------------------------------------------------------- block

class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        gemma, eps, D = cfg.arch == "gemma3", cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(D, eps, gemma)
        self.post_attention_layernorm = RMSNorm(D, eps, gemma)  # Qwen3: the pre-MLP norm, despite its name
        self.sandwich = gemma  # Gemma3 also normalises each sub-layer's OUTPUT before the residual add
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(D, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(D, eps, gemma)

    def forward(self, x: torch.Tensor, rope, cache) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, cache))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), rope, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# -------------------------------------------------------------------------------------------- model

class Decoder(nn.Module):
    """The checkpoint's `model.*`: embeddings, blocks, final norm (and the RoPE tables, not stored)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.arch == "gemma3")
        self.rotary = nn.ModuleDict({t: Rotary(cfg.rope[t], cfg.head_dim) for t in sorted(set(cfg.layer_types))})


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

    def forward(self, input_ids: torch.Tensor, cache=None, num_logits: int | None = None) -> torch.Tensor:
        """input_ids (T,) -> logits (T, vocab) float32, or (num_logits, vocab) for the last positions.
        Positions come from the cache: one sequence's next T (cache.n_seen on), or, for a cache.Batch, each
        member's next position (one token per member); cache None = a temporary full KVCache."""
        assert input_ids.dim() == 1, f"flat tokens only: pass input_ids of shape (T,), got {tuple(input_ids.shape)}"
        cfg, emb = self.config, self.model.embed_tokens.weight
        if cache is None:
            from cache import KVCache  # lazy: only a forward without a cache needs one
            cache = KVCache(cfg, emb.dtype, emb.device)
        T = input_ids.shape[0]
        pos = cache.positions(T)  # (T,) absolute positions
        x = self.model.embed_tokens(input_ids)  # (T, D)
        if cfg.arch == "gemma3":  # sqrt(D) rounded to the weight dtype first (34.0, not 33.94, in bf16)
            x = x * torch.tensor(cfg.hidden_size ** 0.5).to(emb.dtype)
        rope = {t: r(pos, x.dtype) for t, r in self.model.rotary.items()}  # layer type -> (cos, sin) (T, d)
        for i, block in enumerate(self.model.layers):
            x = block(x, rope[cfg.layer_types[i]], cache)  # (T, D)
        cache.advance(T)
        if num_logits is not None:  # a 16K-token prefill must not build (16K, vocab) logits
            x = x[T - num_logits:]  # (n, D); n = 0 gives no logits at all
        logits = self.lm_head(self.model.norm(x))  # (n, V)
        if cfg.final_logit_softcapping:
            c = cfg.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits.float()


# ------------------------------------------------------------------------------------------ loading

# where the text decoder's tensors live in Gemma3 multimodal checkpoints -> our names
_RENAMES = (("language_model.model.", "model."),  # transformers < 4.52 (the released checkpoints)
            ("model.language_model.", "model."),  # transformers >= 4.52
            ("language_model.lm_head.", "lm_head."))
_SKIP = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _checkpoint_name(key: str) -> str | None:
    for old, new in _RENAMES:
        if key.startswith(old):
            return new + key[len(old):]
    return None if key.startswith(_SKIP) else key


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index maps tensor name -> shard file
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            raise ModelError(f"{index} is not valid JSON ({e}); re-download the model") from None
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not (isinstance(weight_map, dict) and weight_map
                and all(isinstance(f, str) for f in weight_map.values())):
            raise ModelError(f"{index}: expected an object whose weight_map maps tensor names to "
                             f"shard files; re-download the model")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ModelError(f"{folder}: shard {missing[0]} listed in model.safetensors.index.json is missing; "
                             "re-download the model")
        return [folder / f for f in files]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder}: no *.safetensors weights (only safetensors checkpoints are supported; "
                         "convert .bin/.gguf first)")
    return files


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """A --dtype flag -> torch dtype; None: bf16 on GPU, fp32 on CPU (whose bf16 matmuls are emulated)."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def check_dtype(cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Refuse a compute dtype the model cannot run in. Gemma 3's residual stream outgrows float16's range
    (max 65504): in Gemma 3 270M it grows every layer (3.0e3 after layer 0, 5.5e4 after layer 6) and passes
    65504 in layer 7 (0-based) of 18 already on a 4-token prompt; every value after that is inf or NaN,
    and greedy decoding answered token 0. Refused for the whole family, which shares the architecture
    (sandwich norms add each sub-layer's normalised output to an unnormalised stream); its checkpoints
    are bfloat16, whose range is float32's."""
    if cfg.arch == "gemma3" and dtype == torch.float16:
        raise ModelError("Gemma 3 cannot run in float16: its activations outgrow float16's range (65504) and "
                         "turn to inf/NaN; use --dtype bfloat16 or float32")


def load_model(folder: str | Path, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None) -> Transformer:
    """Build on the meta device, then assign the checkpoint's tensors shard by shard (never two copies).
    dtype None: bf16 on GPU, fp32 on CPU (bf16 matmuls are emulated and ~4x slower on CPUs)."""

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelError(f"model folder not found: {folder}")
    cfg = ModelConfig.from_json(folder / "config.json")
    device = torch.device(device) if device is not None else default_device()
    device = torch.device("cpu") if device.type == "cpu" else device  # safetensors refuses "cpu:0"
    dtype = dtype or compute_dtype(None, device)
    check_dtype(cfg, dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    expected = {k for k in shapes if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    loaded, unexpected = set(), []
    for path in _weight_files(folder):
        tensors = {}
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    name = _checkpoint_name(key)
                    if name in expected:
                        shape = tuple(f.get_slice(key).get_shape())  # checked before anything is read
                        if shape != shapes[name]:
                            raise ModelError(f"{path}: {key} has shape {shape}, config.json implies "
                                             f"{shapes[name]}; config.json and weights do not match")
                        tensors[name] = f.get_tensor(key).to(dtype)  # store-bf16 -> fp32 on CPU
                    elif name is not None and not (cfg.tie_word_embeddings and name == "lm_head.weight"):
                        unexpected.append(key)
        except (SafetensorError, OSError) as e:
            msg = " ".join(str(e).split())
            raise ModelError(f"{path}: truncated or corrupt safetensors file ({msg}); re-download it") from None
        model.load_state_dict(tensors, strict=False, assign=True)
        loaded |= tensors.keys()
        del tensors
    if expected - loaded:
        missing = sorted(expected - loaded)
        raise ModelError(f"{folder}: checkpoint lacks {len(missing)} tensors the config needs "
                         f"(e.g. {missing[0]}); config.json and weights do not match")
    if unexpected:
        raise ModelError(f"{folder}: checkpoint has {len(unexpected)} tensors this {cfg.arch} config does not "
                         f"use (e.g. {unexpected[0]}); config.json and weights do not match")
    model.tie_weights()  # assign=True replaced embed_tokens.weight: tie again
    model = model.to(device).eval().requires_grad_(False)  # .to moves the RoPE buffers built on CPU
    model.identity = model_identity(folder)  # what a saved cache checks before it is answered from
    return model


def model_identity(folder: str | Path) -> dict[str, str | None]:
    """Which model a saved KV cache belongs to (cache.load_cache checks): sha256 of config.json (as
    JSON), of tokenizer.json (None without one) and of a weight sample: each file's name, size and
    first, middle and last MiB (the first holds its header), enough to tell two fine-tunes of one
    config apart in milliseconds where hashing 16 GB takes a minute."""
    folder, h, piece = Path(folder).expanduser(), hashlib.sha256(), 2**20
    config = json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True)
    tok = folder / "tokenizer.json"
    out = {"config_sha256": hashlib.sha256(config.encode()).hexdigest(),
           "tokenizer_sha256": hashlib.sha256(tok.read_bytes()).hexdigest() if tok.is_file() else None}
    for path in _weight_files(folder):
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            h.update(f"{path.name}\t{size}\n".encode())
            for start in [0] if size <= 3 * piece else [0, size // 2, size - piece]:
                f.seek(start)
                h.update(f.read(size if size <= 3 * piece else piece))
    out["weights_sha256"] = h.hexdigest()
    return out


# --------------------------------------------------------------------------------- tokenizer/prompt
# User text is data. A context, a question, a --batch request or a training document may hold the
# text of a control token ("<|im_end|>\n<|im_start|>assistant", "<end_of_turn>"): parsed, it would
# end the user's turn and write the model's, and Gemma 3's "<image_soft_token>" (id 262144 in the
# published tokenizer.json, whose config says vocab_size 262144) would index past the embedding.
# So user text is encoded with the tokenizer's special tokens left unparsed (teacher.encode_text),
# and only a template's own control tokens become control ids (teacher.encode_prompt).

# the control tokens the prompt templates write (teacher.py; tests/test_text.py checks the two agree)
CONTROL_TOKENS = frozenset({"<|im_start|>", "<|im_end|>", "<think>", "</think>", "<bos>",
                            "<start_of_turn>", "<end_of_turn>", "<|begin_of_text|>",
                            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"})


def load_tokenizer(folder: str | Path, cfg: ModelConfig | None = None):
    """tokenizers.Tokenizer from the folder's tokenizer.json; encode with teacher.encode_text /
    encode_prompt.
    cfg (the model's config): refuse another model's tokenizer, one whose ids that text or a prompt
    can make (its base vocabulary, its added tokens, a template's control tokens) reach past the
    embedding, or whose own bos / eos tokens (tokenizer_config.json) are not the config's. Special
    tokens past the embedding are fine: text never makes them (Gemma 3's <image_soft_token>)."""

    path = Path(folder).expanduser() / "tokenizer.json"
    try:
        if not path.is_file():
            raise ModelError(f"no tokenizer.json in {path.parent}: add the model's tokenizer.json "
                             f"to the folder")
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise ModelError(f"{path}: unreadable tokenizer ({' '.join(str(e).split())}); "
                         f"re-download it") from None
    if cfg is not None:
        _check_tokenizer(tok, path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids)
    return tok


def _check_tokenizer(tok, path: Path, vocab_size: int, bos_id: int | None,
                     eos_ids: list[int]) -> None:
    fix = "another model's tokenizer; put the model's own tokenizer.json in the folder"
    base = tok.get_vocab_size(with_added_tokens=False)
    if base > vocab_size:
        raise ModelError(f"{path}: its base vocabulary has {base} token ids, more than the model's "
                         f"vocab_size {vocab_size} (config.json): {fix}")
    for i, t in sorted(tok.get_added_tokens_decoder().items()):
        if i >= vocab_size and (not t.special or t.content in CONTROL_TOKENS):
            raise ModelError(f"{path}: its token {t.content!r} has id {i}, past the model's "
                             f"vocab_size {vocab_size} (config.json), and "
                             f"{'a prompt' if t.special else 'text'} would make it: {fix}")
    named = _tokenizer_config_tokens(path.parent)
    bos_ids = [bos_id] if bos_id is not None else []
    for key, ids in (("bos_token", bos_ids), ("eos_token", eos_ids)):
        name = named.get(key)
        if name is not None and ids and tok.token_to_id(name) not in ids:
            raise ModelError(f"{path}: its {key} {name!r} is id {tok.token_to_id(name)}, not "
                             f"config.json's {key}_id {ids if len(ids) > 1 else ids[0]}: {fix}")
    unknown = [i for i in bos_ids + eos_ids if tok.id_to_token(i) is None]
    if unknown:
        raise ModelError(f"{path}: config.json's bos / eos token id {unknown[0]} is no token of "
                         f"this tokenizer: {fix}")


def _tokenizer_config_tokens(folder: Path) -> dict:
    """bos_token / eos_token as tokenizer_config.json names them (a string or {"content": ...});
    {} without a readable file (ModelConfig.from_json, which reads its chat template, refuses a bad
    one)."""
    try:
        d = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        return {}
    out = {}
    for key in ("bos_token", "eos_token"):
        v = d.get(key) if isinstance(d, dict) else None
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out
