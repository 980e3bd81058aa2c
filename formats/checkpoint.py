"""Checks of a Hugging Face checkpoint folder, before model.py reads it.

model.py trusts its checkpoint; the programs call this module first, so that a bad folder is one
`model.ModelError` line that says how to fix it, never a traceback or a silently different model:
- config.json (and generation_config.json): readable JSON objects, values of the right type and
  sign (every number and flag model.py reads, the RoPE dicts' too), a supported model_type, RoPE
  type and activation, sizes that agree (read_config, check_config);
- tokenizer_config.json: a chat template of a readable form (it decides the prompt layout);
- tokenizer.json: present, readable, and this model's (read_tokenizer);
- the compute dtype (check_dtype);
- the weights: the shard index, each file's header, every tensor's shape and float dtype, none
  missing or left over (check_weights), read from the headers before any tensor is; once loaded,
  no inf/NaN (check_finite).

check_folder (config, tokenizer, dtype) runs before anything heavy; load_checked before the weights
load.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

import model as M
from model import ModelConfig, ModelError
from prompts import CONTROL_TOKENS

_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
          "sliding_window", "sliding_window_pattern", "_sliding_window_pattern",
          "original_max_position_embeddings")
_POSITIVE = ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
             "final_logit_softcapping")
_FLAGS = ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window",
          "use_bidirectional_attention")
# a RoPE dict's numbers, as model.rope_inv_freq reads them (transformers 5.24's keys)
_ROPE_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                  "beta_slow", "attention_factor")
_ROPE_NUMBERS = ("mscale", "mscale_all_dim")
# the floating-point dtypes a weight may be stored in (safetensors' names); an integer, bool or
# 8-bit float tensor is quantised (or a mask), meaningless as a float weight without its scales
_FLOAT_WEIGHTS = ("F16", "BF16", "F32", "F64")


def check_folder(folder: str | Path, dtype: torch.dtype | None = None):
    """The cheap checks, before anything heavy: config.json, the tokenizer, the dtype (when given).
    -> (ModelConfig, tokenizers.Tokenizer)."""
    cfg = read_config(folder)
    tok = read_tokenizer(folder, cfg)
    if dtype is not None:
        check_dtype(cfg, dtype)
    return cfg, tok


def load_checked(folder: str | Path, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> M.Transformer:
    """model.load_model, after the folder, its config, the dtype and the weights' headers are
    checked."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelError(f"model folder not found: {folder}")
    cfg = read_config(folder / "config.json")
    device = torch.device(device) if device is not None else M.default_device()
    check_dtype(cfg, dtype or M.compute_dtype(None, device))
    check_weights(folder, cfg)
    model = M.load_model(folder, device, dtype)
    check_finite(folder, model)
    if _tokenizer_config_tokens(folder) and (folder / "tokenizer.json").is_file():
        stop_at_named_eos(folder, M.load_tokenizer(folder), model.config)  # as read_tokenizer
    return model


# ------------------------------------------------------------------------------------- config.json

def read_config(path: str | Path) -> ModelConfig:
    """ModelConfig.from_json, after config.json, generation_config.json and the chat template are
    checked (path: config.json or its folder)."""
    path = Path(path)
    try:
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelError(f"no config.json in {path.parent}: pass a Hugging Face model folder "
                             "(config.json, tokenizer.json, *.safetensors)")
        d = read_json(path)
        gen_path = path.parent / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else {}
    except OSError as e:  # a folder or file this user may not read
        raise ModelError(f"cannot read {e.filename or path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path.parent}: unreadable JSON ({e}); re-download the config "
                         "files") from None
    for name, obj in (("config.json", d), ("generation_config.json", gen)):
        if not isinstance(obj, dict):
            raise ModelError(f"{path.parent / name} holds a JSON {type(obj).__name__}, not an "
                             f"object; re-download the config files")
    check_config(d, gen)
    _check_chat_template(path.parent)
    return ModelConfig.from_json(path)


def read_json(path: Path):
    """json.loads of a checkpoint's JSON file, a key given twice (at any depth) refused in one line:
    Python's json keeps the last one silently, and which one a reader takes is not defined."""
    def unique(pairs):
        keys = [k for k, _ in pairs]
        twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        if twice is not None:
            raise ModelError(f"{path}: key {twice!r} given twice in one object; keep one")
        return dict(pairs)
    return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique)


