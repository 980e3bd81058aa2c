"""
Teach the gates: one command from raw text to a trained gate file (METHOD.md §4-5).

Three steps, each visible below in the order they run:
  1. data      pick documents (METHOD.md §5.1): 10K-30K-token documents plus ~100K-token
               concatenations of the same documents, ~1M tokens in all; 5% of the documents are
               held out whole for validation (--val-docs) and never enter a concatenation.
  2. features  for every document, prefill system prompt + context with a full cache, score every
               context KV pair with the KVzip teacher (teacher.py, METHOD.md §4) and record the
               attention-input hidden states of the compressed layers. One shard file per document,
               written atomically under --out/features, so an interrupted run resumes where it stopped
               (features.py).
  3. training  distil the scores into the gates (METHOD.md §5.2-5.4): BCE against the soft targets,
               SGD momentum 0.9, lr 0.2 with the authors' piecewise schedule, 5,000 steps of 1,000
               tokens (5 epochs of the recipe's 1M tokens), all layers batched through gate.Gates; then
               the gate's agreement with its teacher on the held-out documents (quality.agreement).
               --recipe adam-logmse (Adam on the MSE of log scores; the bundled SmolLM2 gate's) and one
               flag per field of the recipe choose other optimisers and losses (Recipe, METHOD.md §13.14).

Outputs in --out (default ./out/<model>): features/ + manifest.json, gate.safetensors (gate.save_gate,
with a training summary in its metadata), metrics.json (per-layer train/validation loss and accuracy
over steps, and the agreement), curves.png with --plot, and per-layer tables on stdout.

Cost of the default run (~1M tokens), Qwen3-8B on one 80 GB GPU (estimates; the paper reports 0.59
H100-hours for the whole phase, METHOD.md §5.5):
  features  two passes over every context token (prefill, then the repeat inputs: +~1% prompt tokens)
            ≈ 2·2·8e9·1M = 3e16 FLOPs, plus attention, quadratic in document length: 4·L·Hq·d_h·n²/2
            per pass = 3e15 for one 100K-token sample, ≈ 3.5e16 for the whole set. 6.5e16 FLOPs: a few
            minutes of H100 at 40% of peak; budget 10-20 min with our kernels.
            GPU memory: weights 16.4 GB + the full cache of a 100K-token sample 14.7 GB (allocated exactly;
            a layer being re-laid out briefly holds its old copy too, 0.4 GB) + one scoring matrix
            (Hq·2K·4K fp32 ≈ 1 GB) — well inside 80 GB. Hidden states
            go to host RAM as they are produced: L·D·2 bytes = 295 KB per token (~30 GB for a 100K sample,
            twice that while its shard is written).
  disk      the same 295 KB per token: ≈ 295 GB of features for 1M tokens (Gemma3 270M, fp32: 7.7 KB;
            SmolLM2-135M, 30 layers x 576: 69 KB in fp32, stored as fp16 by --feature-dtype auto: 35 KB).
  training  5000 steps × 1000 tokens; the gate math itself is tiny. The layers train in groups one after
            another (--layer-groups; the gates are those of one joint run), each group's features read once
            into host memory: by default as few groups as fit in half of it (Qwen3-8B's 295 GB: 5 groups
            of ~60 GB on a 128 GB host, each read in ~30 s from NVMe, then its steps run from memory).
            SmolLM2-135M at 877K tokens (measured on 2 CPU cores): 29 GB of fp16 features in 4-5 h (25-40
            tokens/s per process, resumed twice), 3 groups by default on a 24 GB machine; 5000 steps in 42 min with
            --threads 1 and 6 groups of 5 GB (two runs side by side).
  scaling   features ∝ tokens × parameters + Σ n² × layers × heads × head_dim; disk and training reads
            ∝ tokens × compressed layers × hidden size; more GPUs (torchrun) divide the feature step.

Small CPU example (the offline Gemma 3 270M on the Python docs, ~3 minutes on 2 cores; measured there:
features 75 tok/s for 2K-token documents, 54 at 8K, 41 at 16K; training 36 steps/s with --threads 1):
    python train_gate.py --data ~/.cache/fastkvzip/assets/pydoc --tokens 10000 --threads 1 \\
        --min-doc-tokens 2000 --max-doc-tokens 6000 --long-doc-tokens 0 --steps 300
Full size (the paper's recipe for Qwen3-8B; one GPU, or N GPUs for the feature step):
    python train_gate.py --model qwen3-8b
    torchrun --nproc_per_node 8 train_gate.py --model qwen3-8b
"""
import argparse
import datetime
import glob
import json
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

import cli
from cli import UsageError, pyplot, save_figure, write_json
from features import FeatureStore, check_manifest, extract_features, feature_dtype, make_manifest
from model import (ModelConfig, ModelError, OFFLINE_DEFAULT, check_dtype, compute_dtype, load_tokenizer, parse_device,
                   prompt_format, resolve_model, uses_chat)

FINEWEB_REPO = "HuggingFaceFW/fineweb-edu"       # METHOD.md §5.1
FINEWEB_FILE = "sample/10BT/000_00000.parquet"   # first shard of the sample-10BT config
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".parquet")
VAL_EVERY = 100    # every 100th token is validation (METHOD.md §5.2)
EVAL_EVERY = 50    # validation every 50 steps (METHOD.md §5.4)
ACC_THRESHOLD = 0.05  # accuracy: both sides of 0.05 agree (METHOD.md §5.3)
MOMENTUM = 0.9  # SGD's (METHOD.md §5.4)
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults
LOSSES = ("bce", "rank", "logmse")  # bce: the paper's; rank: BCE + RANK_WEIGHT · rank_per_layer; logmse: KVzap's
RANK_WEIGHT = 1.0  # the pairwise term's weight beside BCE: equal footing (both are ~0.7 for an untrained gate), not tuned
LOG_FLOOR = 1e-6   # logmse: scores below this count as this (a teacher score is a max attention weight, > 0)
MEMORY_SHARE = 0.5  # --layer-groups 0: each group's features in at most this share of the machine's memory


