"""
The training data of train_gate.py (METHOD.md §5.1), its steps 1 and 2:
  1. documents  selected by token budgets from FineWeb-Edu or local text, some held out whole for
                validation;
  2. features   for every document, the KVzip teacher's scores of its context KV pairs and the
                compressed layers' attention-input hidden states, one safetensors shard per document
                under --out/features, written atomically; a manifest that a resumed run must match;
                the documents split over torchrun ranks; and FeatureStore, all shards as one
                memory-mapped token axis for training.
"""
import glob
import hashlib
import json
import os
import shutil
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

import cli
from cli import UsageError, tree_sha256
from formats.checkpoint import load_checked
from formats.gate_file import bundled_gate_path, gate_metadata
from model import DTYPES
from prompts import encode_text
from teacher import KVzipTeacher

FINEWEB_REPO = "HuggingFaceFW/fineweb-edu"       # METHOD.md §5.1
FINEWEB_FILE = "sample/10BT/000_00000.parquet"   # first shard of the sample-10BT config
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".parquet")
FP16_FEATURES_ABOVE = 16 * 1024  # --feature-dtype auto: fp32 above 16 KB/token is stored as fp16


# -------------------------------------------------------------------------------------------------
# 1. documents (METHOD.md §5.1)

@dataclass
class Doc:
    name: str   # where it came from: a file path, "path:line", or "fineweb-edu row N"
    text: str
    n: int      # token count used for selection (FineWeb: its GPT-2 `token_count`, else ours)


def iter_fineweb(tokenizer):
    """Documents of the authors' FineWeb-Edu shard, in file order, with the dataset's token
    counts."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("--data fineweb-edu reads parquet: pip install pyarrow "
                         "(or pass --data PATH)")
    from huggingface_hub import constants, hf_hub_download
    offline = (f"cannot download {FINEWEB_REPO}/{FINEWEB_FILE} ({{}}); offline? pass local text "
               f"with --data PATH, e.g. --data ~/.cache/fastkvzip/assets/pydoc")
    try:
        path = hf_hub_download(FINEWEB_REPO, FINEWEB_FILE, repo_type="dataset",
                               local_files_only=True)
    except Exception:  # not cached yet: download, unless the hub is plainly unreachable
        host = constants.ENDPOINT.split("://")[-1].split("/")[0]
        try:  # fail in a second instead of huggingface-hub's ~30 s of retries and warnings
            socket.create_connection((host.split(":")[0], 443), timeout=5).close()
        except OSError as e:
            raise UsageError(offline.format(f"{host} unreachable: {e.strerror or e}"))
        try:
            path = hf_hub_download(FINEWEB_REPO, FINEWEB_FILE, repo_type="dataset")
        except Exception as e:  # gated, proxy, disk full: all end the same way
            raise UsageError(offline.format(type(e).__name__))
    row = 0
    batches = pq.ParquetFile(path).iter_batches(columns=["text", "token_count"], batch_size=4096)
    for batch in batches:
        texts, counts = batch.column("text").to_pylist(), batch.column("token_count").to_pylist()
        for text, n in zip(texts, counts):
            yield Doc(f"fineweb-edu row {row}", text.strip(), int(n))
            row += 1


def list_files(spec):
    """Files named by a folder (searched recursively), a glob, or a single file; sorted."""
    if any(c in spec for c in "*?["):
        files = glob.glob(os.path.expanduser(spec), recursive=True)
    else:
        p = Path(spec).expanduser()
        if not p.exists():
            raise UsageError(f"--data {spec}: no such file or folder")
        files = [str(p)] if p.is_file() else [str(f) for f in p.rglob("*") if f.is_file()]
    files = sorted(f for f in files if f.lower().endswith(TEXT_SUFFIXES))
    # a file reached by several paths is read once: glob's '**' follows links to folders, and a link
    # back up (a loop) gave one file some 40 times
    real = [os.path.realpath(f) for f in files]
    files = [f for i, f in enumerate(files) if real[i] not in real[:i]]
    if not files:
        raise UsageError(f"--data {spec}: no {'/'.join(TEXT_SUFFIXES)} files there")
    return files


def iter_files(spec, tokenizer):
    """Documents of local files: one per .txt/.md/.rst file, per .jsonl line, per .parquet row
    ("text" field). Token counts with the model's own tokenizer."""
    count = lambda text: len(encode_text(tokenizer, text))
    for f in list_files(spec):
        kind = Path(f).suffix.lower()  # D.JSONL is JSON lines, X.PARQUET parquet
        if kind != ".parquet":  # binary or non-UTF-8: refused (generate.py --context-file)
            try:
                with open(f, "rb") as fh:
                    text = cli.decode_text(fh.read(), f"--data file {f}")
            except OSError as e:
                raise UsageError(f"cannot read --data file {f}: {e.strerror or e}") from None
        if kind == ".jsonl":
            for i, line in enumerate(text.split("\n")):
                if line.strip():
                    obj = cli.json_line(line, f"{f}:{i + 1}")
                    text = obj.get("text") if isinstance(obj, dict) else None
                    if not isinstance(text, str):
                        raise UsageError(f"{f}:{i + 1}: a .jsonl line needs a \"text\" string "
                                         f"field")
                    yield Doc(f"{f}:{i + 1}", text.strip(), count(text.strip()))
        elif kind == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise UsageError(f"{f}: reading .parquet needs pyarrow (pip install pyarrow)")
            try:
                table = pq.read_table(f)
            except Exception as e:  # pyarrow.ArrowException and OSError: a corrupt or foreign file
                raise UsageError(f"{f}: not a readable .parquet file "
                                 f"({str(e).splitlines()[0][:200]})") from None
            if "text" not in table.column_names:
                raise UsageError(f"{f}: a .parquet file needs a \"text\" column")
            for i, text in enumerate(table.column("text").to_pylist()):
                if not isinstance(text, str):
                    raise UsageError(f"{f}: row {i} has no \"text\" string "
                                     f"(got {type(text).__name__})")
                yield Doc(f"{f}:{i}", text.strip(), count(text.strip()))
        else:
            text = text.strip()
            yield Doc(f, text, count(text))


