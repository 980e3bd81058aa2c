"""
The feature store of train_gate.py (METHOD.md §5.1): for every document, the KVzip teacher's scores of its
context KV pairs and the compressed layers' attention-input hidden states, one safetensors shard per
document under --out/features, written atomically; a manifest that a resumed run must match; the
documents split over torchrun ranks; and FeatureStore, all shards as one memory-mapped token axis
for training.
"""
import hashlib
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import torch

from cli import UsageError
from model import DTYPES, load_model

FP16_FEATURES_ABOVE = 16 * 1024  # --feature-dtype auto: fp32 features above 16 KB per token are stored as fp16


def doc_key(name, ids):
    """Identity of a document's context: its token ids (and name), so a resume never mixes data."""
    h = hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes())
    h.update(name.encode())
    return h.hexdigest()[:16]


def shard_path(out, i):
    return Path(out) / "features" / f"doc{i:05d}.safetensors"


def partial_dir(path):
    """Where the shard `path` is written before it is renamed into place: a folder of its own, because
    safetensors itself stages the file under a random hidden name beside its target (.tmpXXXXXX, as large
    as the shard) that only a sweep of the folder can find after a SIGKILL."""
    return path.with_name(f".{path.stem}.partial")


def _sha256(data, f=None, length=0):
    """sha256 hex digest of `data` (bytes-like), or of `length` bytes read from file `f` at its position,
    a block at a time (one shard of an 8B model's long document holds gigabytes)."""
    h = hashlib.sha256()
    if f is None:
        h.update(data)
    while length > 0:
        block = f.read(min(length, 1 << 24))
        if not block:
            break  # the file ends early: the digest differs
        h.update(block)
        length -= len(block)
    return h.hexdigest()


def write_shard(path, hidden, scores, meta):
    """Atomically: write into partial_dir(path), then rename (a killed run never leaves half a shard where
    a shard is expected; the next run sweeps what it left, sweep_temporaries). The metadata records the
    sha256 of each tensor's bytes, which a resumed run checks (shard_problem)."""
    import shutil
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    tensors = {"hidden": hidden.detach().cpu().contiguous(), "scores": scores.detach().cpu().contiguous()}
    # the bytes safetensors writes: the tensor's own, little-endian as torch holds them on x86 and ARM
    meta = {**meta, "sha256": {k: _sha256(t.reshape(-1).view(torch.uint8).numpy()) for k, t in tensors.items()}}
    tmp_dir = partial_dir(path)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    tmp = tmp_dir / path.name
    try:
        # one metadata entry: safetensors writes several in no fixed order, and a resumed run must
        # produce byte-identical files
        save_file(tensors, str(tmp), metadata={"document": json.dumps(meta, sort_keys=True)})
        os.chmod(tmp, 0o644)  # safetensors writes 0600
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:  # a full disk, above all
        why = getattr(e, "strerror", None) or " ".join(str(e).split())
        raise UsageError(f"cannot write {path}: {why}; free space or pass another --out, then rerun the same "
                         f"command to resume") from None
    finally:  # also on Ctrl-C: no shard-sized leftovers
        shutil.rmtree(tmp_dir, ignore_errors=True)