@dataclass(frozen=True)
class Recipe:
    """How the gates are trained. Every field defaults to the paper's recipe (METHOD.md §5.3-5.4);
    RECIPES names the ones train_gate.py offers (DEFAULT_RECIPE without --recipe), each field can be
    overridden by its own flag."""
    optimizer: str = "sgd"       # "sgd": momentum 0.9 (the paper's); "adam": Adam, AdamW with weight_decay
    lr: float = 0.2              # base learning rate
    schedule: str = "step"       # "step": the authors' piecewise schedule; "cosine": 1% warm-up, then cosine to 0
    weight_decay: float = 0.0    # decoupled (AdamW); SGD takes none, as the paper
    loss: str = "bce"            # one of LOSSES
    select: str = "last"         # "last": the gates after the last step; "spearman": per layer, the gates of
                                 # the validation step whose held-out rank correlation with the teacher was best


RECIPES = {
    "paper": Recipe(),
    # Adam on KVzap's log-space MSE. Held-out Spearman with the teacher against the paper recipe's, on the same
    # features (METHOD.md §13.14): SmolLM2-135M 0.78 (0.57 in its worst layer) vs 0.56 (0.13), Gemma 3 270M
    # 0.76 (0.64) vs 0.72 (0.59); downstream it wins on SmolLM2 and loses Gemma's pass keys, so it is not the default
    "adam-logmse": Recipe(optimizer="adam", lr=3e-3, loss="logmse"),
}
DEFAULT_RECIPE = "paper"
DEFAULT_LR = {"sgd": 0.2, "adam": 3e-3}  # an --optimizer other than the recipe's, without --lr, gets its own


# -------------------------------------------------------------------------------------------------
# 1. data (METHOD.md §5.1)

@dataclass
class Doc:
    name: str   # where it came from: a file path, "path:line", or "fineweb-edu row N"
    text: str
    n: int      # token count used for selection (FineWeb: its GPT-2 `token_count`, else our tokenizer)


def iter_fineweb(tokenizer):
    """Documents of the authors' FineWeb-Edu shard, in file order, with the dataset's token counts."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("--data fineweb-edu reads parquet: pip install pyarrow (or pass --data PATH)")
    from huggingface_hub import constants, hf_hub_download
    offline = (f"cannot download {FINEWEB_REPO}/{FINEWEB_FILE} ({{}}); offline? pass local text with "
               f"--data PATH, e.g. --data ~/.cache/fastkvzip/assets/pydoc")
    try:
        path = hf_hub_download(FINEWEB_REPO, FINEWEB_FILE, repo_type="dataset", local_files_only=True)
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
    for batch in pq.ParquetFile(path).iter_batches(columns=["text", "token_count"], batch_size=4096):
        for text, n in zip(batch.column("text").to_pylist(), batch.column("token_count").to_pylist()):
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
    if not files:
        raise UsageError(f"--data {spec}: no {'/'.join(TEXT_SUFFIXES)} files there")
    return files


def iter_files(spec, tokenizer):
    """Documents of local files: one per .txt/.md/.rst file, per .jsonl line, per .parquet row
    ("text" field). Token counts with the model's own tokenizer."""
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    for f in list_files(spec):
        if not f.endswith(".parquet"):  # a binary or non-UTF-8 file is refused, as generate.py's --context-file
            try:
                with open(f, "rb") as fh:
                    text = cli.decode_text(fh.read(), f"--data file {f}")
            except OSError as e:
                raise UsageError(f"cannot read --data file {f}: {e.strerror or e}") from None
        if f.endswith(".jsonl"):
            for i, line in enumerate(text.split("\n")):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UsageError(f"{f}:{i + 1}: not a JSON line ({e.msg})") from None
                    text = obj.get("text") if isinstance(obj, dict) else None
                    if not isinstance(text, str):
                        raise UsageError(f"{f}:{i + 1}: a .jsonl line needs a \"text\" string field")
                    yield Doc(f"{f}:{i + 1}", text.strip(), count(text.strip()))
        elif f.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise UsageError(f"{f}: reading .parquet needs pyarrow (pip install pyarrow)")
            try:
                table = pq.read_table(f)
            except Exception as e:  # pyarrow.ArrowException and OSError: a corrupt or foreign file
                raise UsageError(f"{f}: not a readable .parquet file ({str(e).splitlines()[0][:200]})") from None
            if "text" not in table.column_names:
                raise UsageError(f"{f}: a .parquet file needs a \"text\" column")
            for i, text in enumerate(table.column("text").to_pylist()):
                if not isinstance(text, str):
                    raise UsageError(f"{f}: row {i} has no \"text\" string (got {type(text).__name__})")
                yield Doc(f"{f}:{i}", text.strip(), count(text.strip()))
        else:
            text = text.strip()
            yield Doc(f, text, count(text))


def data_sha256(spec):
    """The hash of local --data as offline/fetch_assets.py records a part's in MANIFEST.txt (tree_sha256 over
    the files read, by path relative to the folder given, the parent of a single file, or the common folder
    of a glob's files), so a gate's metadata says exactly which text it was trained on. None for fineweb-edu
    (a pinned file of the hub: FINEWEB_REPO/FINEWEB_FILE)."""
    if spec == "fineweb-edu":
        return None
    from cli import tree_sha256
    files = [Path(f) for f in list_files(spec)]
    p = Path(spec).expanduser()
    root = p if p.is_dir() else p.parent if p.is_file() else Path(os.path.commonpath([f.parent for f in files]))
    return tree_sha256(files, root)


def note_bundled_corpus(model_name, data_hash):
    """One line when the model has a bundled gate: whether --data is the text that gate was trained on (its
    metadata's training.data_sha256), i.e. whether the gate's recorded command reproduces it exactly."""
    from gate import bundled_gate_path, gate_metadata
    path = bundled_gate_path(model_name)
    if not path.is_file():
        return
    trained_on = (gate_metadata(path).get("training") or {}).get("data_sha256")
    where = f"the bundled gate {path.parent.name}/{path.name}"
    if trained_on is None:
        print(f"note: {where} records no hash of its training text; cannot tell whether --data is it",
              file=sys.stderr)
    elif trained_on == data_hash:
        print(f"note: --data is the text {where} was trained on (sha256 {data_hash[:12]}): its recorded "
              f"command reproduces it", file=sys.stderr)
    else:
        print(f"note: --data (sha256 {str(data_hash)[:12]}) is not the text {where} was trained on "
              f"({trained_on[:12]}): this run will not reproduce that gate exactly", file=sys.stderr)