def data_sha256(spec):
    """The hash of local --data as offline/fetch_assets.py records a part's in MANIFEST.txt
    (cli.tree_sha256 over the files read, by path relative to the folder given, the parent of a
    single file, or the common folder of a glob's files), so a gate's metadata says exactly which
    text it was trained on. None for fineweb-edu (a pinned file of the hub:
    FINEWEB_REPO/FINEWEB_FILE)."""
    if spec == "fineweb-edu":
        return None
    files = [Path(f) for f in list_files(spec)]
    p = Path(spec).expanduser()
    root = (p if p.is_dir() else p.parent if p.is_file() else
            Path(os.path.commonpath([f.parent for f in files])))
    return tree_sha256(files, root)


def note_bundled_corpus(model_name, data_hash):
    """One line when the model has a bundled gate: whether --data is the text that gate was trained
    on (its metadata's training.data_sha256), i.e. whether the gate's recorded command reproduces it
    exactly."""
    path = bundled_gate_path(model_name)
    if not path.is_file():
        return
    trained_on = (gate_metadata(path).get("training") or {}).get("data_sha256")
    where = f"the bundled gate {path.parent.name}/{path.name}"
    if trained_on is None:
        print(f"note: {where} records no hash of its training text; cannot tell whether --data "
              f"is it", file=sys.stderr)
    elif trained_on == data_hash:
        print(f"note: --data is the text {where} was trained on (sha256 {data_hash[:12]}): its "
              f"recorded command reproduces it", file=sys.stderr)
    else:
        print(f"note: --data (sha256 {str(data_hash)[:12]}) is not the text {where} was trained on "
              f"({trained_on[:12]}): this run will not reproduce that gate exactly",
              file=sys.stderr)


