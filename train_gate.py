"""
Teach the gates (METHOD.md §4-5): from raw text to a trained gate, in three steps, in the order
main() (at the end) runs them:
  1. data      pick documents (METHOD.md §5.1, commands/features.py): 10K-30K-token documents plus
               ~100K-token concatenations of the same documents, ~1M tokens in all, 5% of the
               documents held out whole for validation; --mix-features adds the training
               documents of another corpus's features (numeric text: offline/numeric_text.py).
  2. features  prefill each document with a full cache, score every context KV pair with the
               KVzip teacher (teacher.py, METHOD.md §4) and record the attention-input hidden
               states of the compressed layers (commands/features.py; resumable, over torchrun).
  3. training  distil the scores into the gates (METHOD.md §5.2-5.4): BCE against the soft
               targets, SGD with momentum 0.9, lr 0.2 with the authors' piecewise schedule, all
               layers batched through gate.Gates (train, train_layers); then the gate's agreement
               with its teacher on the held-out documents (--mix-features' apart) and on every
               document of any --eval-features folder (teacher.agreement,
               agreement_with_teacher). Other recipes
               (Recipe, METHOD.md §13.13-13.14) plug their parts in from section 4, and options
               aimed at the cache's cut (METHOD.md §13.15) from section 5.
The flags and their checks, the output folder and what is written and printed are the command
line's (commands/train_gate.py; python train_gate.py --help).

    python train_gate.py --data ~/.cache/fastkvzip/assets/pydoc --tokens 10000 --threads 1 \\
        --min-doc-tokens 2000 --max-doc-tokens 6000 --long-doc-tokens 0 --steps 300   # CPU
    python train_gate.py --model qwen3-8b   # the paper's recipe; torchrun for N GPUs
"""
import math
import time
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F

from gate import Gates
from teacher import (
    CALIBRATE_BUDGETS,
    CALIBRATE_ITERS,
    agreement,
    calibrate_heads,
    kept_by_rule,
    pool_agreement,
    spearman,
    token_marks,
    top_at_counts,
)

VAL_EVERY = 100    # every 100th token is validation (METHOD.md §5.2)
EVAL_EVERY = 50    # validation every 50 steps (METHOD.md §5.4)
ACC_THRESHOLD = 0.05  # accuracy: both sides of 0.05 agree (METHOD.md §5.3)
MOMENTUM = 0.9  # SGD's (METHOD.md §5.4)
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults
RANK_WEIGHT = 1.0  # --loss rank's pairwise term beside BCE: weight 1, not tuned (METHOD.md §13.13)
LOG_FLOOR = 1e-6   # logmse: scores below count as this (a teacher score is a max attention, > 0)
CUT_BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5)  # --keep-term, --cut-pairs: the cuts trained at (§13.15)
SELECT_BUDGET = 0.2  # --select overlap: the budget whose kept set is compared


@dataclass(frozen=True)
class Recipe:
    """How the gates are trained. Every field defaults to the paper's recipe (METHOD.md §5.3-5.4)
    and names a part train_layers uses: the paper's inline, the others from section 4 (LOSSES,
    OPTIMIZERS, SELECTIONS); RECIPES names the ones train_gate.py offers (--recipe), each field can
    be overridden by its own flag."""
    optimizer: str = "sgd"     # "sgd": momentum 0.9 (the paper's); "adam": Adam (AdamW with decay)
    lr: float = 0.2            # base learning rate
    schedule: str = "step"     # "step": the authors' piecewise one; "cosine": 1% warm-up, cosine
    weight_decay: float = 0.0  # decoupled (AdamW); SGD takes none, as the paper
    loss: str = "bce"          # "bce": the paper's; "rank": BCE + RANK_WEIGHT · rank; "logmse"
    select: str = "last"       # "last": the gates after the last step; "spearman" / "overlap": per
                               # layer, those of the validation step with the best held-out Spearman
                               # / top-k overlap with the teacher's kept set at SELECT_BUDGET
    # training aimed at the cache's cut (section 5, METHOD.md §13.15); each off by default
    keep_term: float = 0.0     # weight of the keep/drop term at the teacher's cuts
    cut_pairs: float = 0.0     # weight of a ranking term over pairs across the teacher's cut
    final_chunk: str = "keep"  # "drop": no training target in a document's short last teacher chunk
    clip: float = 0.0          # clip each layer's gradient norm to this (0: no clipping)
    calibrate_heads: bool = False  # after training, set each head's cut offset so that the
                                   # prefill's cut keeps the teacher's share of it (calibrate_heads)