def check_config(d: dict, generation_config: dict | None = None) -> None:
    """Refuse a config.json dict that ModelConfig.from_dict cannot build a model from, or would
    build a silently wrong one from."""
    _ids(d.get("eos_token_id"))
    _ids((generation_config or {}).get("eos_token_id"), "generation_config.json")
    if d.get("model_type") == "gemma3" and "text_config" in d and \
            not isinstance(d["text_config"] or {}, dict):
        raise ModelError("config.json: text_config must be an object")
    arch, d = M.config_keys(d)
    if arch is None:
        raise ModelError(f"unsupported model_type {d.get('model_type')!r} (architectures "
                         f"{d.get('architectures')}): only Qwen3, Gemma3, Llama and Qwen2 decoders "
                         "are implemented")
    _check_types(d)
    if d.get("use_bidirectional_attention"):
        raise ModelError("bidirectional Gemma3 (EmbeddingGemma) is not a causal decoder: "
                         "unsupported")
    n_layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
    kv_heads = d.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                         f"{kv_heads}")
    types = d.get("layer_types")
    if types and len(types) != n_layers:
        raise ModelError(f"layer_types has {len(types)} entries for {n_layers} layers")
    _ids(d["eos_token_id"])  # the text config's own (or the family default)
    _check_rope(arch, d)
    for p in M.rope_parameters(arch, d).values():
        if p["rope_type"] not in M.ROPE_TYPES:
            raise ModelError(f"unsupported rope_type {p['rope_type']!r}: implemented "
                             f"{', '.join(M.ROPE_TYPES)}")
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor")
                   if p.get(k) is None]
        if p["rope_type"] == "llama3" and missing:
            raise ModelError(f"rope_type 'llama3' without {', '.join(missing)} in config.json")
        if p["rope_type"] == "linear" and not p.get("factor"):
            raise ModelError("rope_type 'linear' without a factor in config.json")
        if p["rope_type"] == "llama3" and not p["low_freq_factor"] < p["high_freq_factor"]:
            raise ModelError("config.json: rope_type 'llama3' needs low_freq_factor < "
                             "high_freq_factor (its blend divides by their difference)")
    _check_rope_tables(arch, d)
    act = d.get("hidden_activation") or d["hidden_act"]
    if act not in M.ACTIVATIONS:
        raise ModelError(f"unsupported activation {act!r}")


def _ids(x, where="config.json") -> None:
    ids = [] if x is None else x if isinstance(x, list) else [x]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelError(f"{where}: eos_token_id must be an integer >= 0 or a list of them, "
                         f"got {x!r}")