def select_documents(docs, tokens, min_tokens, max_tokens, long_tokens, val_fraction=0.0):
    """METHOD.md §5.1, with the authors' fixed counts (29 + 5) turned into token budgets:
    half of `tokens` in single documents of min <= n < max tokens, taken in order; the other half
    in concatenations that walk the same documents again from the start, joining them with "\\n\\n"
    while the running count is below `long_tokens`; the document that arrives once the count is
    reached closes the sample and is dropped (as the authors' loader does). long_tokens 0: single
    documents only. val_fraction > 0: an eligible document is held out whole for validation whenever
    the held-out share of the documents taken so far would otherwise fall below val_fraction (so the
    first one is); it never enters a concatenation. (The authors validate on every 100th token of
    the training documents.) Returns (training docs, validation docs, stats for the error
    message)."""
    short_budget = tokens // 2 if long_tokens > 0 else tokens
    long_budget = tokens - short_budget
    short, long, acc, val = [], [], [], []
    short_n = long_n = acc_n = seen = longest = taken = 0
    for d in docs:
        seen, longest = seen + 1, max(longest, d.n)
        if not (min_tokens <= d.n < max_tokens):
            continue
        taken += 1
        if len(val) < val_fraction * taken:
            val.append(d)
            continue
        if short_n < short_budget:
            short.append(d)
            short_n += d.n
        if long_n < long_budget:
            if acc_n < long_tokens:
                acc.append(d)
                acc_n += d.n
            else:  # this document closes the sample and is dropped
                long.append(_join(acc, len(long)))
                long_n += acc_n
                acc, acc_n = [], 0
        if short_n >= short_budget and long_n >= long_budget:
            break
    if acc and acc_n >= long_tokens and long_n < long_budget:  # the data ended after a full sample
        long.append(_join(acc, len(long)))
    return short + long, val, dict(seen=seen, longest=longest)


def _join(docs, i):
    return Doc(f"concatenation {i} ({len(docs)} docs from {docs[0].name})",
               "\n\n".join(d.text for d in docs), sum(d.n for d in docs))


def load_documents(data, tokens, min_doc_tokens, max_doc_tokens, long_doc_tokens, val_docs,
                   tokenizer, max_context):
    """The selected documents as (name, context ids, split), each cut to max_context tokens; split
    is "train" or "val" (held-out whole documents, a fraction val_docs of the selected ones)."""
    long_tokens = min(long_doc_tokens, max_context)  # concatenations: cut to what the model holds
    docs = iter_fineweb(tokenizer) if data == "fineweb-edu" else iter_files(data, tokenizer)
    chosen, val, stats = select_documents(docs, tokens, min_doc_tokens, max_doc_tokens, long_tokens,
                                          val_docs)
    if not chosen and not val:
        raise UsageError(f"--data {data}: none of its {stats['seen']} documents has between "
                         f"{min_doc_tokens} and {max_doc_tokens} tokens (longest: "
                         f"{stats['longest']}); lower --min-doc-tokens or raise --max-doc-tokens")
    if not chosen:
        raise UsageError(f"--data {data}: too few documents to hold out {val_docs:.0%} for "
                         f"validation and train on the rest; add data, raise --tokens, or pass "
                         f"--val-docs 0 (every 100th token, as the authors)")
    if long_tokens < long_doc_tokens and any(d.name.startswith("concatenation") for d in chosen):
        print(f"note: the model holds {max_context} context tokens, so the long samples have about "
              f"{long_tokens} instead of --long-doc-tokens {long_doc_tokens}", file=sys.stderr)
    # a document is data: the text of a control token in it makes no control id (model.encode_text)
    return [(d.name, encode_text(tokenizer, d.text)[:max_context], split)
            for split, ds in (("train", chosen), ("val", val)) for d in ds]


# -------------------------------------------------------------------------------------------------
# 2. features: the teacher's scores and the hidden states, one shard per document

def doc_key(name, ids):
    """Identity of a document's context: its token ids (and name), so a resume never mixes data."""
    h = hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes())
    h.update(name.encode())
    return h.hexdigest()[:16]


def shard_path(out, i):
    return Path(out) / "features" / f"doc{i:05d}.safetensors"


def partial_dir(path):
    """Where the shard `path` is written before it is renamed into place: a folder of its own,
    because safetensors itself stages the file under a random hidden name beside its target
    (.tmpXXXXXX, as large as the shard) that only a sweep of the folder can find after a SIGKILL."""
    return path.with_name(f".{path.stem}.partial")


def _sha256(data, f=None, length=0):
    """sha256 hex digest of `data` (bytes-like), or of `length` bytes read from file `f` at its
    position, a block at a time (one shard of an 8B model's long document holds gigabytes)."""
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


