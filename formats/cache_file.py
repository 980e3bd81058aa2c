"""A compressed cache in a file: compress once, with no question in sight, answer later (METHOD.md
§8.1, §11's query-agnostic setting, across processes).

The file is safetensors (no pickle, formats/tensor_file.py): its header's JSON names every tensor,
our state is JSON in its metadata, and its last tensor is the sha256 of every byte before it.
save_cache writes a cache.KVCache or cache.EvictingCache; load_cache reads it back, straight to
the model's device, after checking that this model, tokenizer, dtype and gate made it.

Everything in a file is input: read_header checks the header and every field of the state (type,
range, agreement with each other and with the tensors the header names) before anything else reads
them; load_cache checks the tensors' contents against the model. A file is opened once, and the
header, the state, the tensors and the checksum all come from that one open file (a file replaced
while it loads cannot lend one file's state to the other's tensors), read in order while hashed:
the bytes checked are the bytes used.
"""
import hashlib
import json
import math
import os
import stat
import struct
import time

import torch

from cache import LEVELS, EvictingCache, KVCache, WindowKV, plan_prefill
from formats.gate_file import gate_sha256
from formats.tensor_file import TORCH_DTYPES, read_tensors, tensor_bytes, write_safetensors
from gate import METHODS, Scorer
from kernels import ArgumentError, RaggedKV, _ranges
from model import Transformer
from prompts import check_ids

CACHE_FORMAT, CACHE_VERSION = "fastkvzip-kv-cache", 1
KV_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
MAX_HEADER = 100 << 20


def scorer_of(method):
    """What scores an EvictingCache of `method`, as a file names it: its gate.METHODS class's name,
    None for kvzip (its teacher's scores arrive once, after prefill: the cache holds no scorer)."""
    kind = METHODS[method]
    return kind.__name__ if kind.prefill else None


def method_of(scorer):
    """The method whose cache a scorer of this class name scores (scorer_of's inverse), or None."""
    return next((m for m, kind in METHODS.items() if kind and scorer_of(m) == scorer), None)


class CacheFileError(Exception):
    """A saved cache this model cannot answer from (another model, tokenizer or dtype, another
    format version, a truncated or corrupt file): one line, nothing loaded."""


