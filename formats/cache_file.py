"""A compressed cache in a file: compress once, with no question in sight, answer later (METHOD.md
§8.1, §11's query-agnostic setting, across processes).

The file is safetensors (no pickle, formats/tensor_file.py): its header's JSON names every tensor,
our state is JSON in its metadata, and its last tensor is the sha256 of every byte before it.
save_cache writes a cache.KVCache or cache.EvictingCache; load_cache reads it back, straight to
the model's device, after checking that this model, tokenizer, dtype and gate made it.
"""
import hashlib
import json
import os
import struct
import time

import torch
from safetensors import SafetensorError, safe_open

from cache import EvictingCache, KVCache, plan_prefill
from formats.gate_file import gate_sha256
from formats.tensor_file import checksum_ok, tensor_bytes, write_safetensors
from kernels import RaggedKV, WindowKV, _ranges

CACHE_FORMAT, CACHE_VERSION = "fastkvzip-kv-cache", 1


class CacheFileError(Exception):
    """A saved cache this model cannot answer from (another model, tokenizer or dtype, another
    format version, a truncated or corrupt file): one line, nothing loaded."""


def save_cache(path, cache, model, ids, last_logits, n_protected=None, method=None, budget=None,
               chunk_size=None, window=None, prefill_seconds=None):
    """Write `cache` to `path`: one safetensors file, written atomically (a failed write, a full
    disk, leaves no file: cli.WriteError), that load_cache answers from later, in this process or
    another, with the same greedy tokens. model: the model it was built with (its identity is
    recorded); ids: the prompt it prefilled (system prompt ⊕ context), whose first n_protected are
    the system prompt (default: an EvictingCache's own, else 0); last_logits: the logits after the
    newest token (a question-less answer starts there). The other values are recorded as given
    (what made the cache); the budget plan (cache.plan_prefill) is derived."""
    dtype = model.model.embed_tokens.weight.dtype
    if getattr(model, "identity", None) is None:
        raise ValueError("the model has no identity to record: load it with model.load_model")
    if cache.dtype != dtype:
        raise ValueError(f"the cache holds {cache.dtype}, the model runs in {dtype}")
    ids = torch.as_tensor(list(ids), dtype=torch.long)
    assert len(ids) <= cache.n_seen, "ids: the prompt this cache prefilled"
    own = getattr(cache, "n_protected", None)
    assert None in (own, n_protected) or own == n_protected, "the cache knows its system prompt"
    n_protected = (n_protected if own is None else own) or 0
    tensors, state = _saved(cache)
    plan = None
    if None not in (budget, chunk_size, window) and len(ids) > n_protected:
        plan = vars(plan_prefill(len(ids) - n_protected, budget, chunk_size, window))
    state.update(model=model.identity, dtype=str(cache.dtype).removeprefix("torch."),
                 n_protected=n_protected, n_prompt=len(ids), n_context=len(ids) - n_protected,
                 ids_sha256=_ids_sha256(ids), method=method, budget=budget,
                 chunk_size=chunk_size, window=window, plan=plan,
                 prefill_seconds=prefill_seconds)
    tensors.update(ids=ids, last_logits=last_logits.detach().reshape(-1))
    write_safetensors(path, tensors, {"format": CACHE_FORMAT, "fastkvzip": json.dumps(state),
                                      "format_version": str(CACHE_VERSION)})


def _saved(cache):
    """(tensors, JSON state): everything the cache needs to go on exactly. Every layer's kept rows
    as they lie (a ring's too), without slack: k, v, pos, score, and rows per head. An
    EvictingCache adds what eviction goes on from: the protected length, the level, decode-time
    eviction's settings and its buffer of attention inputs not yet scored, the gate's hash, and a
    random scorer's generator (its next scores)."""
    tensors, layers = {}, []
    for i, kv in enumerate(cache.layers):
        if not isinstance(kv, RaggedKV):
            raise ValueError("a member of a batch is not saved: let it leave the batch first")
        rows = _ranges(kv.starts, kv.lens).to(kv.device)
        for name in ("k", "v", "pos", "score"):
            tensors[f"layer.{i}.{name}"] = getattr(kv, name)[rows]
        tensors[f"layer.{i}.lens"] = kv.lens
        if isinstance(kv, WindowKV):
            tensors[f"layer.{i}.first"] = kv.first
            layers.append(dict(window=kv.window, ring=kv.ring))
        else:
            layers.append(dict(window=None))
    state = dict(cache="KVCache", n_seen=cache.n_seen, peak_nbytes=cache.peak_nbytes,
                 layers=layers)
    if not isinstance(cache, EvictingCache):
        return tensors, state
    for layer, hidden in cache.buffer.items():
        if hidden:
            tensors[f"buffer.{layer}"] = torch.cat(hidden)
    generator = getattr(cache.scorer, "generator", None)
    if generator is not None:
        tensors["scorer.generator"] = generator.get_state()
    gates = getattr(cache.scorer, "gates", None)
    state.update(cache="EvictingCache", level=cache.level, decoding=cache.decoding,
                 decode_tokens_per_head=cache.decode_tokens_per_head,
                 decode_buffer=cache.decode_buffer, decode_window=cache.decode_window,
                 decode_sinks=cache.decode_sinks,
                 scorer=type(cache.scorer).__name__ if cache.scorer is not None else None,
                 gate_sha256=gate_sha256(gates) if gates is not None else None)
    return tensors, state