def write_shard(path, hidden, scores, meta, ids=None):
    """Atomically: write into partial_dir(path), then rename (a killed run never leaves half a shard
    where a shard is expected; the next run sweeps what it left, sweep_temporaries). The metadata
    records the sha256 of each tensor's bytes, which a resumed run checks (shard_problem). ids: the
    document's token ids (None: not stored), so that a folder of features can be evaluated on its
    own (train_gate.py --eval-features: which tokens are digits or identifiers)."""
    tensors = {"hidden": hidden.detach().cpu().contiguous(),
               "scores": scores.detach().cpu().contiguous(),
               **({} if ids is None else {"ids": torch.tensor(list(ids), dtype=torch.int64)})}
    # the bytes safetensors writes: the tensor's own, little-endian as torch holds them on x86, ARM
    meta = {**meta, "sha256": {k: _sha256(t.reshape(-1).view(torch.uint8).numpy())
                               for k, t in tensors.items()}}
    tmp_dir = partial_dir(path)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    tmp = tmp_dir / path.name
    try:
        # one metadata entry: safetensors writes several in no fixed order, and a resumed run must
        # produce byte-identical files
        safetensors.torch.save_file(tensors, str(tmp),
                                    metadata={"document": json.dumps(meta, sort_keys=True)})
        os.chmod(tmp, 0o644)  # safetensors writes 0600
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:  # a full disk, above all
        why = getattr(e, "strerror", None) or " ".join(str(e).split())
        raise UsageError(f"cannot write {path}: {why}; free space or pass another --out, then "
                         f"rerun the same command to resume") from None
    finally:  # also on Ctrl-C: no shard-sized leftovers
        shutil.rmtree(tmp_dir, ignore_errors=True)


def sweep_temporaries(out, docs, rank):
    """Remove what interrupted writes left in --out: the partial folders of this rank's documents
    (no other rank writes those), and on rank 0 the temporary files beside the gate and the json
    outputs (safetensors' .tmpXXXXXX of a killed gate write, cli.atomic_path's .NAME.tmpPID). Says
    how much disk it freed."""
    found = [partial_dir(shard_path(out, i)) for i in docs]
    if rank == 0 and Path(out).is_dir():  # safetensors' name no writer; atomic_path's, its PID
        found += [p for p in Path(out).iterdir() if p.is_file() and p.name.startswith(".tmp")]
        found += cli.dead_temporaries(out)
    found = [p for p in found if p.exists()]
    if not found:
        return
    size = sum(f.stat().st_size for p in found for f in ([p] if p.is_file() else p.rglob("*"))
               if f.is_file())
    for p in found:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    print(f"removed {len(found)} temporaries of an interrupted run ({size / 2**20:.1f} MiB) from "
          f"{out}", file=sys.stderr)


def shard_problem(path, key):
    """None if `path` is the complete, intact shard of the document with doc_key `key`, else what is
    wrong with it. A shard cut short (a full disk, a copy that stopped) shows in its size; one
    damaged in place (bytes overwritten, a NaN written) in the sha256 of its tensors, recorded when
    it was written: every byte is read, once per resume."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            tensors = [v for k, v in header.items() if k != "__metadata__"]
            end = 8 + n + max(t["data_offsets"][1] for t in tensors)
            document = json.loads(header["__metadata__"]["document"])
            size = os.fstat(f.fileno()).st_size
            if size != end:
                return f"{size} bytes where its header says {end} (truncated)"
            if document.get("key") != key:
                return "it holds another document"
            recorded = document.get("sha256")
            if not isinstance(recorded, dict):
                return "it records no checksum of its data (written by an earlier version)"
            for name in ("hidden", "scores", *(["ids"] if "ids" in header else [])):
                begin, stop = header[name]["data_offsets"]
                f.seek(8 + n + begin)
                if _sha256(None, f, stop - begin) != recorded.get(name):
                    return (f"its {name} tensor differs from the sha256 recorded when it was "
                            f"written (damaged)")
    except Exception as e:  # anything unreadable is recomputed
        return f"unreadable ({type(e).__name__})"
    return None


def feature_dtype(choice, dtype, cfg):
    """The dtype hidden states are stored in: --feature-dtype, or for "auto" the model's, except
    fp32 features above FP16_FEATURES_ABOVE bytes per token, stored as fp16 (METHOD.md §5.5,
    §13.12). The gates still train in the model's dtype."""
    if choice != "auto":
        return DTYPES[choice]
    per_token = len(cfg.compressed_layers) * cfg.hidden_size * 4
    big = dtype == torch.float32 and per_token > FP16_FEATURES_ABOVE
    return torch.float16 if big else dtype