def save_cache(path, cache, model, ids, last_logits, n_protected=None, method=None, budget=None,
               chunk_size=None, window=None, prefill_seconds=None):
    """Write `cache` to `path`: one safetensors file, written atomically (a failed write, a full
    disk, leaves no file: cli.WriteError), that load_cache answers from later, in this process or
    another, with the same greedy tokens. model: the model it was built with (its identity is
    recorded); ids: the prompt it prefilled (system prompt ⊕ context: those generate.prefill gave
    it, which the cache keeps), whose first n_protected are the system prompt (default: an
    EvictingCache's own, else 0); last_logits: the logits after the newest token (a question-less
    answer starts there). method: what the cache is ("full" for a KVCache, else its scorer's
    method; another is refused); budget: 1.0 for a KVCache (it keeps every pair, whatever was
    asked), else as given, or none (load_cache then reports the fraction the rows keep). The other
    values are recorded as given (what made the cache); the budget plan (cache.plan_prefill) is
    derived. kernels.ArgumentError (a ValueError) for a cache or values that do not belong
    together."""
    _check_call("save_cache", path=path, model=model, cache=cache, last_logits=last_logits)
    check_ids("save_cache", ids, model.config.vocab_size)
    if not (n_protected is None or isinstance(n_protected, int) and not isinstance(n_protected,
                                                                                   bool)):
        raise ArgumentError(f"save_cache: n_protected must be an integer or None, got "
                            f"{n_protected!r}")
    dtype = model.model.embed_tokens.weight.dtype
    if getattr(model, "identity", None) is None:
        raise ArgumentError("the model has no identity to record: load it with model.load_model")
    if cache.dtype != dtype:
        raise ArgumentError(f"the cache holds {cache.dtype}, the model runs in {dtype}")
    ids = torch.as_tensor(list(ids), dtype=torch.long)
    prefilled = getattr(cache, "prefilled_ids", None)
    if prefilled is None:
        raise ArgumentError("the cache does not know which ids it prefilled: prefill it with "
                            "generate.prefill (or load it with load_cache), then save it")
    if not torch.equal(ids, prefilled):
        raise ArgumentError(f"ids are not the {len(prefilled)} ids this cache prefilled: give "
                            f"those (system prompt ⊕ context)")
    own = getattr(cache, "n_protected", None)
    if None not in (own, n_protected) and own != n_protected:
        raise ArgumentError(f"n_protected {n_protected}, but the cache protects {own}")
    n_protected = (n_protected if own is None else own) or 0
    if not 0 <= n_protected <= len(ids):
        raise ArgumentError(f"n_protected {n_protected} must be in [0, {len(ids)}] (the system "
                            f"prompt's ids)")
    last_logits = last_logits.detach().reshape(-1).float()
    if last_logits.numel() != model.config.vocab_size:
        raise ArgumentError(f"last_logits holds {last_logits.numel()} values, not the model's "
                            f"{model.config.vocab_size}: give the logits after the newest token")
    if not bool(torch.isfinite(last_logits).all()):
        raise ArgumentError(f"last_logits are inf/NaN (computed in {dtype}): not "
                            f"saved{_wider(dtype)}")
    at, newest = getattr(cache, "newest_logits", None) or (None, None)  # generate.newest's note
    if at == cache.n_seen and not torch.equal(newest.detach().reshape(-1).float().cpu(),
                                              last_logits.cpu()):
        past = cache.n_seen - len(prefilled)
        held = f", {past} tokens past its prompt (a question or an answer)" if past else ""
        raise ArgumentError(f"save_cache: last_logits are not the logits after the cache's newest "
                            f"token{held}: roll it back to a checkpoint taken before them "
                            f"(cache.rollback), or give what generate.prefill, begin_answer or "
                            f"decode_one last returned")
    evicting = isinstance(cache, EvictingCache)
    scorer = type(cache.scorer).__name__ if evicting and cache.scorer is not None else None
    what = method_of(scorer) if evicting else "full"
    if method is None:
        method = what
    elif method != what:
        raise ArgumentError(f"method {method!r}, but the cache is "
                            f"{'scored by ' + str(scorer) if evicting else 'a full KVCache'} "
                            f"({what}): give method={what!r}")
    if not evicting:  # whatever budget was asked (--method full --budget 0.3), it keeps all
        budget = 1.0
    elif budget is not None and not (isinstance(budget, (int, float))
                                     and not isinstance(budget, bool) and 0 < budget <= 1):
        raise ArgumentError(f"budget must be in (0, 1] or None, got {budget!r}")
    tensors, state = _saved(cache)
    plan = None
    if None not in (budget, chunk_size, window) and len(ids) > n_protected:
        plan = vars(plan_prefill(len(ids) - n_protected, budget, chunk_size, window))
    state.update(model=model.identity, dtype=str(cache.dtype).removeprefix("torch."),
                 n_protected=n_protected, n_prompt=len(ids), n_context=len(ids) - n_protected,
                 ids_sha256=_ids_sha256(ids), method=method, budget=budget,
                 chunk_size=chunk_size, window=window, plan=plan,
                 prefill_seconds=prefill_seconds)
    tensors.update(ids=ids, last_logits=last_logits)
    write_safetensors(path, tensors, {"format": CACHE_FORMAT, "fastkvzip": json.dumps(state),
                                      "format_version": str(CACHE_VERSION)})


# what save_cache / load_cache take: (types, in words)
_ARGUMENTS = {"path": ((str, os.PathLike), "a file path"),
              "model": (Transformer, "a model.Transformer (model.load_model)"),
              "cache": (KVCache, "a cache.KVCache or EvictingCache"),
              "last_logits": (torch.Tensor, "a tensor"),
              "scorer": ((Scorer, type(None)), "None or a gate.Scorer")}