def _restore(cache, tensors, state):
    """The inverse of _saved, into an empty cache; the rows stay in the tensors given (on the
    device). Regions without slack: the next append re-lays them out, as after an eviction."""
    cfg = cache.cfg
    if len(state["layers"]) != cfg.num_hidden_layers:
        raise CacheFileError(f"it holds {len(state['layers'])} layers, the model has "
                             f"{cfg.num_hidden_layers}")
    for i, spec in enumerate(state["layers"]):
        kv = cache.layers[i]
        sliding = isinstance(kv, WindowKV)
        if spec["window"] != (kv.window if sliding else None):
            raise CacheFileError(f"its layer {i} has window {spec['window']}, the model's not")
        k, v, pos, score = (tensors[f"layer.{i}.{n}"] for n in ("k", "v", "pos", "score"))
        lens = tensors[f"layer.{i}.lens"].cpu()
        n = int(lens.sum())
        if (lens.shape != (kv.n_heads,) or bool((lens < 0).any()) or k.shape != (n, kv.head_dim)
                or v.shape != k.shape or pos.shape != (n,) or score.shape != (n,)):
            raise CacheFileError(f"layer {i}'s tensors do not fit the model's {kv.n_heads} KV "
                                 f"heads of {kv.head_dim}")
        kv.k, kv.v, kv.pos, kv.score = k, v, pos, score
        kv.lens, kv.caps, kv.starts = lens.clone(), lens.clone(), torch.cumsum(lens, 0) - lens
        if sliding:
            kv.first, kv.ring = tensors[f"layer.{i}.first"].cpu(), bool(spec["ring"])
    cache.n_seen, cache.peak_nbytes = int(state["n_seen"]), cache.nbytes  # this process's peak
    if not isinstance(cache, EvictingCache):
        return
    cache.decoding = bool(state["decoding"])
    for layer in cache.compressed:
        if f"buffer.{layer}" in tensors:
            cache.buffer[layer] = [tensors[f"buffer.{layer}"]]
    if "scorer.generator" in tensors and cache.scorer is not None:  # needed to go on scoring
        cache.scorer.generator.set_state(tensors["scorer.generator"].cpu())


def _ids_sha256(ids):
    return hashlib.sha256(tensor_bytes(ids.to(torch.int64))).hexdigest()