def make_manifest(model_name, cfg, dtype, docs, teacher_chunk, teacher_softmax, chat, stored_dtype):
    """What a resumed run must share with the one that wrote the features: model, teacher settings,
    documents (with their splits), the model's dtype and the dtype the features are stored in
    (stored_dtype, see feature_dtype)."""
    name = lambda dt: str(dt).replace("torch.", "")
    return dict(
        format=1, model=model_name, compressed_layers=list(cfg.compressed_layers),
        n_kv_heads=cfg.num_key_value_heads, group=cfg.group_size, hidden_size=cfg.hidden_size,
        dtype=name(dtype),
        teacher=dict(chunk=teacher_chunk, softmax_dtype=teacher_softmax, chat=chat),
        documents=[dict(name=n, tokens=len(ids), key=doc_key(n, ids),
                        shard=shard_path("", i).as_posix(), split=split)
                   for i, (n, ids, split) in enumerate(docs)],
        feature_dtype=name(stored_dtype))


def check_manifest(out, manifest):
    """A resume must continue the same run: same model, teacher settings and documents."""
    path = Path(out) / "manifest.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (ValueError, OSError) as e:  # written atomically by us: damaged by something else
            raise UsageError(f"{path} is unreadable ({type(e).__name__}); delete it (the shards "
                             f"are checked again on resume) or pass another --out") from None
        if not isinstance(old, dict) or old != manifest:
            old = old if isinstance(old, dict) else {}
            diff = [k for k in manifest if old.get(k) != manifest[k]]
            raise UsageError(f"--out {out} holds features of a different run ({', '.join(diff)} "
                             f"differ); pass another --out or delete {out}/features and {path}")


def read_mix(folder, manifest, out):
    """train_gate.py --mix-features: the manifest of the features in `folder`, another corpus's
    (made by train_gate.py --steps 0 --data TEXT --out FOLDER), checked: not --out itself, with the
    settings of this run's `manifest` (every field but the documents: model, layers, dtypes,
    teacher), at least one training document, and every shard there and intact."""
    make = (f"make it with train_gate.py --steps 0 --data TEXT --out {folder} and this run's "
            f"--model, --dtype, --feature-dtype, --chat and teacher flags")
    if Path(folder).resolve() == Path(out).resolve():
        raise UsageError(f"--mix-features {folder} is --out itself; pass the features of another "
                         f"corpus")
    path = Path(folder) / "manifest.json"
    try:
        mix = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as e:
        why = "no manifest.json there" if isinstance(e, FileNotFoundError) else (
            f"{path} is unreadable ({type(e).__name__})")
        raise UsageError(f"--mix-features {folder}: {why}; {make}") from None
    if not isinstance(mix, dict) or not isinstance(mix.get("documents"), list):
        raise UsageError(f"--mix-features {folder}: {path} is not a train_gate.py manifest; {make}")
    diff = [k for k in dict.fromkeys([*manifest, *mix]) if k != "documents"
            and mix.get(k) != manifest.get(k)]
    if diff:
        raise UsageError(f"--mix-features {folder} holds features of other settings than this "
                         f"run's ({', '.join(diff)} differ); {make}")
    if not any(d["split"] == "train" for d in mix["documents"]):
        raise UsageError(f"--mix-features {folder} holds no training document (all "
                         f"{len(mix['documents'])} are held out); {make} and a lower --val-docs")
    for d in mix["documents"]:
        shard = Path(folder) / d["shard"]
        problem = shard_problem(shard, d["key"]) if shard.exists() else "missing"
        if problem is not None:
            raise UsageError(f"--mix-features {folder}: {shard}: {problem}; rerun the "
                             f"train_gate.py --steps 0 command that made it to compute it")
    return mix


def mix_documents(folder, mix, split):
    """The documents of split `split` of the --mix-features folder's manifest `mix`, their shards
    by absolute path: FeatureStore joins a shard's path to its folder, and an absolute one stands
    alone, so they sit in one store with this run's."""
    return [dict(d, shard=str((Path(folder) / d["shard"]).absolute()))
            for d in mix["documents"] if d["split"] == split]