def select_documents(docs, tokens, min_tokens, max_tokens, long_tokens, val_fraction=0.0):
    """METHOD.md §5.1, with the authors' fixed counts (29 + 5) turned into token budgets:
    half of `tokens` in single documents of min <= n < max tokens, taken in order; the other half in
    concatenations that walk the same documents again from the start, joining them with "\\n\\n" while
    the running count is below `long_tokens`; the document that arrives once the count is reached
    closes the sample and is dropped (as the authors' loader does). long_tokens 0: single documents only.
    val_fraction > 0: an eligible document is held out whole for validation whenever the held-out share
    of the documents taken so far would otherwise fall below val_fraction (so the first one is); it never
    enters a concatenation. (The authors validate on every 100th token of the training documents.)
    Returns (training docs, validation docs, stats for the error message)."""
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
    if acc and acc_n >= long_tokens and long_n < long_budget:  # the data ended right after a full sample
        long.append(_join(acc, len(long)))
    return short + long, val, dict(seen=seen, longest=longest)


def _join(docs, i):
    return Doc(f"concatenation {i} ({len(docs)} docs from {docs[0].name})", "\n\n".join(d.text for d in docs),
               sum(d.n for d in docs))


def load_documents(data, tokens, min_doc_tokens, max_doc_tokens, long_doc_tokens, val_docs, tokenizer, max_context):
    """The selected documents as (name, context ids, split), each cut to max_context tokens; split is
    "train" or "val" (held-out whole documents, a fraction val_docs of the selected ones)."""
    long_tokens = min(long_doc_tokens, max_context)  # concatenations are cut to what the model holds
    docs = iter_fineweb(tokenizer) if data == "fineweb-edu" else iter_files(data, tokenizer)
    chosen, val, stats = select_documents(docs, tokens, min_doc_tokens, max_doc_tokens, long_tokens, val_docs)
    if not chosen and not val:
        raise UsageError(f"--data {data}: none of its {stats['seen']} documents has between "
                         f"{min_doc_tokens} and {max_doc_tokens} tokens (longest: {stats['longest']}); "
                         f"lower --min-doc-tokens or raise --max-doc-tokens")
    if not chosen:
        raise UsageError(f"--data {data}: too few documents to hold out {val_docs:.0%} for validation and train "
                         f"on the rest; add data, raise --tokens, or pass --val-docs 0 (every 100th token, as the authors)")
    if long_tokens < long_doc_tokens and any(d.name.startswith("concatenation") for d in chosen):
        print(f"note: the model holds {max_context} context tokens, so the long samples have about {long_tokens} "
              f"instead of --long-doc-tokens {long_doc_tokens}", file=sys.stderr)
    return [(d.name, tokenizer.encode(d.text, add_special_tokens=False).ids[:max_context], split)
            for split, ds in (("train", chosen), ("val", val)) for d in ds]


# -------------------------------------------------------------------------------------------------
# 2. features: the teacher's scores and the hidden states, one shard per document (features.py), over torchrun

def init_distributed():
    """torchrun sets WORLD_SIZE/RANK. The processes only meet at a barrier after the feature step, so
    the gloo backend serves CPU and GPU alike; the long timeout covers uneven document lengths."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=24))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), world


# -------------------------------------------------------------------------------------------------
# 3. training (METHOD.md §5.2-5.4)

def lr_multiplier(step, max_steps, schedule="step"):
    """The learning rate's multiplier at `step`. "cosine": linear warm-up over the first 1% of the steps,
    then half a cosine down to 0. "step", the authors' schedule (METHOD.md §5.4,
    Janghyun1230/FastKVzip:utils.py:lr_schedule): 0.01·step during the first 1% of steps (it jumps from 0.49
    to 1 at step 50 of 5000, and step 0 has lr 0), then 1, 0.5 from half-way, 0.25 from three quarters."""
    if schedule == "cosine":
        warm = max(1, int(0.01 * max_steps))
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, max_steps - warm)))
    if step < 0.01 * max_steps:
        return 0.01 * step
    if step < 0.5 * max_steps:
        return 1.0
    if step < 0.75 * max_steps:
        return 0.5
    return 0.25


def bce_per_layer(pred, target):
    """(L, H, B) -> (L,): BCE against the soft targets, mean over tokens, sum over heads (METHOD.md §5.3)."""
    return F.binary_cross_entropy(pred, target.to(pred.dtype), reduction="none").mean(-1).sum(-1)


def rank_per_layer(pred, target, pairs):
    """(L, H, B) -> (L,): a pairwise logistic (RankNet) loss, not in the paper (--loss rank). For each
    pair (i, j) of the batch's tokens (pairs: (2, P) indices), within each layer and head, with the gate's
    log-odds z = log(p / (1 − p)) and the teacher's targets t:
        |t_i − t_j| · softplus(−sign(t_i − t_j) · (z_i − z_j)),
    averaged with the weights |t_i − t_j| and summed over heads (as BCE). BCE fits each score on its own;
    the cache keeps the top of a ranking, and in a layer whose targets are flat (Gemma 3 270M's layer 11:
    half of them between 0.36 and 0.68) small BCE errors reorder many tokens. The term penalises each
    misordered pair by its log-odds gap; weighting by the target gap makes pairs the teacher barely tells
    apart count little (ties not at all), so near-ties do not turn into noise."""
    p = pred.float().clamp(1e-7, 1 - 1e-7)
    z = torch.log(p) - torch.log1p(-p)
    i, j = pairs
    dt = target[..., i].float() - target[..., j].float()
    w = dt.abs()
    per_pair = w * F.softplus(-torch.sign(dt) * (z[..., i] - z[..., j]))
    return (per_pair.sum(-1) / w.sum(-1).clamp_min(1e-12)).sum(-1)


def logmse_per_layer(pred, target):
    """(L, H, B) -> (L,): KVzap's regression (NVIDIA/kvpress:kvzap/train.py fits log scores by MSE), here
    on the gate's own output: (log p − log t)², both floored at LOG_FLOOR, mean over tokens, sum over heads.
    In log space a layer whose scores are all small (0.001-0.05) has errors as large as any other's, where
    BCE's gradient p − t is tiny there."""
    lp = torch.log(pred.float().clamp_min(LOG_FLOOR))
    lt = torch.log(target.float().clamp_min(LOG_FLOOR))
    return (lp - lt).square().mean(-1).sum(-1)