def _check_types(d: dict) -> None:
    """Refuse config.json values of the wrong type or sign (a string size, a negative head count),
    which would otherwise fail later in a traceback or build a silently wrong model."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    integer = lambda v: isinstance(v, int) and not isinstance(v, bool)
    for key in _SIZES:
        v = d.get(key)
        if v is not None and not (integer(v) and v > 0):
            raise ModelError(f"config.json: {key} must be a positive integer, got {v!r}")
    if d.get("max_window_layers") is not None and not integer(d["max_window_layers"]):
        raise ModelError(f"config.json: max_window_layers must be an integer, got "
                         f"{d['max_window_layers']!r}")
    for key in _POSITIVE:
        v = d.get(key)
        if v is not None and not (number(v) and v > 0):
            raise ModelError(f"config.json: {key} must be a positive number, got {v!r}")
    if not (number(d.get("rms_norm_eps")) and d["rms_norm_eps"] >= 0):
        raise ModelError(f"config.json: rms_norm_eps must be a number >= 0, got "
                         f"{d.get('rms_norm_eps')!r}")
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ModelError(f"config.json: {key} must be an object, got {d[key]!r}")
    types = d.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(
            t in ("full_attention", "sliding_attention") for t in types)):
        raise ModelError("config.json: layer_types must be a list of 'full_attention' / "
                         "'sliding_attention'")
    for key in ("hidden_act", "hidden_activation"):
        if d.get(key) is not None and not isinstance(d[key], str):
            raise ModelError(f"config.json: {key} must be a string, got {d[key]!r}")
    for key in _FLAGS:  # bool("false") is True: a string would silently flip the model
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise ModelError(f"config.json: {key} must be true or false, got {d[key]!r}")
    v = d.get("bos_token_id")
    if v is not None and not (integer(v) and v >= 0):
        raise ModelError(f"config.json: bos_token_id must be an integer >= 0, got {v!r}")


def _check_rope(arch: str, d: dict) -> None:
    """Refuse a RoPE dict (rope_parameters, or the legacy rope_scaling) that model.rope_inv_freq
    would read wrongly: a scaling without its type (run as plain RoPE), a value of the wrong type
    or sign (a TypeError deep in the frequencies, or silently other ones), a partial rotation."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    rp = d.get("rope_parameters")
    if rp and d.get("rope_scaling") and d["rope_scaling"] != rp:  # transformers reads the latter
        raise ModelError("config.json has both rope_parameters and rope_scaling, which differ: "
                         "keep one")
    if arch == "gemma3" and rp:  # transformers-5 Gemma3: one dict per layer type
        other = [k for k in rp if k not in ("full_attention", "sliding_attention")]
        if other:
            raise ModelError(f"config.json: Gemma 3's rope_parameters holds one object per layer "
                             f"type (full_attention, sliding_attention), not {other[0]!r}")
        dicts = {f"rope_parameters.{k}": v for k, v in rp.items()}
    else:
        dicts = {"rope_parameters": rp} if rp else {"rope_scaling": d.get("rope_scaling")}
    dicts["config.json"] = d  # a top-level partial_rotary_factor
    for name, p in dicts.items():
        if p is None:
            continue
        if not isinstance(p, dict):
            raise ModelError(f"config.json: {name} must be an object, got {p!r}")
        # Qwen3, Gemma3, Llama and Qwen2 rotate all of head_dim; a rotated fraction is another
        # architecture's (GPT-NeoX, Phi). transformers 5.24 reads it in its scaled initialisers
        # (modeling_rope_utils.py) but not in these families' default one: refused, not guessed
        if p.get("partial_rotary_factor", 1) != 1:
            key = "" if p is d else f"{name}."
            raise ModelError(f"config.json: {key}partial_rotary_factor is "
                             f"{p['partial_rotary_factor']!r}; only RoPE over the whole head "
                             f"(1.0) is implemented")
        if name == "config.json":
            continue
        scaling = [k for k, v in p.items() if k not in ("rope_theta", "partial_rotary_factor")
                   and v is not None]
        if not (p.get("rope_type") or p.get("type")) and scaling:
            raise ModelError(f"config.json: {name} has {scaling[0]!r} but no rope_type: name the "
                             f"scaling ({', '.join(M.ROPE_TYPES[1:])}) or drop the key")
        for key in _ROPE_POSITIVE + _ROPE_NUMBERS:
            v = p.get(key)
            if v is not None and not (number(v) and (v > 0 or key in _ROPE_NUMBERS)):
                kind = "a number" if key in _ROPE_NUMBERS else "a positive number"
                raise ModelError(f"config.json: {name}.{key} must be {kind}, got {v!r}")
        v = p.get("original_max_position_embeddings")
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ModelError(f"config.json: {name}.original_max_position_embeddings must be a "
                             f"positive integer, got {v!r}")
        if p.get("truncate") is not None and not isinstance(p["truncate"], bool):
            raise ModelError(f"config.json: {name}.truncate must be true or false, got "
                             f"{p['truncate']!r}")


