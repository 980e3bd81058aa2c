"""
Gate files: what a gate (gate.Gates) looks like on disk, and how a program finds the one for a
model.

- Our format: safetensors, per-layer tensors `layers.{i}.<authors' key>` in the authors' shapes
  and dtypes (and `layers.{i}.cut_offset` (H,) in a calibrated gate, METHOD.md §13.17), with JSON
  metadata (model, layers, training summary) under "fastkvzip" (save_gate,
  load_gate, gate_metadata).
- The authors' released `.pt` files (METHOD.md §2), read with torch.load(weights_only=True) and a
  short list of numpy globals: a pickle that would import anything else is refused before it runs.
- `gate_sha256`: the one name of a gate, the hash of its tensors (a path or a loaded Gates).
- `resolve_gate`: explicit path -> the gate bundled in gates/ -> the authors' released gate.

Everything here raises GateError with a one-line message; the programs print it and exit.
"""
import hashlib
import json
import os
import pickle
import re
import stat
import zipfile
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

from cli import ALIASES, atomic_path
from gate import Gates
from kernels import ArgumentError


class GateError(Exception):
    """A gate that cannot be used (missing, unsafe, or shaped for another model). One-line
    messages."""


LAYER_KEYS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight",
              "k_base", "b")
GATE_FORMAT = "fastkvzip-gate/1"
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GATES_DIR = Path(__file__).resolve().parent.parent / "gates"  # gates bundled with the repository
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
    if any("cut_offset" in layer for layer in layers):  # ours: a calibrated gate (METHOD.md §13.17)
        for i, layer in enumerate(layers):
            t = layer.get("cut_offset")
            if not (torch.is_tensor(t) and t.dtype == torch.float32 and tuple(t.shape) == (H,)):
                got = (f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                       if torch.is_tensor(t) else "missing")
                raise GateError(f"gate layer {i}: cut_offset is {got}, expected float32 ({H},) in "
                                "every layer of a calibrated gate")
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
      shapes and dtypes (a calibrated gate's `layers.{i}.cut_offset` beside them), plus JSON
      metadata in the header under "fastkvzip". meta: free-form
      JSON-able dict; conventional keys "model" (id), "layers" (compressed layer ids), "training"
      (summary).
    - the authors' layout (`path` ends in .pt, METHOD.md §2), which their code and kvpress's
      FastKVzipPress load: torch.save({"module": [layer l's state dict, in their key order]}), with
      the validation curves "loss" and "acc", (evaluations, layers), when `curves` = (loss, acc) is
      given. Only tensors inside, so torch.load(weights_only=True) reads it; `meta` does not travel
      in this layout, and a calibrated gate is refused (GateError: no place for its offsets)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".pt":
        if gates.cut_offset.any():
            raise GateError(f"cannot save {path}: the authors' .pt layout has no place for a "
                            "calibrated gate's cut offsets (METHOD.md §13.17); save it as "
                            ".safetensors")
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


# the most a gate file may unpack to when no model is given (gate_sha256 of a path): a float32 gate
# at D' = S = 64 for a 70B-sized model (80 layers, hidden 8192, 8 KV heads, group 8) is ~3 GB
MAX_GATE_BYTES = 4 << 30
MAX_GATE_DIM = 64  # bounds D' and S in max_gate_bytes; the released gates have D' = S = 16


def max_gate_bytes(cfg=None):
    """The most bytes a gate file for model config `cfg` can hold unpacked, generously: every tensor
    in float32 (released gates are bf16), D' and S up to MAX_GATE_DIM (released: 16), plus 64 MiB
    for the training curves and the pickle, i.e. ~16x the released layout. No cfg: MAX_GATE_BYTES.
    (SmolLM2-135M: ~120 MB; Qwen2.5-14B: ~3 GB, against a 0.4 GB released gate.)"""
    if cfg is None:
        return MAX_GATE_BYTES
    d, r = _model_dims(cfg), MAX_GATE_DIM
    L, D, H, G = d["layers"], d["hidden"], d["H"], d["G"]
    per_layer = (H * G + H) * r * D + H * G * r + 2 * r + H * r * r + H * G
    return 4 * L * per_layer + (64 << 20)


def _check_zip_sizes(path, limit):
    """torch.save writes a zip: read its members' declared (uncompressed) sizes from the central
    directory, which costs a few kB, and refuse a total beyond `limit` before torch.load unpacks
    anything: a 1 MB archive of deflated zeros can declare 1 GiB, and torch's reader allocates
    each record at its declared size. A legacy (non-zip) torch file is not compressed: nothing to
    check."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return
        with zipfile.ZipFile(path) as z:
            declared = sum(info.file_size for info in z.infolist())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        raise GateError(f"gate {path} is not a readable torch file ({type(e).__name__})") from None
    if declared > limit:
        mib = lambda n: f"{n / 2**20:,.0f} MiB"
        raise GateError(f"gate {path} unpacks to {mib(declared)} (its zip's declared sizes), more "
                        f"than a gate for this model can hold (at most {mib(limit)}): refused "
                        "unread; pass the gate's own .pt or .safetensors file")


def _read_authors_pt(path, limit=MAX_GATE_BYTES):
    """The authors' released file (METHOD.md §2): torch.save({"module": [state dict per gate layer],
    "loss": ..., "acc": ...}). Loaded with weights_only=True: a pickle that would import anything
    beyond tensors, containers and numpy arrays is refused before it can run. An archive that
    declares more than `limit` bytes unpacked is refused before it is unpacked
    (_check_zip_sizes)."""
    _check_zip_sizes(path, limit)
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
    `.meta` holding the file's metadata. Raises GateError if the file is unsafe, malformed, shaped
    for another model (compressed-layer count, hidden size, KV heads, group size), or its scores
    cannot rank tokens (check_ranks); kernels.ArgumentError for arguments of the wrong kind."""
    check_call("load_gate", path, cfg, dtype, device)
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
        layers, meta = _read_authors_pt(path, max_gate_bytes(cfg))
    else:
        raise GateError(f"gate {path} is neither a safetensors file nor a torch.save file (the "
                        "authors' .pt)")
    dims = infer_dims(layers)
    # a diverged training writes NaN; a NaN score would evict at random
    for i, layer in enumerate(layers):
        for key in (*LAYER_KEYS, "cut_offset"):
            if key in layer and not torch.isfinite(layer[key]).all():
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
    check_ranks(gates, path)
    gates.meta = {**meta, "source": str(path), "tensors_sha256": _layers_sha256(layers)}
    return gates


def check_call(call, path, cfg, dtype=None, device=None):
    """load_gate's / resolve_gate's arguments, else an ArgumentError naming the first that is of
    the wrong kind (a model where its config belongs, a dtype given as text)."""
    try:
        device_ok = device is None or torch.device(device) is not None
    except (RuntimeError, TypeError):
        device_ok = False
    checks = (
        ("path", path, isinstance(path, (str, os.PathLike)) or call == "resolve_gate"
         and path is None, "a gate file's path"),
        ("cfg", cfg, all(hasattr(cfg, k) for k in ("compressed_layers", "hidden_size",
                                                   "num_key_value_heads")),
         "the model's config (model.config)"),
        ("dtype", dtype, dtype is None or dtype in GATE_DTYPES,
         "None or one of torch.float32, bfloat16, float16"),
        ("device", device, device_ok, "None or a torch device"))
    for name, value, ok, what in checks:
        if not ok:
            shown = repr(value) if isinstance(value, (str, int, float, torch.dtype, type(None))) \
                else type(value).__name__
            raise ArgumentError(f"{call}: {name} must be {what}, got {shown:.60}")


PROBE_TOKENS = 16  # check_ranks' probe: this many random hidden states, the same in each layer


@torch.no_grad()
def check_ranks(gates, source):
    """Refuse a gate whose scores cannot rank tokens: finite weights that are all zero, or so large
    (×1e30) that the projections overflow the norms or the sigmoid saturates, give every token the
    same score, and eviction then silently goes by position (the tie-break).

    The probe: PROBE_TOKENS hidden states drawn N(0, 1) from a generator seeded here (the global
    random state is untouched), cast to the gate's dtype on its device, scored by every layer at
    once in the gate's own arithmetic (bf16 projections for a released gate), as inference will.
    Refused: a non-finite score anywhere, or a (layer, KV head) whose scores are all equal
    (bit-equal fp32, which includes saturation: every token at exactly 0 or 1). Per head, not per
    layer: a gate whose bias b alone is huge saturates each head to its own constant, so a layer's
    scores still differ across heads while no head ranks its tokens. A trained gate's scores on
    random states spread widely (the bundled gates: ≥ 0.13 per head, 16 distinct values of 16); so
    do a freshly initialised Gates and random ones. Cost: one forward of PROBE_TOKENS tokens (0.1 s
    per 4 layers of a Qwen-14B-shaped bf16 gate on one CPU thread)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_TOKENS, gates.hidden, generator=gen)
    x = x.to(device=gates.q_weight.device, dtype=gates.dtype)
    scores = gates(x.expand(gates.n_layers, -1, -1)).float()  # (L, H, N)
    finite = torch.isfinite(scores).flatten(1).all(1)  # (L,)
    if not finite.all():
        l = int((~finite).nonzero()[0])
        raise GateError(f"gate {source}: layer {l} scores NaN or inf on random hidden states (its "
                        f"weights overflow {str(gates.dtype).removeprefix('torch.')}); the gate is "
                        "broken (retrain it, or pass another --gate)")
    flat = (scores == scores[..., :1]).all(-1)  # (L, H): every token scored the same
    if flat.any():
        l, h = (int(i) for i in flat.nonzero()[0])
        raise GateError(f"gate {source}: layer {l} head {h} gives every token the same score "
                        f"({float(scores[l, h, 0]):.3g}): its weights are degenerate (all zero, or "
                        "so large the scores saturate), so it cannot rank tokens and eviction "
                        "would go by position; retrain it, or pass another --gate")


def gate_sha256(gate):
    """The one name of a gate: sha256 of its tensors, the part that decides every score. `gate` is a
    gate file (ours or the authors' .pt) or a loaded `Gates`. A result names its gate by it, since a
    file's own sha256 also covers the metadata (a training summary, a corpus hash added later); the
    same tensors saved as .safetensors, as the authors' .pt, or held by a Gates loaded from either
    in the file's dtype hash the same. (A Gates holds its norms and sink keys in fp32: loaded from a
    file that keeps them in another dtype, or with another dtype=, it holds other tensors and
    hashes differently.)"""
    if isinstance(gate, Gates):
        return _layers_sha256([gate.layer_state_dict(l) for l in range(gate.n_layers)])
    layers, _ = (_read_safetensors(gate) if _file_kind(gate) == "safetensors"
                 else _read_authors_pt(gate))
    return _layers_sha256(layers)


def _layers_sha256(layers):
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
    check_call("resolve_gate", arg, cfg, dtype, device)
    if not arg and not isinstance(model_name, str):
        raise ArgumentError(f"resolve_gate: model_name must be the model's name (a string) to "
                            f"find its gate, got {model_name!r:.60}")
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