def sweep_temporaries(out, docs, rank):
    """Remove what interrupted writes left in --out: the partial folders of this rank's documents (no other
    rank writes those), and on rank 0 the temporary files beside the shards and the gate (safetensors'
    .tmpXXXXXX of a killed gate write; docNNNNN.tmpPID of earlier versions). Says how much disk it freed."""
    import shutil
    folder = Path(out) / "features"
    found = [partial_dir(shard_path(out, i)) for i in docs]
    if rank == 0:
        found += [p for f in (folder, Path(out)) if f.is_dir() for p in f.iterdir()
                  if p.is_file() and (p.name.startswith(".tmp") or ".tmp" in p.suffix)]
    found = [p for p in found if p.exists()]
    if not found:
        return
    size = sum(f.stat().st_size for p in found for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    for p in found:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    print(f"removed {len(found)} temporaries of an interrupted run ({size / 2**20:.1f} MiB) from {folder}",
          file=sys.stderr)


def shard_problem(path, key):
    """None if `path` is the complete, intact shard of the document with doc_key `key`, else what is wrong
    with it. A shard cut short (a full disk, a copy that stopped) shows in its size; one damaged in place
    (bytes overwritten, a NaN written) in the sha256 of its tensors, recorded when it was written: every
    byte is read, once per resume."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            end = 8 + n + max(header[name]["data_offsets"][1] for name in ("hidden", "scores"))
            document = json.loads(header["__metadata__"]["document"])
            size = os.fstat(f.fileno()).st_size
            if size != end:
                return f"{size} bytes where its header says {end} (truncated)"
            if document.get("key") != key:
                return "it holds another document"
            recorded = document.get("sha256")
            if not isinstance(recorded, dict):
                return "it records no checksum of its data (written by an earlier version)"
            for name in ("hidden", "scores"):
                begin, stop = header[name]["data_offsets"]
                f.seek(8 + n + begin)
                if _sha256(None, f, stop - begin) != recorded.get(name):
                    return f"its {name} tensor differs from the sha256 recorded when it was written (damaged)"
    except Exception as e:  # anything unreadable is recomputed
        return f"unreadable ({type(e).__name__})"
    return None


def feature_dtype(choice, dtype, cfg):
    """The dtype hidden states are stored in: --feature-dtype, or for "auto" the model's, except fp32
    features above FP16_FEATURES_ABOVE bytes per token, stored as fp16 (SmolLM2-135M: 30 layers x 576
    values, 69 KB -> 35 KB; Gemma 3 270M's 3 x 640, 7.7 KB, stay fp32). The gates still train in the
    model's dtype."""
    if choice != "auto":
        return DTYPES[choice]
    big = dtype == torch.float32 and len(cfg.compressed_layers) * cfg.hidden_size * 4 > FP16_FEATURES_ABOVE
    return torch.float16 if big else dtype


def make_manifest(model_name, cfg, dtype, docs, teacher_chunk, teacher_softmax, chat, stored_dtype=None):
    """What a resumed run must share with the one that wrote the features: model, teacher settings,
    documents (with their splits) and, where it is not the model's dtype, the dtype the features are
    stored in (stored_dtype, see feature_dtype)."""
    manifest = dict(
        format=1, model=model_name, compressed_layers=list(cfg.compressed_layers),
        n_kv_heads=cfg.num_key_value_heads, group=cfg.group_size, hidden_size=cfg.hidden_size,
        dtype=str(dtype).replace("torch.", ""),
        teacher=dict(chunk=teacher_chunk, softmax_dtype=teacher_softmax, chat=chat),
        documents=[dict(name=n, tokens=len(ids), key=doc_key(n, ids), shard=shard_path("", i).as_posix(), split=split)
                   for i, (n, ids, split) in enumerate(docs)])
    if stored_dtype not in (None, dtype):  # absent = the model's dtype (also in manifests written before the option)
        manifest["feature_dtype"] = str(stored_dtype).replace("torch.", "")
    return manifest


def check_manifest(out, manifest):
    """A resume must continue the same run: same model, teacher settings and documents."""
    path = Path(out) / "manifest.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (ValueError, OSError) as e:  # written atomically by us: damaged by something else
            raise UsageError(f"{path} is unreadable ({type(e).__name__}); delete it (the shards are checked "
                             f"again on resume) or pass another --out") from None
        if not isinstance(old, dict) or old != manifest:
            old = old if isinstance(old, dict) else {}
            diff = [k for k in manifest if old.get(k) != manifest[k]]
            raise UsageError(f"--out {out} holds features of a different run ({', '.join(diff)} differ); "
                             f"pass another --out or delete {out}/features and {path}")


def assign_ranks(lengths, world):
    """Rank of each document: longest first, each to the least-loaded rank (so the ~100K-token
    concatenations spread over the GPUs). Deterministic: every rank computes the same plan."""
    load, rank_of = [0] * world, [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        rank_of[i], load[r] = r, load[r] + lengths[i]
    return rank_of


def extract_features(out, model_folder, dtype, device, docs, fmt, tokenizer, teacher_chunk, prefill_chunk,
                     teacher_softmax, stored_dtype=None, rank=0, world=1, quiet=False):
    """Score and record every document of this rank that has no complete shard yet in out/features, its
    hidden states stored in stored_dtype (None: the model's dtype). The model is loaded only if there is
    work left."""
    rank_of = assign_ranks([len(ids) for _, ids, _ in docs], world)
    mine = [i for i in range(len(docs)) if rank_of[i] == rank]
    sweep_temporaries(out, mine, rank)
    todo = []
    for i in mine:
        path = shard_path(out, i)
        if path.exists():
            problem = shard_problem(path, doc_key(*docs[i][:2]))
            if problem is None:
                continue  # finished by an earlier run
            print(f"{path}: {problem}; recomputing it", file=sys.stderr)
            path.unlink()
        todo.append(i)
    if not todo:
        return
    from teacher import KVzipTeacher
    model = load_model(model_folder, device, dtype)
    teacher = KVzipTeacher(model, tokenizer, fmt, chunk_size=teacher_chunk, prefill_chunk=prefill_chunk,
                           softmax_dtype=teacher_softmax)
    from tqdm import tqdm
    total = sum(len(docs[i][1]) for i in todo)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"features rank {rank}" if world > 1 else "features",
               position=rank, disable=quiet, dynamic_ncols=True)
    for i in todo:
        name, ids, _ = docs[i]
        with torch.no_grad():
            scores, hidden = teacher(ids, capture_hidden=True, on_chunk=bar.update)
        if stored_dtype is not None and hidden.dtype != stored_dtype:
            big = hidden.abs().max().item()
            hidden = hidden.to(stored_dtype)
            if not torch.isfinite(hidden).all():
                raise UsageError(f"{name}: hidden states reach {big:.3g}, beyond {stored_dtype}'s range; "
                                 f"pass --feature-dtype bfloat16 or float32")
        write_shard(shard_path(out, i), hidden, scores,
                    dict(name=name, tokens=len(ids), key=doc_key(name, ids)))
    bar.close()


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _mmap_tensor(path, name):
    """A tensor of a safetensors file, memory-mapped (not read): features of an 8B model over 1M
    tokens are ~300 GB, so training reads them a group of layers at a time (FeatureStore.load_layers)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        info = json.loads(f.read(n))[name]
    begin, end = info["data_offsets"]
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n + begin, shape=(end - begin,))
    return torch.from_numpy(raw).view(_ST_DTYPES[info["dtype"]]).view(info["shape"])


class FeatureStore:
    """All shards of a run, in manifest order, as one token axis: hidden (L, N, D) memory-mapped per
    shard, scores (L, H, N) float32 in memory (METHOD.md §5.1 concatenates along the token axis)."""

    def __init__(self, out, manifest):
        paths = [Path(out) / d["shard"] for d in manifest["documents"]]
        missing = [str(p) for p in paths if not p.exists()]
        assert not missing, f"missing feature shards: {missing[:3]}"
        self.hidden = [_mmap_tensor(p, "hidden") for p in paths]
        from safetensors.torch import load_file
        self.scores = torch.cat([load_file(str(p))["scores"].float() for p in paths], dim=-1)  # (L, H, N)
        lens = torch.tensor([h.shape[1] for h in self.hidden])
        self.starts = torch.cumsum(lens, 0) - lens
        # held-out whole documents; a manifest without splits (or --val-docs 0) has none
        self.is_val_doc = torch.repeat_interleave(
            torch.tensor([d.get("split") == "val" for d in manifest["documents"]]), lens)
        self.n_layers, self.n_tokens, self.hidden_size = self.hidden[0].shape[0], int(lens.sum()), self.hidden[0].shape[2]
        # the model's dtype, in which the gates train; the shards may hold the features narrower (fp16)
        self.dtype = DTYPES.get(manifest.get("dtype"), self.hidden[0].dtype)
        self.nbytes = sum(h.nbytes for h in self.hidden)  # the hidden states as stored

    def load_layers(self, layers):
        """Hidden states of the layers in slice `layers` for every token, read into memory: (L_g, N, D) in
        the stored dtype. The shards are layer-major, so each shard gives one contiguous run of bytes."""
        return torch.cat([h[layers] for h in self.hidden], dim=1)