def _check_call(call, **given):
    """Each argument of a save_cache / load_cache call of the type it must have, else an
    ArgumentError naming it (not an AttributeError later)."""
    for name, value in given.items():
        types, what = _ARGUMENTS[name]
        if not isinstance(value, types):
            raise ArgumentError(f"{call}: {name} must be {what}, got {type(value).__name__}")


def _wider(dtype):
    """Advice for non-finite values: a wider dtype, only where one exists."""
    return "" if dtype == torch.float32 else "; the model may outgrow it: run it in float32"


def _saved(cache):
    """(tensors, JSON state): everything the cache needs to go on exactly. Every layer's kept rows
    as they lie (a ring's too), without slack: k, v, pos, score, and rows per head. An
    EvictingCache adds what eviction goes on from: the protected length, the level, decode-time
    eviction's settings and its buffer of attention inputs not yet scored, the gate's hash, and a
    random scorer's generator (its next scores)."""
    tensors, layers = {}, []
    for i, kv in enumerate(cache.layers):
        if not isinstance(kv, RaggedKV):
            raise ArgumentError("a member of a batch is not saved: let it leave the batch first")
        rows = _ranges(kv.starts, kv.lens).to(kv.device)
        for name in ("k", "v", "pos", "score"):
            tensors[f"layer.{i}.{name}"] = getattr(kv, name)[rows]
        if not (torch.isfinite(tensors[f"layer.{i}.k"]).all()
                and torch.isfinite(tensors[f"layer.{i}.v"]).all()):
            raise ArgumentError(f"layer {i} holds inf/NaN keys or values (computed in "
                                f"{cache.dtype}): not saved{_wider(cache.dtype)}")
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
    for layer, q in cache.queries.items():  # a rescoring scorer's last queries (SnapKV, R-KV)
        tensors[f"queries.{layer}"] = q
    generator = getattr(cache.scorer, "generator", None)
    if generator is not None:
        tensors["scorer.generator"] = generator.get_state()
    gates = getattr(cache.scorer, "gates", None)
    state.update(cache="EvictingCache", level=cache.level, decode_level=cache.decode_level,
                 decoding=cache.decoding,
                 decode_tokens_per_head=cache.decode_tokens_per_head,
                 decode_buffer=cache.decode_buffer, decode_window=cache.decode_window,
                 decode_sinks=cache.decode_sinks,
                 scorer=type(cache.scorer).__name__ if cache.scorer is not None else None,
                 decode_redundancy=getattr(cache.scorer, "redundancy", None),
                 gate_sha256=gate_sha256(gates) if gates is not None else None)
    return tensors, state


# -------------------------------------------------------------------------------------------------
# reading: one open file, its header and state checked field by field