def read_header(path):
    """(header, our JSON state) of a cache file, checked: ours, this format version, every byte
    there. Reads the header only (kilobytes)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CacheFileError(f"cache file {path} is truncated ({size} bytes)")
            n = struct.unpack("<Q", f.read(8))[0]
            if n > min(size - 8, 100 << 20):
                # n is the file's first 8 bytes: never printed (they may be anyone's text)
                raise CacheFileError(f"cache file {path} is not a saved cache, or is truncated "
                                     f"(the header length it starts with exceeds its {size} "
                                     "bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CacheFileError(f"cannot read cache file {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CacheFileError(f"cache file {path} is corrupt (its header is not JSON)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
        raise CacheFileError(f"{path} is not a saved KV cache (no {CACHE_FORMAT!r} metadata)")
    if meta.get("format_version") != str(CACHE_VERSION):
        raise CacheFileError(f"cache file {path} has format version {meta.get('format_version')}; "
                             f"this version reads version {CACHE_VERSION}: save the cache again")
    try:
        state = json.loads(meta["fastkvzip"])
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        checksum = header["checksum"]["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CacheFileError(f"cache file {path} is corrupt (its header lacks what this format "
                             f"writes)") from None
    if 8 + n + end != size:
        raise CacheFileError(f"cache file {path} is truncated ({size} of {8 + n + end} bytes)")
    if checksum != [end - 32, end]:
        raise CacheFileError(f"cache file {path} is corrupt (no checksum in its last 32 bytes)")
    return header, state


def check_cache_file(path, identity, dtype):
    """The state of cache file `path` (read_header), refused unless made by the model of this
    identity (model.model_identity) in `dtype`: what a caller checks before the weights load."""
    _, state = read_header(path)
    for key, what in (("config_sha256", "another model (another config.json)"),
                      ("weights_sha256", "another model (other weights, the same config)"),
                      ("tokenizer_sha256", "another tokenizer")):
        if state["model"].get(key) != identity.get(key):
            raise CacheFileError(f"cache file {path} was made by {what}: not answered from here")
    dtype = str(dtype).removeprefix("torch.")
    if state["dtype"] != dtype:
        raise CacheFileError(f"cache file {path} holds {state['dtype']} keys and values, the model "
                             f"runs in {dtype}: load the model in {state['dtype']}")
    return state


def load_cache(path, model, scorer=None, verify=True):
    """A cache saved by save_cache, read straight to the model's device (safetensors maps the
    file), ready to answer as the cache that was saved. Refuses (CacheFileError) a file made by
    another model (config, weights), tokenizer or dtype, of another format version, truncated or
    corrupt (verify: the file's sha256, about a second per GB). scorer: what scores decoded tokens,
    for a cache saved with decode-time eviction: the same kind, and for the gate the same gate.
    -> (cache, info): info holds the prompt ids, n_protected, last_logits, what made the cache
    (method, budget, chunk_size, window, plan, prefill_seconds, prefill_peak_kv_bytes,
    decode_tokens_per_head), kv_bytes, file_bytes and load_seconds."""
    t0 = time.perf_counter()
    weight = model.model.embed_tokens.weight
    state = check_cache_file(path, getattr(model, "identity", None) or {}, weight.dtype)
    evicting = state["cache"] == "EvictingCache"
    if evicting and state["decode_tokens_per_head"] is not None:
        if scorer is None or type(scorer).__name__ != state["scorer"]:
            raise CacheFileError(f"cache file {path} evicts while decoding, scored by "
                                 f"{state['scorer']}: give that scorer, not "
                                 f"{type(scorer).__name__}")
        gates = getattr(scorer, "gates", None)
        if gates is not None and gate_sha256(gates) != state["gate_sha256"]:
            raise CacheFileError(f"cache file {path} was made with another gate (gate sha256 "
                                 f"{state['gate_sha256'][:12]}): give that gate")
    if verify and not checksum_ok(path):
        raise CacheFileError(f"cache file {path} is corrupt (its checksum does not match)")
    try:
        with safe_open(str(path), framework="pt", device=str(weight.device)) as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CacheFileError(f"cache file {path} is corrupt ({' '.join(str(e).split())})") from None
    ids = tensors["ids"].cpu()
    if len(ids) != state["n_prompt"] or _ids_sha256(ids) != state["ids_sha256"]:
        raise CacheFileError(f"cache file {path} is corrupt (its prompt ids do not match its hash)")
    if evicting:
        cache = EvictingCache(model.config, scorer, weight.dtype, weight.device,
                              n_protected=state["n_protected"], level=state["level"],
                              decode_tokens_per_head=state["decode_tokens_per_head"],
                              decode_buffer=state["decode_buffer"],
                              decode_window=state["decode_window"],
                              decode_sinks=state["decode_sinks"])
    else:
        cache = KVCache(model.config, weight.dtype, weight.device)
    try:
        _restore(cache, tensors, state)
    except (KeyError, CacheFileError) as e:
        raise CacheFileError(f"cache file {path} does not fit the model: {e}") from None
    info = {k: state.get(k) for k in ("method", "budget", "chunk_size", "window", "plan",
                                      "n_context", "n_protected", "prefill_seconds",
                                      "decode_tokens_per_head")}
    info["prefill_peak_kv_bytes"] = state["peak_nbytes"]
    info.update(ids=ids.tolist(), last_logits=tensors["last_logits"], kv_bytes=cache.nbytes,
                file_bytes=os.path.getsize(path), load_seconds=time.perf_counter() - t0)
    return cache, info