RECIPES = {
    "paper": Recipe(),
    # Adam on KVzap's log-space MSE: closer to the teacher on held-out documents, downstream better
    # on SmolLM2 and worse on Gemma's pass keys, so not the default (METHOD.md §13.14)
    "adam-logmse": Recipe(optimizer="adam", lr=3e-3, loss="logmse"),
}


DEFAULT_LR = {"sgd": 0.2, "adam": 3e-3}  # another optimizer than the recipe's, without an lr


def make_recipe(name, given):
    """RECIPES[name] with the fields that `given` ({field: value or None}) sets; another optimizer
    than the recipe's, without an lr, takes its own DEFAULT_LR."""
    recipe, given = RECIPES[name], dict(given)
    if given["optimizer"] not in (None, recipe.optimizer) and given["lr"] is None:
        given["lr"] = DEFAULT_LR[given["optimizer"]]
    return replace(recipe, **{f: v for f, v in given.items() if v is not None})


# -------------------------------------------------------------------------------------------------
# 3. training (METHOD.md §5.2-5.4): the paper's recipe; the others plug a named loss, optimiser or
#    selection into the same loop (section 4)

def split(store, drop_final=False):
    """(train, validation) token indices: the held-out documents when there are any, else the
    authors' split, every 100th token, 1-based (load_data.py:split_fn). drop_final (--final-chunk
    drop): no training token in a document's short last teacher chunk (short_final_chunk)."""
    is_val = store.is_val_doc
    if not is_val.any():
        is_val = (torch.arange(store.n_tokens) + 1) % VAL_EVERY == 0
    is_train = ~is_val
    if drop_final:
        is_train &= ~short_final_chunk(store.lengths, store.teacher_chunk)
    return is_train.nonzero().squeeze(1), is_val.nonzero().squeeze(1)


def train(store, cfg, device, steps, batch_tokens, seed=0, log=print, recipe=Recipe(), groups=1,
          ceiling=None):
    """METHOD.md §5.2-5.4 with the paper's Recipe(); the others are §13. Returns (gates, metrics).
    The batches never depend on the recipe (but --final-chunk drop's, which has fewer tokens).
    Layers share no parameters and every loss is a sum over layers, so the layers may train in
    `groups` runs one after another, each over the same batches with its layers' features read into
    memory: the gates are those of one joint run (tested), and features larger than memory are read
    once per group instead of at random on every step. ceiling(hidden, scores, train_idx, val_idx,
    dtype, device) -> held-out log scores (L, H, n_val) of another predictor (the command line's ridge
    ceiling), measured beside the gate (ceiling_* in metrics)."""
    train_idx, val_idx = split(store, recipe.final_chunk == "drop")
    B = batch_tokens
    assert len(train_idx) >= B and len(val_idx) > 0, "too few tokens to train (commands/train_gate)"
    torch.manual_seed(seed)
    # projections and b in the model's dtype, norms and sink keys in fp32 (METHOD.md §1.2)
    make = lambda n: Gates(n, cfg.hidden_size, cfg.num_key_value_heads, cfg.group_size,
                           dtype=store.dtype, device=device)
    gates = make(len(cfg.compressed_layers))
    batches = torch.get_rng_state()  # where the batch order starts, for every group
    segments = val_segments(store, val_idx)
    t0 = time.perf_counter()
    # what the cut's options need, once for all groups: each needs every layer's scores (section 5)
    cut = (cut_targets(store, recipe.final_chunk == "drop", train_idx)
           if recipe.keep_term or recipe.cut_pairs else None)
    kept = (teacher_kept(store.scores[:, :, val_idx], segments)
            if recipe.select == "overlap" or ceiling else None)
    if cut is not None:
        log(f"the teacher's cuts at budgets {', '.join(map(str, CUT_BUDGETS))} "
            f"({time.perf_counter() - t0:.0f} s)")
    parts = []
    groups = max(1, min(groups, store.n_layers))
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
                                  device, steps, B, seed, lambda s: log(name + s), recipe, t0,
                                  cut and cut.layers(part),
                                  kept and [(k[part], w) for k, w in kept], ceiling))
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
    if recipe.calibrate_heads:
        metrics["head_calibration"] = calibrate_heads(gates, store, device, log)
    metrics.update(layers=list(cfg.compressed_layers), n_train=len(train_idx), n_val=len(val_idx),
                   recipe=asdict(recipe), layer_groups=groups, seconds=time.perf_counter() - t0)
    metrics["steps_per_s"] = steps / max(metrics["seconds"], 1e-9)
    return gates, metrics