def acc_per_layer(pred, target):
    """(L, H, B) -> (L,): agreement of pred >= 0.05 and target >= 0.05 over heads and tokens."""
    return ((pred >= ACC_THRESHOLD) == (target >= ACC_THRESHOLD)).float().mean(dim=(1, 2))


def evaluate(gates, x, y, segments, device, block=8192):
    """Validation BCE, accuracy and Spearman with the teacher per layer over the whole held-out set (in
    blocks of tokens). Spearman is quality.spearman over each layer's H·n pairs of one segment (a held-out
    document), averaged over the segments: what quality.agreement reports, and what the cache's ranking
    depends on."""
    from quality import spearman
    loss = torch.zeros(x.shape[0], dtype=torch.float64)
    acc = torch.zeros(x.shape[0], dtype=torch.float64)
    preds = []
    with torch.no_grad():
        for s in range(0, x.shape[1], block):
            xb, yb = x[:, s:s + block].to(device), y[:, :, s:s + block].to(device)
            pred = gates(xb)
            w = xb.shape[1] / x.shape[1]
            loss += bce_per_layer(pred, yb).double().cpu() * w
            acc += acc_per_layer(pred, yb).double().cpu() * w
            preds.append(pred.float().cpu())
    pred = torch.cat(preds, dim=-1)
    rho = [sum(spearman(pred[l, :, a:b].flatten().double(), y[l, :, a:b].flatten().double())
               for a, b in segments) / len(segments) for l in range(x.shape[0])]
    return loss.tolist(), acc.tolist(), rho


def floor_bce(y):
    """BCE of the perfect predictor (pred = target): the soft targets' own entropy, the loss no gate can
    go below. (BCE − floor) is the KL divergence the training actually reduces."""
    return bce_per_layer(y.clamp(1e-7, 1 - 1e-7), y).tolist()


def constant_bce(y):
    """The best constant predictor's BCE per layer: each head predicts its own mean target (the
    minimiser of mean BCE over constants). A trained gate must beat this to have learned anything."""
    c = y.mean(-1, keepdim=True).clamp(1e-7, 1 - 1e-7).expand_as(y)
    return bce_per_layer(c, y).tolist()


@torch.no_grad()
def sgd_step(params, momentum, lr):
    """torch.optim.SGD(momentum=0.9) exactly (no dampening, no Nesterov, no weight decay): the buffer
    starts as the first gradient, then buf = 0.9·buf + grad; p -= lr·buf. Each parameter keeps its own
    dtype (METHOD.md §5.4). Written out because it is faster, measured side by side on the bundled
    gate's shape (3 layers, hidden 640, 1 thread, same parameters after 60 steps): constructing the
    first torch.optim.SGD imports torch._dynamo, 13-16 s, about as long as `import torch` itself, and
    its step took 1.1 ms against 0.55 ms here."""
    for j, p in enumerate(params):
        g = p.grad
        momentum[j] = g.clone() if momentum[j] is None else momentum[j].mul_(MOMENTUM).add_(g)
        p.add_(momentum[j], alpha=-lr)
        p.grad = None


@torch.no_grad()
def adam_step(params, state, lr, t, weight_decay=0.0):
    """torch.optim.AdamW exactly (torch.optim.Adam for weight_decay 0), at step t = 1, 2, ...: decoupled
    decay p *= 1 − lr·wd, moments m = β1·m + (1 − β1)·g and v = β2·v + (1 − β2)·g², then
    p -= lr · m̂ / (√v̂ + ε) with the bias-corrected m̂ = m / (1 − β1^t), v̂ = v / (1 − β2^t). Written out as
    sgd_step is, for the same reason. Adam is elementwise: every layer still trains on its own."""
    b1, b2 = ADAM_BETAS
    for j, p in enumerate(params):
        g = p.grad
        if state[j] is None:
            state[j] = (torch.zeros_like(p), torch.zeros_like(p))
        m, v = state[j]
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(ADAM_EPS)
        p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        p.grad = None


def val_segments(store, val_idx):
    """[start, end) ranges of the validation tokens (positions in val_idx) that belong to one document."""
    doc = torch.searchsorted(store.starts, val_idx, right=True) - 1
    cut = [0] + ((doc[1:] != doc[:-1]).nonzero().squeeze(1) + 1).tolist() + [len(val_idx)]
    return list(zip(cut[:-1], cut[1:]))