# a value that keeps a RoPE key out of the way, to find which key breaks the tables
# (mscale_all_dim first: yarn divides by the scale it gives)
_ROPE_NEUTRAL = {"mscale_all_dim": None, "rope_theta": 10_000.0, "factor": 1.0,
                 "attention_factor": 1.0, "mscale": None, "beta_fast": 32.0, "beta_slow": 1.0}
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _rope_fault(p: dict, head_dim: int, n_positions: int) -> str | None:
    """What is wrong with the RoPE tables model.Rotary builds from the dict p, computed as it does
    (float32): a division by zero, or angles / an attention factor past float32 (inf/NaN logits,
    with no cause named, once the model runs); None when they are fine."""
    try:
        inv_freq, factor = M.rope_inv_freq(p, head_dim)
    except ZeroDivisionError:
        return "divide by zero"
    except (OverflowError, ValueError):  # math.log / exp of a value past float's range
        return "overflow"
    angles = inv_freq * (n_positions - 1)  # the largest angle: float32, as Rotary.forward
    # cos and sin are scaled by factor, so q.k by its square
    if not (bool(torch.isfinite(angles).all()) and abs(factor) < math.sqrt(_FLOAT32_MAX)):
        return "go past float32's range (inf/NaN logits)"
    return None


def _check_rope_tables(arch: str, d: dict) -> None:
    """Refuse RoPE values whose tables divide by zero or overflow (yarn with rope_theta 1 divides
    by log(rope_theta); a factor of 1e-300 gives infinite frequencies), naming the key: the first
    whose neutral value (_ROPE_NEUTRAL) mends them."""
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    if head_dim % 2 or head_dim == 0:
        raise ModelError(f"config.json: head_dim {head_dim} (or hidden_size // "
                         f"num_attention_heads) must be even and > 0: RoPE rotates pairs of "
                         f"dimensions")
    rp, n_positions = d.get("rope_parameters"), d["max_position_embeddings"]
    for layer_type, p in M.rope_parameters(arch, d).items():
        fault = _rope_fault(p, head_dim, n_positions)
        if fault is None:
            continue
        key = next((k for k in _ROPE_NEUTRAL if k in p and _rope_fault(
            {**p, k: _ROPE_NEUTRAL[k]}, head_dim, n_positions) is None), None)
        if arch == "gemma3" and rp:  # one dict per layer type
            where, given = f"rope_parameters.{layer_type}", rp.get(layer_type) or {}
        elif arch == "gemma3" and layer_type == "sliding_attention":  # legacy: its base alone
            where, given = "rope_local_base_freq", {}
        else:
            where, given = ("rope_parameters", rp) if rp else ("rope_scaling",
                                                                d.get("rope_scaling") or {})
        if key in given:
            where = f"{where}.{key}"
        elif key == "rope_theta":  # the top-level base
            gemma_local = arch == "gemma3" and layer_type == "sliding_attention"
            where = "rope_local_base_freq" if gemma_local else "rope_theta"
        value = p[key] if key else {k: v for k, v in p.items() if v is not None}
        layers = f" of the {layer_type} layers" if arch == "gemma3" else ""
        raise ModelError(f"config.json: {where} {value!r} makes the {p['rope_type']} RoPE "
                         f"tables{layers} {fault}; use the value the model was trained with")


def _check_chat_template(folder: Path) -> None:
    """The tokenizer's chat template decides the prompt (model.chat_template), so a
    tokenizer_config.json that cannot be read is refused rather than read as "no template" (which
    would silently give another prompt)."""
    path = folder / "tokenizer_config.json"
    try:
        if path.is_file():
            d = read_json(path)
            t = d.get("chat_template") if isinstance(d, dict) else None
            named = isinstance(t, list) and all(
                isinstance(x, dict) and isinstance(x.get("template"), str) for x in t)
            if not isinstance(d, dict) or not (named or isinstance(t, (str, type(None)))):
                raise ModelError(f"{path}: expected an object whose chat_template is a string or a "
                                 f"list of {{name, template}} objects; re-download the tokenizer "
                                 f"files")
        if (folder / "chat_template.jinja").is_file():
            (folder / "chat_template.jinja").read_text(errors="replace")
    except OSError as e:
        raise ModelError(f"cannot read {e.filename or path}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ModelError(f"{path} is not valid JSON ({e}); re-download the tokenizer files: its "
                         f"chat template decides the prompt layout") from None