def _kind(mode):
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _open(path):
    """-> (the cache file open for reading, its size). Anything but a regular file is refused
    before it is opened (a FIFO would block the open, a device never ends); opened without
    blocking, and checked again once open, in case the path changed in between (O_NONBLOCK does
    nothing to a regular file's reads)."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            f = os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb")
            st = os.fstat(f.fileno())
            mode = st.st_mode
            if stat.S_ISREG(mode):
                return f, st.st_size
            f.close()
    except OSError as e:
        raise CacheFileError(f"cannot read cache file {path}: {e.strerror or e}") from None
    raise CacheFileError(f"{path} is not a saved KV cache: it is {_kind(mode)}, not a regular "
                            f"file; give the file --save-cache wrote")


def _header(f, path, size):
    """From the open file at its start: (header, state, the bytes read: 8 + the header). Never
    echoes the file's bytes: a file that is not ours is "not a saved KV cache"."""
    def bad(what):
        return CacheFileError(f"cache file {path} is corrupt ({what}); save the cache again")

    if size < 9:
        raise CacheFileError(f"cache file {path} is truncated or not a saved KV cache (only "
                             f"{size} bytes)")
    head = f.read(9)
    n = struct.unpack("<Q", head[:8])[0]
    if head[8:9] != b"{" or not 2 <= n <= MAX_HEADER:  # a safetensors header is a JSON object
        raise CacheFileError(f"{path} is not a saved KV cache (not safetensors)")
    if 8 + n > size:
        raise CacheFileError(f"cache file {path} is truncated ({size} bytes: its header is cut)")
    raw = head + f.read(n - 1)
    try:
        header = json.loads(raw[8:])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise CacheFileError(f"{path} is not a saved KV cache (not safetensors: its header is "
                             f"not JSON)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
        raise CacheFileError(f"{path} is not a saved KV cache (no {CACHE_FORMAT!r} metadata)")
    version = meta.get("format_version")
    if version != str(CACHE_VERSION):
        shown = version if isinstance(version, str) and version.isdigit() and len(version) < 6 \
            else "unknown"
        raise CacheFileError(f"cache file {path} has format version {shown}; this version reads "
                             f"version {CACHE_VERSION}: save the cache again")
    try:
        state = json.loads(meta["fastkvzip"])
    except (KeyError, TypeError, ValueError, RecursionError):
        raise bad("its state is not JSON") from None
    end = _tiling(header, bad)
    if 8 + n + end > size:
        raise CacheFileError(f"cache file {path} is truncated ({size} of {8 + n + end} bytes)")
    if 8 + n + end < size:
        raise CacheFileError(f"cache file {path} is corrupt ({size - 8 - n - end} bytes after its "
                             f"end: not the file --save-cache wrote); save the cache again")
    _check_state(state, header, bad)
    return header, state, raw


def _tiling(header, bad):
    """The data's length, once every tensor of the header is checked: a known dtype, a shape, and
    byte offsets that hold exactly that shape, back to back from 0, the 32-byte checksum last."""
    spans = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(spec, dict) and spec.get("dtype") in TORCH_DTYPES
              and isinstance(spec.get("shape"), list) and isinstance(spec.get("data_offsets"), list)
              and len(spec["data_offsets"]) == 2
              and all(_int(x, 0) for x in spec["shape"] + spec["data_offsets"]))
        if not ok:
            raise bad(f"its header's entry {name[:40]!r} is not a tensor's")
        begin, end = spec["data_offsets"]
        itemsize = TORCH_DTYPES[spec["dtype"]].itemsize
        if end - begin != math.prod(spec["shape"]) * itemsize:
            raise bad(f"tensor {name[:40]!r}'s bytes do not hold its shape")
        spans.append((begin, end, name))
    spans.sort()
    if not spans or spans[-1][2] != "checksum" or header["checksum"]["dtype"] != "U8" \
            or header["checksum"]["shape"] != [32]:
        raise bad("no checksum in its last 32 bytes")
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise bad("its tensors do not lie back to back")
        at = end
    return at


def _int(x, low=None):
    return isinstance(x, int) and not isinstance(x, bool) and (low is None or x >= low)