def layer_groups(n_layers, groups):
    """The layer axis cut into `groups` consecutive slices of near-equal size."""
    bounds = [round(g * n_layers / groups) for g in range(groups + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def auto_layer_groups(store, share=MEMORY_SHARE):
    """The fewest layer groups whose features each fit in `share` of this machine's memory (train caps it at
    one layer per group)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return math.ceil(store.nbytes / (share * memory))


def train(store, cfg, device, steps, batch_tokens, seed=0, log=print, recipe=Recipe(), groups=1):
    """METHOD.md §5.2-5.4 with the paper's Recipe(); the others are §13. Returns (gates, metrics dict).
    Loss "rank" adds RANK_WEIGHT · rank_per_layer over B random token pairs of each batch, drawn from a
    generator of their own: the batches are the same as with "bce". The batches never depend on the
    recipe.
    Layers share no parameters and every loss is a sum over layers, so the layers may train in `groups`
    runs one after another, each over the same batches with its layers' features read into memory: the
    gates are those of one joint run (tested), and features larger than memory are read once per group
    instead of at random on every step."""
    N = store.n_tokens
    is_val = store.is_val_doc
    if not is_val.any():  # the authors' split, every 100th token, 1-based: Janghyun1230/FastKVzip:load_data.py:split_fn
        is_val = (torch.arange(N) + 1) % VAL_EVERY == 0
    train_idx, val_idx = (~is_val).nonzero().squeeze(1), is_val.nonzero().squeeze(1)
    n_train, B = len(train_idx), batch_tokens
    if n_train < B:
        raise UsageError(f"only {n_train} training tokens for --batch-tokens {B}; add data (--tokens) or lower it")
    if len(val_idx) == 0:
        raise UsageError(f"only {N} tokens: need at least {VAL_EVERY} for one validation token; raise --tokens")
    torch.manual_seed(seed)
    from gate import Gates
    # projections and b in the model's dtype, norms and sink keys in fp32 (METHOD.md §1.2)
    make = lambda n: Gates(n, cfg.hidden_size, cfg.num_key_value_heads, cfg.group_size, dtype=store.dtype, device=device)
    gates = make(len(cfg.compressed_layers))
    batches = torch.get_rng_state()  # where the batch order starts, for every group
    segments = val_segments(store, val_idx)
    parts = []
    groups = max(1, min(groups, store.n_layers))
    t0 = time.perf_counter()
    for part in layer_groups(store.n_layers, groups):
        sub = make(part.stop - part.start)
        with torch.no_grad():
            for p, q in zip(sub.parameters(), gates.parameters()):
                p.copy_(q[part])
        torch.set_rng_state(batches)
        name = "" if groups == 1 else f"layers {part.start}-{part.stop - 1}: "
        t_read = time.perf_counter()
        hidden = store.load_layers(part)  # (L_g, N, D), stored dtype
        log(f"{name}features read ({hidden.nbytes / 2**30:.1f} GiB, {time.perf_counter() - t_read:.0f} s)")
        parts.append(train_layers(sub, hidden, store.scores[part], train_idx, val_idx, segments, device, steps, B,
                                  seed, lambda s: log(name + s), recipe, t0))
        del hidden
        with torch.no_grad():
            for p, q in zip(gates.parameters(), sub.parameters()):
                p[part] = q
    metrics = {k: v for k, v in parts[0].items() if not isinstance(v, list)}
    for k, v in parts[0].items():  # per layer, or per validation step and layer: the groups side by side
        if isinstance(v, list):
            metrics[k] = (v if k == "step" else
                          [sum(rows, []) for rows in zip(*(m[k] for m in parts))] if isinstance(v[0], list) else
                          sum((m[k] for m in parts), []))
    metrics.update(layers=list(cfg.compressed_layers), n_train=n_train, n_val=len(val_idx), recipe=asdict(recipe),
                   layer_groups=groups, seconds=time.perf_counter() - t0)
    metrics["steps_per_s"] = steps / max(metrics["seconds"], 1e-9)
    return gates, metrics


def train_layers(gates, hidden, scores, train_idx, val_idx, segments, device, steps, B, seed, log, recipe, t0):
    """train's loop for the layers of `gates`, their features hidden (L, N, D) and targets scores (L, H, N)
    in memory -> metrics (per validation step, per layer)."""
    dtype = gates.dtype  # the gates train in the model's dtype (METHOD.md §5.4), whatever the features are stored in
    x_val, y_val = hidden[:, val_idx].to(dtype), scores[:, :, val_idx]
    params = list(gates.parameters())  # each (L, ...): layer l's parameters are row l of every tensor
    state = [None] * len(params)  # SGD's momentum buffers, or Adam's moments
    n_train = len(train_idx)
    n_split = n_train // B  # epoch-style sampling: a fresh permutation every n_split steps
    L = hidden.shape[0]
    loss = recipe.loss
    metrics = dict(step=[], train_loss=[], train_acc=[], val_loss=[], val_acc=[], val_spearman=[],
                   const_val_loss=constant_bce(y_val), floor_val_loss=floor_bce(y_val))
    if loss == "rank":
        pair_rng = torch.Generator().manual_seed(seed)
        metrics.update(loss=loss, rank_weight=RANK_WEIGHT, train_rank_loss=[])
    if loss == "logmse":
        metrics.update(train_logmse=[])
    best_rho, best = [-2.0] * L, [p.detach().clone() for p in params]  # recipe.select "spearman"
    selected = [steps - 1] * L
    for i in range(steps):
        if i % n_split == 0:
            perm = torch.randperm(n_train)
        idx = train_idx[perm[(i % n_split) * B:(i % n_split + 1) * B]]
        x, y = hidden[:, idx].to(device, dtype), scores[:, :, idx].to(device)
        pred = gates(x)                         # (L, H, B): all layers in one batched call
        per_layer = bce_per_layer(pred, y)      # (L,)
        if loss == "logmse":
            logmse = logmse_per_layer(pred, y)
            total = logmse.sum()
        else:
            total = per_layer.sum()             # sum over layers: disjoint parameters, shared batch
        if loss == "rank":
            pairs = torch.stack([torch.randperm(B, generator=pair_rng) for _ in range(2)]).to(device)
            rank = rank_per_layer(pred, y, pairs)
            total = total + RANK_WEIGHT * rank.sum()
        total.backward()
        lr = recipe.lr * lr_multiplier(i, steps, recipe.schedule)
        if recipe.optimizer == "adam":
            adam_step(params, state, lr, i + 1, recipe.weight_decay)
        else:
            sgd_step(params, state, lr)
        if i % EVAL_EVERY == 0 or i == steps - 1:
            # as the authors: this batch's loss (before its update), validation after the update
            val_loss, val_acc, val_rho = evaluate(gates, x_val, y_val, segments, device)
            metrics["step"].append(i)
            metrics["train_loss"].append(per_layer.tolist())  # BCE, whatever the loss
            if loss == "rank":
                metrics["train_rank_loss"].append(rank.tolist())
            if loss == "logmse":
                metrics["train_logmse"].append(logmse.tolist())
            metrics["train_acc"].append(acc_per_layer(pred.detach(), y).tolist())
            metrics["val_loss"].append(val_loss)
            metrics["val_acc"].append(val_acc)
            metrics["val_spearman"].append(val_rho)
            if recipe.select == "spearman":
                with torch.no_grad():
                    for l in range(L):  # layers share no parameters: each keeps its own best step
                        if val_rho[l] > best_rho[l]:
                            best_rho[l], selected[l] = val_rho[l], i
                            for b, p in zip(best, params):
                                b[l] = p[l]
            log(f"step {i:5d}  lr {lr:.2g}  train BCE {sum(per_layer.tolist()) / L:.4f}  "
                f"val BCE {sum(val_loss) / L:.4f}  val acc {100 * sum(val_acc) / L:.1f}%  "
                f"val spearman {sum(val_rho) / L:.3f} (min {min(val_rho):.3f})  ({time.perf_counter() - t0:.0f} s)")
    if recipe.select == "spearman":
        with torch.no_grad():
            for b, p in zip(best, params):
                p.copy_(b)
        metrics["selected_step"] = selected
        metrics["selected_val_spearman"] = best_rho
    return metrics


def agreement_with_teacher(gates, store, manifest, docs, tokenizer, device):
    """quality.agreement of the trained gates with their teacher, pooled over the held-out documents (None
    without any: --val-docs 0)."""
    from quality import agreement, digit_tokens, pool_agreement
    per_doc = []
    for i, d in enumerate(manifest["documents"]):
        if d.get("split") == "val":
            start = int(store.starts[i])
            with torch.no_grad():
                pred = gates(store.hidden[i].to(device)).float().cpu()  # (L, H, n)
            teacher = store.scores[:, :, start:start + d["tokens"]]
            per_doc.append(agreement(pred, teacher, digit_tokens(tokenizer, docs[i][1])))
    return pool_agreement(per_doc) if per_doc else None


# -------------------------------------------------------------------------------------------------
# outputs

def summary_table(m):
    """Per layer: final validation BCE beside the best constant predictor's and the floor (the targets'
    own entropy: BCE − floor is what is left to learn), accuracies, the last train batch."""
    rows = [f"{'layer':>5}  {'val BCE':>8}  {'const BCE':>9}  {'floor':>6}  {'val acc':>7}  {'train BCE':>9}  "
            f"{'train acc':>9}"]
    for j, layer in enumerate(m["layers"]):
        rows.append(f"{layer:>5}  {m['val_loss'][-1][j]:8.4f}  {m['const_val_loss'][j]:9.4f}  {m['floor_val_loss'][j]:6.4f}  "
                    f"{100 * m['val_acc'][-1][j]:6.1f}%  {m['train_loss'][-1][j]:9.4f}  {100 * m['train_acc'][-1][j]:8.1f}%")
    a = m.get("agreement")
    if a:  # the held-out documents: how closely the gate ranks and keeps what its teacher does
        pct = lambda x: "   -" if x is None else f"{100 * x:3.0f}%"
        rows.append(f"\nagreement with the teacher on the {m['n_val_docs']} held-out documents (kept sets by the "
                    f"cache's rule; overlap = share of the teacher's kept pairs the gate keeps, chance in brackets)")
        rows.append(f"{'layer':>5}  {'spearman':>8}  {'overlap@0.5':>15}  {'overlap@0.3':>15}  "
                    f"{'kept@0.3 gate/teacher':>21}  {'digits kept@0.5 gate/teacher':>28}  {'@0.3':>10}")
        for j, layer in enumerate(m["layers"]):
            rows.append(f"{layer:>5}  {a['spearman'][j]:8.3f}  {pct(a['overlap@0.5'][j])} ({pct(a['chance@0.5'][j])})     "
                        f"{pct(a['overlap@0.3'][j])} ({pct(a['chance@0.3'][j])})     "
                        f"{pct(a['chance@0.3'][j])} / {pct(a.get('kept_teacher@0.3', [None] * len(m['layers']))[j])}"
                        f"{'':>11}{pct(a['digits_student@0.5'][j])} / {pct(a['digits_teacher@0.5'][j])}{'':>16}"
                        f"{pct(a['digits_student@0.3'][j])} / {pct(a['digits_teacher@0.3'][j])}")
    return "\n".join(rows)


def plot_curves(m, path):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "loss", "BCE (sum over heads)"), (axes[1], "acc", "accuracy at 0.05")):
        for j, layer in enumerate(m["layers"]):
            line, = ax.plot(m["step"], [v[j] for v in m[f"val_{key}"]], label=f"layer {layer}")
            ax.plot(m["step"], [v[j] for v in m[f"train_{key}"]], ":", color=line.get_color(), alpha=0.6)
        ax.set_title(f"{title}: validation (solid), train batch (dotted)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save_figure(fig, path)


# -------------------------------------------------------------------------------------------------
# main

def run(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = init_distributed()
    import torch.distributed as dist
    device = parse_device(args.device) if args.device else torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    model_name, out = names(args.model, args.out)
    check_out(out)
    dtype = compute_dtype(args.dtype, device)
    if rank > 0:
        dist.barrier()  # rank 0 downloads / converts the model first, alone
    folder = resolve_model(args.model)
    if rank == 0 and world > 1:
        dist.barrier()
    cfg = ModelConfig.from_json(folder)
    check_dtype(cfg, dtype)
    tokenizer = load_tokenizer(folder, cfg.vocab_size)
    prefill_chunk = args.prefill_chunk or (16000 if device.type == "cuda" else 4000)
    chat = uses_chat(args.model, args.chat)
    fmt = prompt_format(cfg, args.model, chat=chat)
    stored_dtype = feature_dtype(args.feature_dtype, dtype, cfg)
    system = tokenizer.encode(fmt.system, add_special_tokens=False).ids
    # the longest repeat input: prompt (< 64 tokens with the previous chunk's last 8) + one chunk
    max_context = cfg.max_position_embeddings - len(system) - args.teacher_chunk - 64
    if max_context < args.min_doc_tokens:
        raise UsageError(f"the model holds {cfg.max_position_embeddings} positions: with --teacher-chunk "
                         f"{args.teacher_chunk} a document can have at most {max_context} context tokens, fewer "
                         f"than --min-doc-tokens {args.min_doc_tokens}; lower them")
    docs = load_documents(args.data, args.tokens, args.min_doc_tokens, args.max_doc_tokens, args.long_doc_tokens,
                          args.val_docs, tokenizer, max_context)
    data_hash = data_sha256(args.data)
    if rank == 0:
        note_bundled_corpus(model_name, data_hash)
    manifest = make_manifest(model_name, cfg, dtype, docs, args.teacher_chunk, args.teacher_softmax, chat,
                             stored_dtype)
    check_manifest(out, manifest)
    make_out(out)  # only now that the input is accepted: a refused run leaves no empty folder
    if rank == 0:
        write_json(Path(out) / "manifest.json", manifest, indent=1)
        n_val = sum(split == "val" for _, _, split in docs)
        n_tok = sum(len(ids) for _, ids, _ in docs)
        print(f"{len(docs)} documents ({n_val} held out for validation), {n_tok} context tokens -> "
              f"{out}/features", file=sys.stderr)
    t0 = time.perf_counter()
    extract_features(out, folder, dtype, device, docs, fmt, tokenizer, args.teacher_chunk, prefill_chunk,
                     args.teacher_softmax, stored_dtype, rank, world, args.quiet)
    if world > 1:
        dist.barrier()  # every rank's shards are written before rank 0 trains
        dist.destroy_process_group()
        if rank != 0:
            return
    print(f"features ready ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.steps == 0:
        return
    store = FeatureStore(out, manifest)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr))
    recipe = make_recipe(args)
    groups = args.layer_groups or auto_layer_groups(store)  # train() caps it at the number of layers
    gates, metrics = train(store, cfg, device, args.steps, args.batch_tokens, args.seed, log, recipe, groups)
    metrics["n_val_docs"] = sum(d.get("split") == "val" for d in manifest["documents"])
    metrics["agreement"] = agreement_with_teacher(gates, store, manifest, docs, tokenizer, device)
    metrics["command"] = " ".join(sys.argv)
    from gate import authors_file_name, save_gate
    summary = dict(command=metrics["command"], data=args.data, data_sha256=data_hash, documents=len(docs),
                   tokens=store.n_tokens,
                   steps=args.steps, batch_tokens=args.batch_tokens, seed=args.seed, recipe_name=args.recipe,
                   **asdict(recipe), **(dict(momentum=MOMENTUM) if recipe.optimizer == "sgd" else {}),
                   **(dict(rank_weight=RANK_WEIGHT) if recipe.loss == "rank" else {}),
                   **({"selected_step": metrics["selected_step"]} if recipe.select == "spearman" else {}),
                   val_loss=metrics["val_loss"][-1], val_acc=metrics["val_acc"][-1],
                   const_val_loss=metrics["const_val_loss"], teacher=manifest["teacher"],
                   val_docs=metrics["n_val_docs"], agreement=metrics["agreement"])
    gate_path = Path(out) / "gate.safetensors"
    save_gate(str(gate_path), gates, dict(model=model_name, layers=metrics["layers"], training=summary))
    if args.export_pt:  # the authors' layout, for their code and kvpress (METHOD.md §2)
        save_gate(str(Path(out) / authors_file_name(gates)), gates, curves=(metrics["val_loss"], metrics["val_acc"]))
    write_json(Path(out) / "metrics.json", metrics, indent=1)
    print(summary_table(metrics))
    if args.plot:
        plot_curves(metrics, Path(out) / "curves.png")
    L = len(metrics["layers"])
    print(f"trained {args.steps} steps on {store.n_tokens} tokens in {metrics['seconds']:.0f} s "
          f"({metrics['steps_per_s']:.1f} steps/s); val BCE {sum(metrics['val_loss'][-1]) / L:.4f} "
          f"(constant {sum(metrics['const_val_loss']) / L:.4f}); gate -> {gate_path}")


def make_recipe(args):
    """RECIPES[--recipe] with the fields its own flags set."""
    recipe = RECIPES[args.recipe]
    given = {f: getattr(args, f) for f in ("optimizer", "lr", "schedule", "weight_decay", "loss", "select")}
    if args.optimizer not in (None, recipe.optimizer) and args.lr is None:
        given["lr"] = DEFAULT_LR[args.optimizer]
    return replace(recipe, **{f: v for f, v in given.items() if v is not None})


def check_out(out):
    """--out must be a folder we can write into, or create: checked before hours of work go into it,
    without creating it (make_out does, once the input is accepted)."""
    import errno
    import tempfile
    path = Path(out).absolute()
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())  # the folder, or where it will be
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise UsageError(f"--out {out} is not a writable folder ({e.strerror or e}); pass another --out") from None


def make_out(out):
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out} is not a writable folder ({e.strerror or e}); pass another --out") from None


def names(model, out):
    """The model's name in the manifest and the gate file, and the output folder (--out, default
    ./out/<name>)."""
    name = Path(model).name.lower() if model else OFFLINE_DEFAULT
    return name, out or str(Path("out") / name)


def kept(out, steps):
    """What a stopped run (Ctrl-C, SIGTERM, a full disk) leaves in `out`, as a clause for cli.main: the
    finished feature shards are kept; training (`steps` > 0) restarts."""
    try:
        docs = json.loads((Path(out) / "manifest.json").read_text())["documents"]
    except (OSError, ValueError, KeyError, TypeError):  # no manifest written yet
        return "no feature was computed yet; nothing is kept"
    done = sum((Path(out) / d["shard"]).is_file() for d in docs)
    if done < len(docs):
        return (f"{done} of {len(docs)} feature shards are kept in {out}/features; rerun the same command to "
                f"compute the other {len(docs) - done}{' and train' if steps else ''}")
    return (f"all {len(docs)} feature shards are kept in {out}/features; rerun the same command to train "
            f"(training itself restarts from step 0)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=OFFLINE_DEFAULT, help="local folder, HF repo id, or alias (qwen3-8b, ...); "
                   f"default: {OFFLINE_DEFAULT}, Gemma 3 270M converted offline from PyPI")
    p.add_argument("--data", default="fineweb-edu", help="'fineweb-edu' (the paper's data, downloaded with "
                   "huggingface-hub; needs pyarrow) or a folder / glob / file of .txt .md .rst .jsonl .parquet")
    p.add_argument("--tokens", type=int, default=1_000_000, help="total context tokens to select: half in "
                   "single documents, half in long concatenations (METHOD.md §5.1)")
    p.add_argument("--min-doc-tokens", type=int, default=10_000, help="shortest document used")
    p.add_argument("--max-doc-tokens", type=int, default=30_000, help="documents must be shorter than this")
    p.add_argument("--long-doc-tokens", type=int, default=100_000, help="length of the concatenated long "
                   "samples (capped to the model's context); 0 = single documents only")
    p.add_argument("--val-docs", type=float, default=0.05, help="fraction of the selected documents held out "
                   "whole for validation, never part of a training sample (default 0.05); 0 = the "
                   "authors' split, every 100th token of the training documents")
    p.add_argument("--out", help="folder for features, gate and metrics (default ./out/<model>)")
    p.add_argument("--steps", type=int, default=5000, help="optimiser steps (0 = compute features only)")
    p.add_argument("--batch-tokens", type=int, default=1000, help="tokens per step, shared by all layers")
    p.add_argument("--seed", type=int, default=0, help="seed of the gate init and the batch order")
    p.add_argument("--recipe", choices=sorted(RECIPES), default=DEFAULT_RECIPE, help="the training recipe whose "
                   "settings the next six flags default to: paper (default) = the paper's (SGD momentum 0.9, lr 0.2, "
                   "the authors' schedule, BCE, the last step; METHOD.md §5.3-5.4); adam-logmse = Adam lr 3e-3 on "
                   "the MSE of log scores, the same schedule (METHOD.md §13.14)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), help="sgd (momentum 0.9) or adam (AdamW with "
                   "--weight-decay)")
    p.add_argument("--lr", type=float, help="base learning rate")
    p.add_argument("--schedule", choices=("step", "cosine"), help="step: the authors' piecewise schedule; "
                   "cosine: 1%% warm-up, then cosine to 0")
    p.add_argument("--weight-decay", type=float, help="decoupled weight decay (adam only)")
    p.add_argument("--loss", choices=LOSSES, help="bce: the paper's (METHOD.md §5.3); rank: BCE plus a pairwise "
                   "ranking term within each layer and head (see rank_per_layer); logmse: MSE of log scores, "
                   "as KVzap (see logmse_per_layer)")
    p.add_argument("--select", choices=("last", "spearman"), help="last: the gates after the last step; "
                   "spearman: per layer, the gates of the validation step (every 50) with the best held-out "
                   "rank correlation with the teacher")
    p.add_argument("--teacher-chunk", type=int, default=2000, help="context tokens scored per repeat "
                   "query (METHOD.md §4.2)")
    p.add_argument("--prefill-chunk", type=int, help="tokens per prefill forward of the teacher (default 16000 "
                   "as the authors on GPU; 4000 on CPU, whose reference attention holds a chunk x context "
                   "matrix). The scores do not depend on it: the cache is full")
    p.add_argument("--teacher-softmax", choices=("float32", "model"), default="float32",
                   help="dtype of the teacher's logits and softmax: float32 (default: the targets do not "
                   "depend on the model dtype, at a negligible cost) or the model dtype as the authors (bf16)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap in the model's chat template (default: on, except for the base offline model)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available; the local rank's GPU "
                   "under torchrun)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="model dtype, in which the gates train too (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--feature-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="dtype the hidden-state features are stored in (default auto: the model's, but float16 "
                   "for float32 features of more than 16 KB per token, e.g. SmolLM2-135M's 69 KB)")
    p.add_argument("--layer-groups", type=int, default=0, help="train the layers in this many groups one after "
                   "another, each with its features read into memory (the gates are the same); 0: as few as fit in "
                   f"{MEMORY_SHARE:.0%} of this machine's memory")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice). On small or "
                   "shared CPUs 1 is often much faster: the gate's small ops pay for every thread hand-off")
    p.add_argument("--export-pt", action="store_true", help="also write the gate in the authors' layout, "
                   "--out/q{G}_dim16_sink16.pt, which their code and kvpress's FastKVzipPress load (METHOD.md §2)")
    p.add_argument("--plot", action="store_true", help="also write curves.png (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or step log")
    args = p.parse_args(argv)
    for flag in ("tokens", "min_doc_tokens", "max_doc_tokens", "batch_tokens", "teacher_chunk", "prefill_chunk",
                 "threads", "lr"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.weight_decay is not None and not 0 <= args.weight_decay < 1:
        p.error(f"--weight-decay must be in [0, 1), got {args.weight_decay}")
    if args.weight_decay and (args.optimizer or RECIPES[args.recipe].optimizer) == "sgd":
        p.error("--weight-decay applies to --optimizer adam (the paper's SGD takes none)")
    if args.steps < 0 or args.long_doc_tokens < 0 or args.layer_groups < 0:
        p.error("--steps, --long-doc-tokens and --layer-groups must be >= 0")
    if not -2**63 <= args.seed < 2**63:
        p.error(f"--seed {args.seed} does not fit in 64 bits")
    if not 0 <= args.val_docs <= 0.5:
        p.error(f"--val-docs must be in [0, 0.5], got {args.val_docs}")
    if args.min_doc_tokens >= args.max_doc_tokens:
        p.error("--min-doc-tokens must be below --max-doc-tokens")
    if 0 < args.long_doc_tokens <= args.min_doc_tokens:  # one document would already fill a "long" sample
        p.error(f"--long-doc-tokens {args.long_doc_tokens} is not above --min-doc-tokens {args.min_doc_tokens}: "
                f"every concatenation would be one document, repeating the single-document half; raise it, "
                f"or pass 0 for single documents only")
    return args


def main(argv=None):
    args = parse_args(argv)
    cli.main(run, args, ModelError, kept=lambda a: kept(names(a.model, a.out)[1], a.steps))


if __name__ == "__main__":
    main()