def check_dtype(cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Refuse a compute dtype the model cannot run in: Gemma 3's residual stream outgrows float16's
    range and turns to inf/NaN (METHOD.md §9). Refused for the whole family, which shares the
    architecture (sandwich norms add each sub-layer's normalised output to an unnormalised stream);
    its checkpoints are bfloat16, whose range is float32's."""
    if cfg.arch == "gemma3" and dtype == torch.float16:
        raise ModelError("Gemma 3 cannot run in float16: its activations outgrow float16's range "
                         "(65504) and turn to inf/NaN; use --dtype bfloat16 or float32")


# ----------------------------------------------------------------------------------------- weights

def check_weights(folder: Path, cfg: ModelConfig) -> None:
    """The weights model.load_model will read: a valid shard index, readable headers, and exactly
    the tensors the config implies, in its shapes (read from the headers, no tensor data)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index maps tensor name -> shard file
        try:
            weight_map = read_json(index)
        except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            raise ModelError(f"{index} is not valid JSON ({e}); re-download the model") from None
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not (isinstance(weight_map, dict) and weight_map
                and all(isinstance(f, str) for f in weight_map.values())):
            raise ModelError(f"{index}: expected an object whose weight_map maps tensor names to "
                             f"shard files; re-download the model")
        missing = [f for f in sorted(set(weight_map.values())) if not (folder / f).is_file()]
        if missing:
            raise ModelError(f"{folder}: shard {missing[0]} listed in "
                             "model.safetensors.index.json is missing; re-download the model")
    elif not any(folder.glob("*.safetensors")):
        raise ModelError(f"{folder}: no *.safetensors weights (only safetensors checkpoints are "
                         "supported; convert .bin/.gguf first)")
    with torch.device("meta"):
        shapes = {k: tuple(t.shape) for k, t in M.Transformer(cfg).state_dict().items()}
    tied = lambda name: cfg.tie_word_embeddings and name == "lm_head.weight"
    expected = {k for k in shapes if not tied(k)}
    seen, unexpected, found = set(), [], {}  # found: tensor name -> the file it is in
    for path in M.weight_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = M.checkpoint_name(key)
                    if found.setdefault(name or key, path) != path:  # model.py loads both files
                        raise ModelError(f"{folder}: tensor {key} is in both "
                                         f"{found[name or key].name} and {path.name}; keep one "
                                         f"checkpoint (or name its shards in "
                                         f"model.safetensors.index.json)")
                    if name in expected:
                        piece = f.get_slice(key)
                        shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                        if dtype not in _FLOAT_WEIGHTS:
                            raise ModelError(f"{path}: {key} is stored as {dtype}, not a float "
                                             f"type: a quantised or integer tensor cannot be "
                                             f"used as a float weight without its scales; use "
                                             f"the model's float (bf16/fp16/fp32) checkpoint")
                        if shape != shapes[name]:
                            raise ModelError(f"{path}: {key} has shape {shape}, config.json "
                                             f"implies {shapes[name]}; config.json and weights do "
                                             f"not match")
                        seen.add(name)
                    elif name is not None and not tied(name):
                        unexpected.append(key)
        except (SafetensorError, OSError) as e:
            msg = " ".join(str(e).split())
            raise ModelError(f"{path}: truncated or corrupt safetensors file ({msg}); "
                             f"re-download it") from None
    if expected - seen:
        missing = sorted(expected - seen)
        raise ModelError(f"{folder}: checkpoint lacks {len(missing)} tensors the config needs "
                         f"(e.g. {missing[0]}); config.json and weights do not match")
    if unexpected:
        raise ModelError(f"{folder}: checkpoint has {len(unexpected)} tensors this {cfg.arch} "
                         f"config does not use (e.g. {unexpected[0]}); config.json and weights do "
                         f"not match")


def check_finite(folder: Path, model: M.Transformer) -> None:
    """Refuse weights holding inf/NaN (a damaged download, or values past the compute dtype's
    range), which would otherwise surface as non-finite logits mid-answer. One pass per tensor: a
    float32 sum is finite when every value is (weights are far below float32's range), and only a
    non-finite sum is looked at element by element."""
    for name, t in model.named_parameters():  # a tied weight once
        if not torch.isfinite(t.sum(dtype=torch.float32)) and not bool(t.isfinite().all()):
            wider = "" if t.dtype == torch.float32 else \
                f", or --dtype float32 if its stored values outgrow {t.dtype}"
            raise ModelError(f"{folder}: weight {name} holds inf/NaN values as {t.dtype}; "
                             f"re-download the model{wider}")


# --------------------------------------------------------------------------------------- tokenizer

def read_tokenizer(folder: str | Path, cfg: ModelConfig | None = None) -> Tokenizer:
    """model.load_tokenizer, after tokenizer.json is found readable. cfg (the model's config):
    refuse another model's tokenizer, one whose ids that text or a prompt can make (its base
    vocabulary, its added tokens, a template's control tokens) reach past the embedding, or whose
    own bos / eos tokens (tokenizer_config.json) are not the config's. Special tokens past the
    embedding are fine: text never makes them (Gemma 3's <image_soft_token>)."""
    path = Path(folder).expanduser() / "tokenizer.json"
    try:
        if not path.is_file():
            raise ModelError(f"no tokenizer.json in {path.parent}: add the model's tokenizer.json "
                             f"to the folder")
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        tok = M.load_tokenizer(path.parent)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise ModelError(f"{path}: unreadable tokenizer ({' '.join(str(e).split())}); "
                         f"re-download it") from None
    if cfg is not None:
        _check_tokenizer(tok, path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids)
        for note in stop_at_named_eos(path.parent, tok, cfg):
            print(f"note: {note}", file=sys.stderr)
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
    bos_ids = [bos_id] if bos_id is not None else []
    unknown = [i for i in bos_ids + eos_ids if tok.id_to_token(i) is None]
    if unknown:
        raise ModelError(f"{path}: config.json's bos / eos token id {unknown[0]} is no token of "
                         f"this tokenizer: {fix}")
    # a token tokenizer_config.json names beside config.json's ids (a fine-tune's own eos) runs
    # when the tokenizer holds it and config.json's ids are control tokens of this tokenizer too;
    # config ids that are plain text here mean the tokenizer is another model's
    named = _tokenizer_config_tokens(path.parent)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for key, ids in (("bos_token", bos_ids), ("eos_token", eos_ids)):
        name = named.get(key)
        i = None if name is None else tok.token_to_id(name)
        if name is not None and ids and (i is None or i not in ids and not set(ids) <= special):
            raise ModelError(f"{path}: its {key} {name!r} is id {i}, not config.json's "
                             f"{key}_id {ids if len(ids) > 1 else ids[0]}: {fix}")


def named_tokens(folder: Path, tok, cfg: ModelConfig) -> dict:
    """The bos / eos tokens tokenizer_config.json names that config.json does not: {key: (name,
    id)}. Common in fine-tunes (a ChatML fine-tune of a base model names <|im_end|> while
    config.json keeps the base's eos): such a model runs correctly when generation stops at
    both eos tokens, and its prompts come from its template's own tokens, not from bos_token_id."""
    ids = {"bos_token": [cfg.bos_token_id] if cfg.bos_token_id is not None else [],
           "eos_token": cfg.eos_token_ids}
    out = {}
    for key, name in _tokenizer_config_tokens(Path(folder)).items():
        i = tok.token_to_id(name)
        if ids[key] and i is not None and i not in ids[key]:
            out[key] = (name, i)
    return out


def stop_at_named_eos(folder: Path, tok, cfg: ModelConfig) -> list[str]:
    """Add the eos token tokenizer_config.json names to cfg.eos_token_ids when config.json lacks
    it (generation stops at both) -> one note per token named otherwise, for the user."""
    notes = []
    for key, (name, i) in named_tokens(folder, tok, cfg).items():
        was = cfg.eos_token_ids if key == "eos_token" else cfg.bos_token_id
        if key == "eos_token":
            cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | {i})
            notes.append(f"tokenizer_config.json's eos_token {name!r} (id {i}) is not "
                         f"config.json's eos_token_id {was}: generation stops at both")
        else:
            notes.append(f"tokenizer_config.json's bos_token {name!r} (id {i}) is not "
                         f"config.json's bos_token_id {was}: prompts begin as the template "
                         f"writes them")
    return notes


def _tokenizer_config_tokens(folder: Path) -> dict:
    """bos_token / eos_token as tokenizer_config.json names them (a string or {"content": ...});
    {} without a readable file (read_config refuses a bad one)."""
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