def _nonnegative(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _fraction(x, low_open=True):
    return _nonnegative(x) and (x > 0 or not low_open) and x <= 1


def _optional(check):
    return lambda x: x is None or check(x)


STATE = {  # every field of the state: what a valid value is
    "cache": lambda x: x in ("KVCache", "EvictingCache"),
    "n_seen": lambda x: _int(x, 1), "peak_nbytes": lambda x: _int(x, 0),
    "layers": lambda x: isinstance(x, list) and len(x) > 0,
    "model": lambda x: isinstance(x, dict), "dtype": lambda x: x in KV_DTYPES,
    "n_protected": lambda x: _int(x, 0), "n_prompt": lambda x: _int(x, 1),
    "n_context": lambda x: _int(x, 0),
    "ids_sha256": lambda x: isinstance(x, str) and len(x) == 64,
    "method": _optional(lambda x: x in METHODS), "budget": _optional(_fraction),
    "chunk_size": _optional(lambda x: _int(x, 1)), "window": _optional(lambda x: _int(x, 0)),
    "plan": _optional(lambda x: isinstance(x, dict) and set(x) == {"window", "segment_ratio"}
                      and _int(x["window"], 0) and _fraction(x["segment_ratio"], False)),
    "prefill_seconds": _optional(_nonnegative),
}
EVICTING_STATE = {
    "level": lambda x: x in LEVELS, "decode_level": lambda x: x in LEVELS,
    "decoding": lambda x: isinstance(x, bool),
    "decode_tokens_per_head": _optional(lambda x: _int(x, 1)),
    "decode_buffer": lambda x: _int(x, 1), "decode_window": lambda x: _int(x, 0),
    "decode_sinks": lambda x: _int(x, 0),
    "scorer": _optional(lambda x: isinstance(x, str) and x.isidentifier()),
    "gate_sha256": _optional(lambda x: isinstance(x, str) and len(x) == 64),
    "decode_redundancy": _optional(_nonnegative),
}


def _check_state(state, header, bad):
    """Every field of the state (its type and range), how they agree, and the tensors the header
    must name for them (dtype, rank, lengths): before anything reads them."""
    if not isinstance(state, dict):
        raise bad("its state is not a JSON object")
    fields = dict(STATE, **(EVICTING_STATE if state.get("cache") == "EvictingCache" else {}))
    if "decode_level" in fields and "decode_level" not in state:
        state["decode_level"] = state.get("level")  # saved before it had its own: decoded at level
    if "decode_redundancy" in fields:  # saved before it was recorded: the gate's default
        state.setdefault("decode_redundancy", None)
    for key, valid in fields.items():
        if key not in state:
            raise bad(f"its state lacks {key!r}")
        if not valid(state[key]):
            raise bad(f"its state's {key!r} is not valid")
    if state["n_protected"] > state["n_prompt"]:
        raise bad("n_protected exceeds its prompt")
    if state["n_prompt"] > state["n_seen"]:
        raise bad("its prompt is longer than n_seen, the tokens it holds")
    if state["n_context"] != state["n_prompt"] - state["n_protected"]:
        raise bad("n_context is not its prompt less n_protected")
    evicting = state["cache"] == "EvictingCache"
    if (state["method"] == "full") == evicting and state["method"] is not None:
        raise bad(f"method {state['method']} with a {state['cache']}")
    if not evicting and state["budget"] not in (None, 1.0):
        raise bad("a budget below 1.0 with a full KVCache")
    if evicting:
        scorer = state["scorer"]
        if state["method"] is not None and scorer_of(state["method"]) != scorer:
            raise bad(f"method {state['method']} scored by {scorer}")
        if state["decode_tokens_per_head"] is not None and scorer is None:
            raise bad("decode-time eviction without a scorer")
        if (state["gate_sha256"] is None) != (scorer != "GateScorer"):
            raise bad("a gate hash without a gate, or a gate without one")
        if state["decode_redundancy"] is not None and scorer != "GateScorer":
            raise bad("a redundancy factor without a gate")
    dtype = KV_DTYPES[state["dtype"]]
    want = {"ids": ("I64", 1), "last_logits": ("F32", 1)}
    for i, spec in enumerate(state["layers"]):
        if not (isinstance(spec, dict) and _optional(lambda x: _int(x, 1))(spec.get("window"))
                and (spec.get("window") is None or isinstance(spec.get("ring"), bool))):
            raise bad(f"its state's layer {i} is not valid")
        want.update({f"layer.{i}.k": (dtype, 2), f"layer.{i}.v": (dtype, 2),
                     f"layer.{i}.pos": ("I64", 1), f"layer.{i}.score": ("F32", 1),
                     f"layer.{i}.lens": ("I64", 1)})
        if spec["window"] is not None:
            want[f"layer.{i}.first"] = ("I64", 1)
    names = set(header) - {"__metadata__", "checksum"}
    optional = {n for n in names if n.split(".")[0] in ("buffer", "queries")
                and n.split(".", 1)[1].isdigit()} if evicting else set()
    if evicting and state["scorer"] == "RandomScorer":
        optional |= {"scorer.generator"} & names
    want.update({n: (dtype, 2) for n in optional if n.startswith("buffer.")})
    want.update({n: (dtype, 3) for n in optional if n.startswith("queries.")})
    want.update({n: ("U8", 1) for n in optional if n == "scorer.generator"})
    if names - set(want):
        raise bad(f"an unknown tensor {sorted(names - set(want))[0][:40]!r}")
    for name, (dt, rank) in want.items():
        if name not in header:
            raise bad(f"no tensor {name!r}")
        if header[name]["dtype"] != dt or len(header[name]["shape"]) != rank:
            raise bad(f"tensor {name!r} is {header[name]['dtype']} of rank "
                      f"{len(header[name]['shape'])}, not {dt} of rank {rank}"
                      + (" as its state's dtype says" if dt == dtype else ""))
    if header["ids"]["shape"] != [state["n_prompt"]]:
        raise bad("its prompt ids are not n_prompt long")
    for i, spec in enumerate(state["layers"]):
        k, v, pos, score, lens = (header[f"layer.{i}.{n}"]["shape"]
                                  for n in ("k", "v", "pos", "score", "lens"))
        if v != k or pos != [k[0]] or score != [k[0]] or (
                spec["window"] is not None and header[f"layer.{i}.first"]["shape"] != lens):
            raise bad(f"layer {i}'s tensors do not agree in length")


def read_header(path):
    """(header, our JSON state) of a cache file, checked: a regular file, ours, this format
    version, every byte there, every field of the state valid. Reads the header only
    (kilobytes)."""
    f, size = _open(path)
    with f:
        return _header(f, path, size)[:2]


def _check_identity(path, state, identity, dtype):
    for key, what in (("config_sha256", "another model (another config.json)"),
                      ("weights_sha256", "another model (other weights, the same config)"),
                      ("tokenizer_sha256", "another tokenizer")):
        if state["model"].get(key) != identity.get(key):
            raise CacheFileError(f"cache file {path} was made by {what}: not answered from here")
    dtype = str(dtype).removeprefix("torch.")
    if state["dtype"] != dtype:
        raise CacheFileError(f"cache file {path} holds {state['dtype']} keys and values, the model "
                             f"runs in {dtype}: load the model in {state['dtype']}")


def check_cache_file(path, identity, dtype):
    """The state of cache file `path` (read_header), refused unless made by the model of this
    identity (model.model_identity) in `dtype`: what a caller checks before the weights load."""
    state = read_header(path)[1]
    _check_identity(path, state, identity, dtype)
    return state


def load_cache(path, model, scorer=None, verify=True):
    """A cache saved by save_cache, read straight to the model's device, ready to answer as the
    cache that was saved. The file is opened once: its header, state, tensors and checksum are
    read from that one open file, tensor by tensor (one at a time on the host), and hashed as they
    are read (verify: about a second per GB). Refuses (CacheFileError) a file made by another
    model (config, weights), tokenizer or dtype, of another format version, truncated, corrupt or
    inconsistent (every state field and the tensors' contents are checked). scorer: what scores
    decoded tokens, for a cache saved with decode-time eviction: the same kind, and for the gate
    the same gate.
    -> (cache, info): info holds the prompt ids, n_protected, last_logits, what made the cache
    (method: the file's, else what the cache is; budget: the file's, else the fraction of the
    context its compressed layers keep; chunk_size, window, plan, prefill_seconds,
    prefill_peak_kv_bytes, decode_tokens_per_head), kv_bytes, file_bytes and load_seconds."""
    t0 = time.perf_counter()
    _check_call("load_cache", path=path, model=model, scorer=scorer)
    weight = model.model.embed_tokens.weight
    f, size = _open(path)
    with f:
        header, state, raw = _header(f, path, size)
        _check_identity(path, state, getattr(model, "identity", None) or {}, weight.dtype)
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
            lam = state["decode_redundancy"]
            if lam is not None and getattr(scorer, "redundancy", None) != lam:
                raise CacheFileError(f"cache file {path} decodes with the gate's redundancy factor "
                                     f"λ = {lam:g}: give a scorer with that λ (generate.make_cache's "
                                     f"decode_redundancy)")
        digest = hashlib.sha256(raw) if verify else None
        try:
            tensors = read_tensors(f, header, len(raw), weight.device, digest)
            checksum = f.read(32)
        except EOFError:
            raise CacheFileError(f"cache file {path} is truncated (it changed while it was read)") \
                from None
        except OSError as e:
            raise CacheFileError(f"cannot read cache file {path}: {e.strerror or e}") from None
    if verify and digest.digest() != checksum:
        raise CacheFileError(f"cache file {path} is corrupt (its checksum does not match)")
    corrupt = lambda what: CacheFileError(f"cache file {path} is corrupt ({what}); save the cache "
                                          f"again")
    ids, logits, vocab = tensors["ids"].cpu(), tensors["last_logits"], model.config.vocab_size
    if _ids_sha256(ids) != state["ids_sha256"]:
        raise CacheFileError(f"cache file {path} is corrupt (its prompt ids do not match its hash)")
    if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise corrupt(f"prompt ids outside the vocabulary of {vocab}")
    if logits.shape != (vocab,):
        raise corrupt(f"its last logits hold {logits.numel()} values, the vocabulary {vocab}")
    if not bool(torch.isfinite(logits).all()):
        raise corrupt("inf/NaN last logits")
    if evicting:
        cache = EvictingCache(model.config, scorer, weight.dtype, weight.device,
                              n_protected=state["n_protected"], level=state["level"],
                              decode_level=state["decode_level"],
                              decode_tokens_per_head=state["decode_tokens_per_head"],
                              decode_buffer=state["decode_buffer"],
                              decode_window=state["decode_window"],
                              decode_sinks=state["decode_sinks"])
    else:
        cache = KVCache(model.config, weight.dtype, weight.device)
    _restore(cache, tensors, state, path, corrupt)
    cache.prefilled_ids = ids
    info = {k: state.get(k) for k in ("method", "budget", "chunk_size", "window", "plan",
                                      "n_context", "n_protected", "prefill_seconds",
                                      "decode_tokens_per_head")}
    # what the cache is, where the file does not say (save_cache given no method or budget)
    if info["method"] is None:
        info["method"] = (method_of(state["scorer"]) or state["scorer"]) if evicting else "full"
    if info["budget"] is None and evicting and info["n_context"]:
        per = cache.kept_fraction_per_layer(state["n_protected"], state["n_prompt"])
        info["budget"] = round(sum(per) / len(per), 4) or None
    info["prefill_peak_kv_bytes"] = state["peak_nbytes"]
    info.update(ids=ids.tolist(), last_logits=logits, kv_bytes=cache.nbytes,
                file_bytes=size, load_seconds=time.perf_counter() - t0)
    return cache, info


def _restore(cache, tensors, state, path, corrupt):
    """The inverse of _saved, into an empty cache, every tensor checked against the model and the
    state first; the rows stay in the tensors given (on the device). Regions without slack: the
    next append re-lays them out, as after an eviction."""
    cfg = cache.cfg
    if len(state["layers"]) != cfg.num_hidden_layers:
        raise CacheFileError(f"cache file {path} does not fit the model: it holds "
                             f"{len(state['layers'])} layers, the model has "
                             f"{cfg.num_hidden_layers}")
    n_seen = state["n_seen"]
    for i, spec in enumerate(state["layers"]):
        kv = cache.layers[i]
        sliding = isinstance(kv, WindowKV)
        if spec["window"] != (kv.window if sliding else None):
            raise CacheFileError(f"cache file {path} does not fit the model: its layer {i} has "
                                 f"window {spec['window']}, the model's not")
        k, v, pos, score = (tensors[f"layer.{i}.{n}"] for n in ("k", "v", "pos", "score"))
        lens = tensors[f"layer.{i}.lens"].cpu()
        if lens.shape != (kv.n_heads,) or k.shape[1] != kv.head_dim:
            raise CacheFileError(f"cache file {path} does not fit the model: layer {i}'s tensors "
                                 f"are not the model's {kv.n_heads} KV heads of {kv.head_dim}")
        if bool((lens < 0).any()) or int(lens.sum()) != k.shape[0]:
            raise corrupt(f"layer {i}'s rows per head do not add up to its rows")
        first = tensors[f"layer.{i}.first"].cpu() if sliding else torch.zeros_like(lens)
        if sliding and (bool((lens > kv.window).any()) or bool((first < 0).any())
                        or bool(((first > 0) & ((lens != kv.window) | (not spec["ring"]))).any())):
            raise corrupt(f"layer {i}'s ring does not fit its window of {kv.window}")
        # each head's positions, read from its oldest row: rising, within [0, n_seen)
        starts = torch.cumsum(lens, 0) - lens
        h = torch.repeat_interleave(torch.arange(kv.n_heads), lens)
        j = _ranges(torch.zeros_like(lens), lens)
        order = starts[h] + (first[h] + j) % lens.clamp_min(1)[h]
        p = pos.cpu()[order]
        if len(p) and (int(p.min()) < 0 or int(p.max()) >= n_seen
                       or bool(((p[1:] <= p[:-1]) & (h[1:] == h[:-1])).any())):
            raise corrupt(f"layer {i}'s positions are not rising within n_seen {n_seen}")
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise corrupt(f"layer {i} holds inf/NaN keys or values")
        if bool(score.isnan().any()):
            raise corrupt(f"layer {i} holds NaN scores")
        kv.k, kv.v, kv.pos, kv.score = k, v, pos, score
        kv.lens, kv.caps, kv.starts = lens.clone(), lens.clone(), starts
        if sliding:
            kv.first, kv.ring = first, spec["ring"]
    cache.n_seen, cache.peak_nbytes = n_seen, cache.nbytes  # this process's peak
    if not isinstance(cache, EvictingCache):
        return
    cache.decoding = state["decoding"]
    held = {int(n[7:]) for n in tensors if n.startswith("buffer.")}
    if held - set(cache.compressed):
        raise corrupt(f"a decode buffer for layer {min(held - set(cache.compressed))}, which "
                      f"is not compressed")
    lengths = {tensors[f"buffer.{layer}"].shape[0] for layer in held}
    if held and (held != set(cache.compressed) or len(lengths) != 1 or not state["decoding"]
                 or state["decode_tokens_per_head"] is None
                 or lengths.pop() >= state["decode_buffer"]):
        raise corrupt("its decode buffers do not agree with its decode-time eviction")
    for layer in held:
        hidden = tensors[f"buffer.{layer}"]
        if hidden.shape[1] != cfg.hidden_size or not bool(torch.isfinite(hidden).all()):
            raise corrupt(f"layer {layer}'s decode buffer is not {cfg.hidden_size} finite values "
                          f"a row")
        cache.buffer[layer] = [hidden]
    shape = (cfg.num_attention_heads, cfg.head_dim)
    for layer in {int(n[8:]) for n in tensors if n.startswith("queries.")}:
        q = tensors[f"queries.{layer}"]
        if layer not in cache.compressed or tuple(q.shape[1:]) != shape \
                or not 0 < q.shape[0] <= cache.decode_window or not bool(torch.isfinite(q).all()):
            raise corrupt(f"its queries for layer {layer} are not a compressed layer's last "
                          f"{cache.decode_window} of {shape} finite values")
        cache.queries[layer] = q
    if "scorer.generator" in tensors and cache.scorer is not None:  # needed to go on scoring
        try:
            cache.scorer.generator.set_state(tensors["scorer.generator"].cpu())
        except RuntimeError:
            raise corrupt("its random scorer's state is not a generator's") from None


def _ids_sha256(ids):
    return hashlib.sha256(tensor_bytes(ids.to(torch.int64))).hexdigest()