def read_back(doc, tokenizer):
    """The context ids of a document of a manifest, read again from its file and checked against
    its key (doc_key); None when that cannot be done: a .jsonl line or .parquet row, a file moved or
    changed since its features were computed."""
    path = Path(doc["name"])
    if path.suffix.lower() not in (".txt", ".md", ".rst") or not path.is_file():
        return None
    try:
        text = cli.decode_text(path.read_bytes(), str(path)).strip()
    except (OSError, UsageError):
        return None
    ids = encode_text(tokenizer, text)[:doc["tokens"]]
    return ids if doc_key(doc["name"], ids) == doc["key"] else None


def assign_ranks(lengths, world):
    """Rank of each document: longest first, each to the least-loaded rank (so the ~100K-token
    concatenations spread over the GPUs). Deterministic: every rank computes the same plan."""
    load, rank_of = [0] * world, [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        rank_of[i], load[r] = r, load[r] + lengths[i]
    return rank_of


def extract_features(out, model_folder, dtype, device, docs, fmt, tokenizer, teacher_chunk,
                     prefill_chunk, teacher_softmax, stored_dtype, rank=0, world=1, quiet=False):
    """Score and record every document of this rank that has no complete shard yet in out/features,
    its hidden states stored in stored_dtype. The model is loaded only if there is work left."""
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
    model = load_checked(model_folder, device, dtype)
    teacher = KVzipTeacher(model, tokenizer, fmt, chunk_size=teacher_chunk,
                           prefill_chunk=prefill_chunk, softmax_dtype=teacher_softmax)
    from tqdm import tqdm
    total = sum(len(docs[i][1]) for i in todo)
    bar = tqdm(total=total, unit="tok", unit_scale=True, position=rank, disable=quiet,
               desc=f"features rank {rank}" if world > 1 else "features", dynamic_ncols=True)
    for i in todo:
        name, ids, _ = docs[i]
        with torch.no_grad():
            scores, hidden = teacher(ids, capture_hidden=True, on_chunk=bar.update)
        if hidden.dtype != stored_dtype:
            big = hidden.abs().max().item()
            hidden = hidden.to(stored_dtype)
            if not torch.isfinite(hidden).all():
                raise UsageError(f"{name}: hidden states reach {big:.3g}, beyond {stored_dtype}'s "
                                 f"range; pass --feature-dtype bfloat16 or float32")
        write_shard(shard_path(out, i), hidden, scores,
                    dict(name=name, tokens=len(ids), key=doc_key(name, ids)), ids)
    bar.close()


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _mmap_tensor(path, name):
    """A tensor of a safetensors file, memory-mapped (not read): features of an 8B model over 1M
    tokens are ~300 GB, so training reads them a group of layers at a time
    (FeatureStore.load_layers)."""
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
        self.paths = paths
        self.hidden = [_mmap_tensor(p, "hidden") for p in paths]
        # (L, H, N)
        self.scores = torch.cat(
            [safetensors.torch.load_file(str(p))["scores"].float() for p in paths], dim=-1)
        lens = torch.tensor([h.shape[1] for h in self.hidden])
        self.lengths = lens  # (documents,) each document's token count, in manifest order
        self.starts = torch.cumsum(lens, 0) - lens
        # held-out whole documents (none with --val-docs 0)
        self.is_val_doc = torch.repeat_interleave(
            torch.tensor([d["split"] == "val" for d in manifest["documents"]]), lens)
        self.n_layers, _, self.hidden_size = self.hidden[0].shape
        self.n_tokens = int(lens.sum())
        # the model's dtype, in which the gates train; the shards may hold the features narrower
        self.dtype = DTYPES[manifest["dtype"]]
        # context tokens per teacher scoring chunk (train_gate.py --final-chunk); every manifest
        # records it (format 1)
        self.teacher_chunk = (manifest.get("teacher") or {}).get("chunk")
        self.nbytes = sum(h.nbytes for h in self.hidden)  # the hidden states as stored

    def ids(self, i):
        """Document i's token ids (a list), or None from a shard written without them."""
        with safe_open(str(self.paths[i]), "pt") as f:
            return f.get_tensor("ids").tolist() if "ids" in f.keys() else None

    def load_layers(self, layers):
        """Hidden states of the layers in slice `layers` for every token, read into memory:
        (L_g, N, D) in the stored dtype. The shards are layer-major, so each shard gives one
        contiguous run of bytes."""
        return torch.cat([h[layers] for h in self.hidden], dim=1)