def train_layers(gates, hidden, scores, train_idx, val_idx, segments, device, steps, B, seed, log,
                 recipe, t0, cut=None, kept=None, ceiling=None):
    """train's loop for the layers of `gates`, their features hidden (L, N, D) and targets scores
    (L, H, N) in memory -> metrics (per validation step, per layer). The paper's step (METHOD.md
    §5.3-5.4): BCE, SGD with momentum, the authors' learning-rate schedule, the gates of the last
    step; another Recipe's loss, optimiser or selection comes from section 4 (other_parts), the
    cut's terms from section 5: cut (CutTargets of these layers) for --keep-term and --cut-pairs,
    kept (teacher_kept of these layers) for the held-out overlap, ceiling as train's."""
    dtype = gates.dtype  # the gates train in the model's dtype (METHOD.md §5.4), not the stored one
    x_val, y_val = hidden[:, val_idx].to(dtype), scores[:, :, val_idx]
    params = list(gates.parameters())  # each (L, ...): row li is compressed layer li
    momentum = [None] * len(params)  # SGD's buffers
    loss, optimizer_step, select = other_parts(recipe, params, seed, steps)  # None: the paper's
    cut_terms = cut and CutTerms(cut, hidden, scores, recipe, B // 2, seed)
    n_train = len(train_idx)
    n_split = n_train // B  # epoch-style sampling: a fresh permutation every n_split steps
    metrics = dict(step=[], train_loss=[], train_acc=[], val_loss=[], val_acc=[], val_spearman=[],
                   const_val_loss=constant_bce(y_val), floor_val_loss=floor_bce(y_val),
                   **(loss.metrics if loss else {}))
    for i in range(steps):
        if i % n_split == 0:
            perm = torch.randperm(n_train)
        idx = train_idx[perm[(i % n_split) * B:(i % n_split + 1) * B]]
        x, y = hidden[:, idx].to(device, dtype), scores[:, :, idx].to(device)
        pred = gates(x)                  # (L, H, B): all layers in one batched call
        bce = bce_per_layer(pred, y)     # (L,)
        # summed over layers: their parameters are disjoint, the batch is shared
        total, terms = (bce.sum(), {}) if loss is None else loss(pred, y, bce)
        if cut_terms is not None:
            total, terms = cut_terms(gates, pred, y, idx, total, terms)
        total.backward()
        if recipe.clip:
            terms["train_grad_norm"] = clip_per_layer(params, recipe.clip)
        lr = recipe.lr * lr_multiplier(i, steps, recipe.schedule)
        if optimizer_step is None:
            sgd_step(params, momentum, lr)
        else:
            optimizer_step(lr, i + 1)
        if i % EVAL_EVERY == 0 or i == steps - 1:
            # as the authors: this batch's loss (before its update), validation after the update
            val = evaluate(gates, x_val, y_val, segments, device, kept=kept)
            record(metrics, i, lr, bce, terms, acc_per_layer(pred.detach(), y), val, log, t0)
            if select is not None:
                select.see(i, val[2] if recipe.select == "spearman" else val[3])
    if select is not None:
        select.finish(metrics)
    if ceiling is not None:  # a linear predictor's held-out agreement beside the returned gate's
        fit = ceiling(hidden, scores, train_idx, val_idx, dtype, device).float().cpu()
        gate = evaluate(gates, x_val, y_val, segments, device, kept=kept)
        metrics.update(gate_val_spearman=gate[2], gate_val_overlap=gate[3],
                       ceiling_val_spearman=spearman_per_layer(fit, y_val, segments),
                       ceiling_val_overlap=overlap_per_layer(fit, kept, segments))
    return metrics


def record(metrics, step, lr, bce, terms, train_acc, val, log, t0):
    """A validation step's numbers per layer into metrics (the train loss is BCE whatever the
    loss; terms: the other loss's own), and one line to log."""
    val_loss, val_acc, val_rho = val[:3]
    if len(val) > 3:
        metrics.setdefault("val_overlap", []).append(val[3])
    L = len(val_loss)
    metrics["step"].append(step)
    metrics["train_loss"].append(bce.tolist())
    for k, v in terms.items():
        metrics.setdefault(k, []).append(v.tolist())
    metrics["train_acc"].append(train_acc.tolist())
    metrics["val_loss"].append(val_loss)
    metrics["val_acc"].append(val_acc)
    metrics["val_spearman"].append(val_rho)
    overlap = [x for x in val[3] if x is not None] if len(val) > 3 else []
    log(f"step {step:5d}  lr {lr:.2g}  train BCE {sum(bce.tolist()) / L:.4f}  "
        f"val BCE {sum(val_loss) / L:.4f}  val acc {100 * sum(val_acc) / L:.1f}%  "
        f"val spearman {sum(val_rho) / L:.3f} (min {min(val_rho):.3f})  "
        + (f"overlap@{SELECT_BUDGET} {sum(overlap) / len(overlap):.3f}  " if overlap else "")
        + f"({time.perf_counter() - t0:.0f} s)")


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
    """(L, H, B) -> (L,): BCE against the soft targets,
    mean over tokens, sum over heads (METHOD.md §5.3)."""
    return F.binary_cross_entropy(pred, target.to(pred.dtype), reduction="none").mean(-1).sum(-1)


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


def acc_per_layer(pred, target):
    """(L, H, B) -> (L,): agreement of pred >= 0.05 and target >= 0.05 over heads and tokens."""
    return ((pred >= ACC_THRESHOLD) == (target >= ACC_THRESHOLD)).float().mean(dim=(1, 2))


def evaluate(gates, x, y, segments, device, block=8192, kept=None):
    """Validation BCE, accuracy and Spearman with the teacher per layer over the whole held-out set
    (in blocks of tokens); with kept (teacher_kept), also the overlap at SELECT_BUDGET
    (overlap_per_layer). Spearman is teacher.spearman over each layer's H·n pairs of one segment (a
    held-out document), averaged over the segments: what teacher.agreement reports, and what the
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
    out = loss.tolist(), acc.tolist(), spearman_per_layer(pred, y, segments)
    return out if kept is None else (*out, overlap_per_layer(pred, kept, segments))


def spearman_per_layer(pred, y, segments):
    """(L, H, n) held-out predictions and targets -> per layer, the mean over the segments of
    teacher.spearman over the layer's H·n pairs of one segment."""
    return [sum(spearman(pred[li, :, a:b].flatten().double(), y[li, :, a:b].flatten().double())
                for a, b in segments) / len(segments) for li in range(pred.shape[0])]


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
    """[start, end) ranges of the validation tokens (positions in val_idx)
    that belong to one document."""
    doc = torch.searchsorted(store.starts, val_idx, right=True) - 1
    cut = [0] + ((doc[1:] != doc[:-1]).nonzero().squeeze(1) + 1).tolist() + [len(val_idx)]
    return list(zip(cut[:-1], cut[1:]))


def layer_groups(n_layers, groups):
    """The layer axis cut into `groups` consecutive slices of near-equal size."""
    bounds = [round(g * n_layers / groups) for g in range(groups + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def agreement_with_teacher(gates, store, documents, tokenizer, device):
    """teacher.agreement of the trained gates with their teacher, pooled over `documents` of `store`
    (teacher.pool_agreement: per layer, per head, all layers), None without any (--val-docs 0).
    documents: [(index in the store, the document's token ids)]; ids None (a shard written without
    them): the document counts no digit or identifier token."""
    per_doc = []
    for i, ids in documents:
        start, n = int(store.starts[i]), store.hidden[i].shape[1]
        with torch.no_grad():
            pred = gates.cut_scores(gates(store.hidden[i].to(device)).float()).cpu()  # as cut
        is_digit, is_identifier = (token_marks(tokenizer, ids) if ids is not None
                                   else (torch.zeros(n, dtype=torch.bool),) * 2)
        per_doc.append(agreement(pred, store.scores[:, :, start:start + n], is_digit,
                                 is_identifier=is_identifier))
    return pool_agreement(per_doc) if per_doc else None


def held_out(manifest, docs):
    """The held-out documents of a run, as agreement_with_teacher takes them."""
    return [(i, docs[i][1]) for i, d in enumerate(manifest["documents"]) if d["split"] == "val"]


# -------------------------------------------------------------------------------------------------
# 4. the other recipes' parts (METHOD.md §13.13-13.14), each named in Recipe and plugged into
#    train_layers in place of the paper's: losses, optimisers, selections

def other_parts(recipe, params, seed, steps):
    """(loss, optimiser step, selection) of a Recipe for train_layers, each None where it is the
    paper's (bce, sgd, last)."""
    loss = LOSSES[recipe.loss](seed) if recipe.loss != "bce" else None
    step = (OPTIMIZERS[recipe.optimizer](params, recipe.weight_decay)
            if recipe.optimizer != "sgd" else None)
    select = SELECTIONS[recipe.select](params, steps) if recipe.select != "last" else None
    return loss, step, select


class RankLoss:
    """--loss rank: BCE + RANK_WEIGHT · rank_per_layer over B random token pairs of each batch,
    drawn from a generator of their own: the batches are those of "bce". A loss is made once per
    run from the seed; called on a batch's predictions, targets and per-layer BCE, it returns the
    total to minimise and the per-layer terms to log beside BCE; `metrics`: what it adds to the
    run's metrics."""

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
    own; the cache keeps the top of a ranking, and in a layer whose targets are flat, small BCE
    errors reorder many tokens (METHOD.md §13.13). The term penalises each misordered pair by its
    log-odds gap; weighting by the target gap makes pairs the teacher barely tells apart count
    little (ties not at all), so near-ties do not turn into noise."""
    z = log_odds(pred)
    i, j = pairs
    per_pair, w = ranknet(z[..., i], z[..., j], target[..., i].float(), target[..., j].float())
    return (per_pair.sum(-1) / w.sum(-1).clamp_min(1e-12)).sum(-1)


def log_odds(pred):
    """The gate's log-odds log(p / (1 − p)), p clamped to [1e-7, 1 − 1e-7]."""
    p = pred.float().clamp(1e-7, 1 - 1e-7)
    return torch.log(p) - torch.log1p(-p)


def ranknet(zi, zj, ti, tj):
    """One RankNet term per pair, |t_i − t_j| · softplus(−sign(t_i − t_j) · (z_i − z_j)), and its
    weight |t_i − t_j|."""
    dt = ti - tj
    w = dt.abs()
    return w * F.softplus(-torch.sign(dt) * (zi - zj)), w


class LogMSELoss:
    """--loss logmse: logmse_per_layer summed over layers, in place of BCE."""
    metrics = {}

    def __init__(self, seed):  # no randomness of its own
        pass

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


LOSSES = {"rank": RankLoss, "logmse": LogMSELoss}


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


OPTIMIZERS = {"adam": adam}


class KeepBest:
    """--select spearman / overlap: per layer, the parameters of the validation step whose held-out
    Spearman with the teacher / overlap with its kept set at SELECT_BUDGET (overlap_per_layer) was
    best (layers share no parameters: each keeps its own step). A layer without a value (no pair
    the teacher keeps there) keeps the last step's."""

    def __init__(self, params, steps, metric):
        L = params[0].shape[0]
        self.params, self.best = params, [p.detach().clone() for p in params]
        self.metric, self.value, self.step = metric, [None] * L, [steps - 1] * L

    @torch.no_grad()
    def see(self, step, values):
        for li, v in enumerate(values):
            if v is not None and (self.value[li] is None or v > self.value[li]):
                self.value[li], self.step[li] = v, step
                for b, p in zip(self.best, self.params):
                    b[li] = p[li]

    @torch.no_grad()
    def finish(self, metrics):
        for li, v in enumerate(self.value):
            for b, p in zip(self.best, self.params):
                if v is not None:
                    p[li] = b[li]
        metrics.update(selected_step=self.step, **{f"selected_val_{self.metric}": self.value})


SELECTIONS = {m: lambda params, steps, m=m: KeepBest(params, steps, m)
              for m in ("spearman", "overlap")}
# what each part of a Recipe may be named: the paper's, then the others (the flags' choices)
PARTS = dict(optimizer=("sgd", *OPTIMIZERS), loss=("bce", *LOSSES), select=("last", *SELECTIONS))


# -------------------------------------------------------------------------------------------------
# 5. training aimed at the cache's cut (METHOD.md §13.15), each an option of Recipe: targets without
#    the teacher's short final chunk, its keep/drop decisions as labels (--keep-term) and as pairs
#    (--cut-pairs), the held-out overlap of the kept sets (--select overlap), gradient clipping

def short_final_chunk(lengths, chunk):
    """(N,) bool over the documents' tokens end to end: True in each document's last teacher chunk
    where it is shorter than `chunk`. The teacher scores each chunk of `chunk` context tokens in a
    softmax of its own (teacher.py), so a shorter chunk's fewer keys share the same attention and
    its scores come out inflated (--final-chunk drop leaves them out of the training targets)."""
    return torch.cat([torch.arange(n) >= n - n % chunk for n in lengths.tolist()])


@dataclass(frozen=True)
class CutTargets:
    """The teacher's cuts at CUT_BUDGETS in every training document (cut_targets), on the store's
    token axis. kept (L, H, N) uint8: bit r set where budget CUT_BUDGETS[r] keeps the pair;
    log_tau (R, docs): each cut's threshold, in log space; decided (R, docs): how many positions
    from the document's start the cut decides (0: no cut at that budget); starts (docs,); is_train
    (N,): the training tokens; part: the layers of kept among n_layers (layers())."""
    kept: torch.Tensor
    log_tau: torch.Tensor
    decided: torch.Tensor
    starts: torch.Tensor
    is_train: torch.Tensor
    n_layers: int
    part: slice

    def layers(self, part):
        return replace(self, kept=self.kept[part], part=part)


def cut_targets(store, drop_final, train_idx):
    """CutTargets of the store's training documents, computed once from all layers' scores (the
    cut is global). For each document (without its short final chunk with drop_final) and budget r,
    the cache's own rule (teacher.kept_by_rule, level global: the last window kept, and of the
    segment before it the top ⌊r'·L·H·s⌋ pairs of all layers and heads) labels every pair of the
    segment; the threshold τ_r is the geometric midpoint of the weakest kept and the strongest
    dropped score (both floored at LOG_FLOOR): log τ_r = (log s_kept_min + log s_dropped_max) / 2.
    A budget the window fills alone (its cut keeps nothing of the segment: a 16K-30K document at 0.1
    and 0.2, where the window is 4,096) or that keeps the whole segment has no cut there."""
    L, H, N = store.scores.shape
    R, D = len(CUT_BUDGETS), len(store.starts)
    kept = torch.zeros(L, H, N, dtype=torch.uint8)
    log_tau = torch.zeros(R, D)
    decided = torch.zeros(R, D, dtype=torch.long)
    log = lambda x: math.log(max(float(x), LOG_FLOOR))
    for d, (s, n) in enumerate(zip(store.starts.tolist(), store.lengths.tolist())):
        if store.is_val_doc[s]:
            continue  # held out: never trained on
        m = n - n % store.teacher_chunk if drop_final else n
        for r, ratio in enumerate(CUT_BUDGETS):
            keep, w = kept_by_rule(store.scores[:, :, s:s + m], ratio)
            seg, keep = store.scores[:, :, s:s + m - w], keep[..., :m - w]
            if keep.all() or not keep.any():
                continue
            kept[:, :, s:s + m - w] |= keep.to(torch.uint8) << r
            log_tau[r, d] = (log(seg[keep].min()) + log(seg[~keep].max())) / 2
            decided[r, d] = m - w
    is_train = torch.zeros(N, dtype=torch.bool)
    is_train[train_idx] = True
    return CutTargets(kept, log_tau, decided, store.starts, is_train, L, slice(None))


def keep_drop_per_layer(pred, kept, log_tau, decided):
    """(L, H, B) -> (L,): --keep-term. For each budget r of CUT_BUDGETS and each batch token whose
    document's cut decides it (decided (R, B) bool), with y = +1 where the teacher keeps the pair
    (kept (L, H, B) uint8, bit r) and −1 where it drops it, and the cut's threshold τ_r (log_tau
    (R, B)):
        softplus(−y · (log p − log τ_r)),    log p floored at LOG_FLOOR,
    mean over budgets and decided tokens, sum over heads: a logistic loss on the side of the cut the
    gate's score falls, unit slope in log space (a factor e on the teacher's side of τ_r costs
    softplus(−1) = 0.31, on the other side softplus(1) = 1.31). Both logs are finite, so it is
    defined for every pair. τ_r is one threshold over all layers, so the gate learns the allocation
    across layers too, yet each layer's term depends on its own gate only (layer groups stay one
    joint run)."""
    lp = torch.log(pred.float().clamp_min(LOG_FLOOR))
    total = 0
    for r in range(len(CUT_BUDGETS)):
        y = ((kept >> r) & 1).float() * 2 - 1
        total = total + (F.softplus(-y * (lp - log_tau[r, None, None])) * decided[r]).sum(-1)
    return (total / decided.sum().clamp_min(1)).sum(-1)


class CutTerms:
    """--keep-term W and --cut-pairs W for the layers of one train_layers run: called with the gates,
    the batch's predictions, targets and token indices and the loss so far, it adds W times each
    term summed over layers, and logs each term per layer."""

    def __init__(self, cut, hidden, scores, recipe, n_pairs, seed):
        self.cut, self.hidden, self.scores, self.recipe = cut, hidden, scores, recipe
        self.pairs = CutPairs(cut, scores, n_pairs, seed) if recipe.cut_pairs else None

    def __call__(self, gates, pred, y, idx, total, terms):
        c, dev = self.cut, pred.device
        if self.recipe.keep_term:
            doc = torch.searchsorted(c.starts, idx, right=True) - 1
            decided = ((idx - c.starts[doc])[None] < c.decided[:, doc]).float()  # (R, B)
            keep = keep_drop_per_layer(pred, c.kept[:, :, idx].to(dev), c.log_tau[:, doc].to(dev),
                                       decided.to(dev))
            total, terms["train_keep_loss"] = total + self.recipe.keep_term * keep.sum(), keep
        if self.pairs is not None:
            tok, head, valid = self.pairs.draw()                               # (L, 2P) (L, P)
            lay = torch.arange(tok.shape[0])[:, None]
            p = gates(self.hidden[lay, tok].to(dev, gates.dtype))              # (L, H, 2P)
            p = p.gather(1, head[:, None].to(dev)).squeeze(1)                  # (L, 2P)
            t = self.scores[lay, head, tok].to(dev)
            pair = cut_pair_per_layer(p, t, valid.to(dev), self.scores.shape[1])
            total, terms["train_cut_pair_loss"] = total + self.recipe.cut_pairs * pair.sum(), pair
        return total, terms


class CutPairs:
    """--cut-pairs: each step, per layer, P pairs (i, j) of training tokens of one document, in one
    head, i kept and j dropped by the teacher's cut at a budget of CUT_BUDGETS: (budget, document)
    drawn in proportion to the positions its cut decides, the head uniformly, then i uniformly among
    the pairs the cut keeps in that layer and head and j among those it drops. Same layer, not
    across layers: each layer's term then depends on its own gate only, and the allocation across
    layers is --keep-term's (its threshold is shared). The pairs come from a generator of their own,
    drawn for all n_layers and sliced: the batches are those without the term, and layer groups draw
    the same pairs. Within one layer and head the kept pairs are the top of the score order (the cut
    is a threshold), so each document's positions are sorted once."""

    def __init__(self, cut, scores, n_pairs, seed):
        L, H, N = scores.shape
        R, D = cut.decided.shape
        region = cut.decided.amax(0)  # every budget with a cut has the same window
        self.order = torch.zeros(L, H, N, dtype=torch.int32)  # by descending score, per document
        self.count = torch.zeros(R, L, H, D, dtype=torch.long)  # kept pairs per cut, layer, head
        for d, (s, k) in enumerate(zip(cut.starts.tolist(), region.tolist())):
            if k:
                self.order[:, :, s:s + k] = torch.sort(scores[:, :, s:s + k], descending=True,
                                                       stable=True).indices
                for r in range(R):
                    if cut.decided[r, d]:
                        self.count[r, :, :, d] = ((cut.kept[:, :, s:s + k] >> r) & 1).sum(-1)
        weights = cut.decided.flatten().double()
        self.weights = weights if weights.sum() > 0 else torch.ones_like(weights)  # no cut at all
        self.cut, self.n_pairs, self.n_heads = cut, n_pairs, H
        self.rng = torch.Generator().manual_seed(seed)

    def draw(self):
        """-> tokens (L, 2P) (the i then the j of every pair), heads (L, 2P), valid (L, P): a pair
        is void where its layer and head keep none or all of the cut's pairs, or it hit a
        validation token (--val-docs 0)."""
        c, g, P, D = self.cut, self.rng, self.n_pairs, self.cut.decided.shape[1]
        rd = torch.multinomial(self.weights, c.n_layers * P, replacement=True, generator=g)
        rd = rd.view(c.n_layers, P)[c.part]
        head = torch.randint(self.n_heads, (c.n_layers, P), generator=g)[c.part]
        u = torch.rand(2, c.n_layers, P, generator=g, dtype=torch.float64)[:, c.part]
        r, d = rd // D, rd % D
        lay = torch.arange(rd.shape[0])[:, None]
        n_kept, k, s = self.count[r, lay, head, d], c.decided[r, d], c.starts[d]
        i = (u[0] * n_kept).long()
        j = torch.minimum(n_kept + (u[1] * (k - n_kept)).long(), (k - 1).clamp_min(0))
        ti = s + self.order[lay, head, s + i].long()
        tj = s + self.order[lay, head, s + j].long()
        valid = (n_kept > 0) & (n_kept < k) & c.is_train[ti] & c.is_train[tj]
        return torch.cat([ti, tj], 1), torch.cat([head, head], 1), valid


def cut_pair_per_layer(pred, target, valid, n_heads):
    """(L, 2P) predictions and targets of P pairs (i then j) in their own heads, valid (L, P) ->
    (L,): rank_per_layer's weighted RankNet term over the valid pairs, times n_heads (the heads are
    drawn at random: the mean over pairs estimates the mean over heads, and rank_per_layer sums over
    heads)."""
    P = valid.shape[1]
    z = log_odds(pred)
    per_pair, w = ranknet(z[:, :P], z[:, P:], target[:, :P].float(), target[:, P:].float())
    return n_heads * (per_pair * valid).sum(-1) / (w * valid).sum(-1).clamp_min(1e-12)


def teacher_kept(y, segments):
    """The teacher's kept sets at SELECT_BUDGET on the held-out tokens y (L, H, n_val): per segment
    (a held-out document), teacher.kept_by_rule's (keep mask (L, H, n), window), all layers at once
    (the cut is global)."""
    return [kept_by_rule(y[:, :, a:b], SELECT_BUDGET) for a, b in segments]


def overlap_per_layer(pred, kept, segments):
    """Per layer, teacher.agreement's topk_overlap at SELECT_BUDGET, pooled over the segments by
    sums: of the teacher's kept pairs outside the window (kept: teacher_kept), the share among the
    top k of `pred` (L, H, n_val) in each head, k = the teacher's count in that head
    (teacher.top_at_counts); None where the teacher keeps none. Each layer's number depends on its
    own predictions only (agreement's overlap compares two kept sets each chosen over all layers),
    so that --select overlap can pick a step per layer."""
    both = total = torch.zeros(pred.shape[0], dtype=torch.long)
    for (a, b), (keep, w) in zip(segments, kept):
        n = b - a - w
        kt = keep[..., :n]
        top = top_at_counts(pred[:, :, a:a + n], kt.sum(-1))
        both, total = both + (kt & top).flatten(1).sum(1), total + kt.flatten(1).sum(1)
    return [int(x) / int(t) if t else None for x, t in zip(both, total)]


@torch.no_grad()
def clip_per_layer(params, max_norm):
    """--clip: each layer's gradient (its rows of every parameter) scaled to a norm of at most
    max_norm, as torch.nn.utils.clip_grad_norm_ would scale that layer's alone (by max_norm /
    (norm + 1e-6), capped at 1). Per layer, not global: the layers share no parameters and train on
    their own (a global norm would tie each layer's step to the others', and layer groups would no
    longer be one joint run). Returns the norms before clipping (L,)."""
    norm = torch.stack([p.grad.float().flatten(1).norm(dim=1) for p in params]).norm(dim=0)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef.view(-1, *[1] * (p.dim() - 1)).to(p.grad.dtype))
    return norm


# -------------------------------------------------------------------------------------------------
# the program: python train_gate.py ... The three steps in order, here; the flags and their checks,
# the output folder, torchrun and what is written and printed are the command line's
# (commands/train_gate.py), which imports no program: this file is loaded once.

def main(argv=None):
    from commands import train_gate as command  # the program's edge: its command line

    def run(args):
        job = command.prepare(args)  # flags checked, the model's config, torchrun, --out checked
        docs = command.pick_documents(args, job)  # 1. data, its manifest in --out
        store = command.extract(args, job, docs)  # 2. features; None: --steps 0, or not rank 0
        if store is None:
            return
        recipe = make_recipe(args.recipe, {f.name: getattr(args, f.name) for f in fields(Recipe)})
        train_idx, val_idx = split(store, recipe.final_chunk == "drop")
        command.check_split(args, store, len(train_idx), len(val_idx), VAL_EVERY)
        groups = args.layer_groups or command.auto_layer_groups(store)  # train caps it
        ceiling = command.ridge_ceiling if args.ridge_ceiling else None  # a report beside the gate
        gates, metrics = train(store, job.cfg, job.device, args.steps, args.batch_tokens,
                               args.seed, job.log, recipe, groups, ceiling)  # 3. training
        agreement = agreement_with_teacher(gates, store, held_out(job.manifest, docs),
                                           job.tokenizer, job.device)
        mix = command.mix_held_out(args, job)  # --mix-features: its held-out documents, apart
        if mix is not None:
            metrics["mix_agreement"] = agreement_with_teacher(gates, *mix, job.tokenizer,
                                                              job.device)
        evals = {}  # --eval-features: every document of each folder
        for name, folder, eval_store, documents in command.eval_stores(job):
            a = agreement_with_teacher(gates, eval_store, documents, job.tokenizer, job.device)
            evals[name] = dict(folder=folder, documents=len(documents), agreement=a)
        metrics["eval_agreement"] = evals
        command.save(args, job, store, docs, gates, metrics, agreement, recipe_settings(recipe))

    return command.main(argv, run, RECIPES, PARTS)


def recipe_settings(recipe):
    """The recipe and the constants it trained with, for the gate file's training summary."""
    return {**asdict(recipe), **(dict(momentum=MOMENTUM) if recipe.optimizer == "sgd" else {}),
            **(dict(rank_weight=RANK_WEIGHT) if recipe.loss == "rank" else {}),
            **(dict(cut_budgets=CUT_BUDGETS) if recipe.keep_term or recipe.cut_pairs else {}),
            **(dict(calibrate_budgets=CALIBRATE_BUDGETS, calibrate_iters=CALIBRATE_ITERS)
               if recipe.calibrate_heads else {})}


if __name__ == "__main__":
    import sys
    sys.exit(main())
