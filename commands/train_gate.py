"""
python train_gate.py: teach the gates, from raw text to a trained gate file (METHOD.md §4-5), in
three steps (train_gate.py's main runs them in order):
  1. data      pick documents (METHOD.md §5.1, commands/features.py): 10K-30K-token documents plus
               ~100K-token concatenations of the same documents, ~1M tokens in all; 5% of the
               documents are held out whole for validation (--val-docs) and never enter a
               concatenation. --mix-features DIR mixes in another corpus: the features of its
               training documents (made by train_gate.py --steps 0 --data TEXT --out DIR with the
               same model and teacher flags, e.g. the numeric-rich text of offline/numeric_text.py,
               which the prose corpus lacks) join the training tokens after this run's, in
               proportion to their tokens; this run's held-out documents stay its validation
               (with --val-docs 0, every 100th token of all, the mixed ones too) and DIR's
               held-out documents get an agreement of their own (offline/README.md: the
               ablation).
  2. features  for every document, prefill system prompt + context with a full cache, score every
               context KV pair with the KVzip teacher (teacher.py, METHOD.md §4) and record the
               attention-input hidden states of the compressed layers. One shard file per
               document, written atomically under --out/features, so an interrupted run resumes
               where it stopped (commands/features.py).
  3. training  distil the scores into the gates (METHOD.md §5.2-5.4): BCE against the soft targets,
               SGD momentum 0.9, lr 0.2 with the authors' piecewise schedule, 5,000 steps of 1,000
               tokens (5 epochs of the recipe's 1M tokens), all layers batched through gate.Gates;
               then the gate's agreement with its teacher on the held-out documents
               (teacher.agreement). --recipe adam-logmse (Adam on the MSE of log scores; the bundled
               SmolLM2 gate's) and one flag per field of the recipe plug in other losses, optimisers
               and selections (train_gate.Recipe, METHOD.md §13.14), and terms aimed at the cache's
               cut (--keep-term, --cut-pairs, --final-chunk, --select overlap, --clip; METHOD.md
               §13.15); --calibrate-heads (§13.17) sets each head's offset at the prefill's cut
               after training so that the cut gives each head the teacher's share;
               --ridge-ceiling reports a linear ceiling beside the gate.

Outputs in --out (default ./out/<model>): features/ + manifest.json, gate.safetensors
(formats.gate_file.save_gate, with a training summary in its metadata), metrics.json (per-layer
train/validation loss and accuracy over steps, and the agreement: per layer and head, on the
held-out documents and on each --eval-features folder), curves.png with --plot, and per-layer tables
on stdout.

Cost: METHOD.md §5.5 (the estimate for Qwen3-8B at the paper's ~1M tokens, and measured runs).

Small CPU example (the offline Gemma 3 270M on the Python docs, a few minutes on 2 cores):
    python train_gate.py --data ~/.cache/fastkvzip/assets/pydoc --tokens 10000 --threads 1 \\
        --min-doc-tokens 2000 --max-doc-tokens 6000 --long-doc-tokens 0 --steps 300
Full size (the paper's recipe for Qwen3-8B; one GPU, or N GPUs for the feature step):
    python train_gate.py --model qwen3-8b
    torchrun --nproc_per_node 8 train_gate.py --model qwen3-8b

This file is the command line: the flags and their checks, torchrun, the output folder (--out is
checked before hours of work go into it and created once the input is accepted; kept() says what a
stopped run leaves), and what is printed and written beside the gate (the per-layer tables,
curves.png). The training method is train_gate.py's.
"""
import argparse
import datetime
import errno
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import cli
from cli import OFFLINE_DEFAULT, UsageError, parse_device, pyplot, resolve_model, save_figure, write_json
from commands import features
from commands.features import FeatureStore, check_manifest, data_sha256, extract_features, feature_dtype, load_documents
from formats.checkpoint import check_dtype, read_config, read_tokenizer
from formats.gate_file import authors_file_name, save_gate
from kernels import ArgumentError
from model import ModelError, compute_dtype
from prompts import encode_prompt, prompt_format, uses_chat

DEFAULT_RECIPE = "paper"
MEMORY_SHARE = 0.5  # --layer-groups 0: each group's features in at most this share of the memory
RIDGE_LAMBDA = 1e-3  # --ridge-ceiling: ridge strength per unit of the features' mean variance


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
    if m.get("head_calibration"):
        rows.append(calibration_line(m["head_calibration"]))
    if m["agreement"]:  # the held-out documents, --mix-features', each --eval-features folder
        rows.append(agreement_table(m["agreement"], m["layers"],
                                    f"the {m['n_val_docs']} held-out documents"))
    if m.get("mix_agreement"):
        rows.append(agreement_table(m["mix_agreement"], m["layers"], f"the "
                                    f"{m['mix_features']['val_documents']} held-out documents of "
                                    f"--mix-features"))
    for name, e in m.get("eval_agreement", {}).items():
        if e["agreement"]:
            where = f"the {e['documents']} documents of --eval-features {name}"
            rows.append(agreement_table(e["agreement"], m["layers"], where))
    return "\n".join(rows)


def calibration_line(rows):
    """--calibrate-heads in one line: the mean absolute per-head share error at each budget, before
    and after (teacher.calibrate_heads' first row and the one it kept)."""
    first, last = rows[0], next(r for r in rows if r["kept"])
    budgets = [k.split("@")[1] for k in first if k.startswith("train@")]
    held = lambda r: ("" if first[f"val@{r}"] is None else
                      f" (held out {first[f'val@{r}']:.4f} -> {last[f'val@{r}']:.4f})")
    return ("--calibrate-heads: mean abs per-head share error " + ", ".join(
        f"@{r} {first[f'train@{r}']:.4f} -> {last[f'train@{r}']:.4f}{held(r)}" for r in budgets)
        + f" on the training documents (step {last['step']} of {len(rows) - 1} kept)")


def agreement_table(a, layers, where):
    """How closely the gate keeps what its teacher keeps (teacher.pool_agreement), in a few lines:
    per layer and budget, the overlap at the teacher's own counts per head, the teacher's kept share
    and the gate's share error at the cache's cut; the head that agrees least; then, all layers
    pooled, the overlap at the cut and the digit and identifier tokens each kept set keeps."""
    budgets = [k.split("@")[1] for k in a["all"] if k.startswith("topk_overlap@")]
    pct = lambda x: "   -" if x is None else f"{100 * x:3.0f}%"
    pts = lambda x: "    -" if x is None else f"{100 * x:+5.1f}"
    rows = [f"\nagreement with the teacher on {where} (outside the local window; per head: "
            f"metrics.json)",
            "  ovl  = of the pairs the teacher keeps in a head, the share in the gate's top-k there "
            "(k = its count)",
            "  kept = the teacher's kept share of the layer; err = the gate's share minus the "
            "teacher's, both by",
            "         the cache's cut, in points (all: the mean |err|)",
            (f"{'':>15}" + "".join(f" | {'r = ' + r:^15}" for r in budgets)).rstrip(),
            f"{'layer':>5}  {'spearman':>8}"
            + f" | {'ovl':>4} {'kept':>4} {'err':>5}" * len(budgets)]
    for j, layer in enumerate(layers):
        rows.append(f"{layer:>5}  {a['spearman'][j]:8.3f}" + "".join(
            f" | {pct(a[f'topk_overlap@{r}'][j])} {pct(a[f'kept_teacher@{r}'][j])} "
            f"{pts(a[f'share_error@{r}'][j])}" for r in budgets))
    s = a["all"]
    mean_err = lambda x: "    -" if x is None else f"{100 * x:5.1f}"
    rows.append(f"{'all':>5}  {s['spearman']:8.3f}" + "".join(
        f" | {pct(s[f'topk_overlap@{r}'])} {pct(s[f'kept_teacher@{r}'])} "
        f"{mean_err(s[f'abs_share_error@{r}'])}" for r in budgets))
    worst = []
    for r in budgets:
        heads = [(x, j, h) for j, row in enumerate(a["heads"].get(f"topk_overlap@{r}", []))
                 for h, x in enumerate(row) if x is not None]
        if heads:
            x, j, h = min(heads)
            worst.append(f"{r}: layer {layers[j]} head {h} {pct(x).strip()}")
    if worst:
        rows.append("  lowest ovl of a head at r = " + "; ".join(worst))
    rows += ["  all layers: overlap of the kept sets by the cache's cut (chance), and of the digit "
             "and identifier",
             "  tokens' pairs the share kept by the gate's cut / its top-k at the teacher's counts "
             "/ the teacher",
             f"{'r':>5}  {'overlap':>12}  {'digits':>16}  {'identifiers':>16}"]
    for r in budgets:
        marks = [" / ".join(pct(s[f"{m}_{side}@{r}"]).strip()
                            for side in ("student", "topk", "teacher"))
                 for m in ("digits", "identifiers")]
        overlap = f"{pct(s[f'overlap@{r}'])} ({pct(s[f'chance@{r}']).strip()})"
        rows.append(f"{r:>5}  {overlap:>12}  {marks[0]:>16}  {marks[1]:>16}")
    return "\n".join(rows)


def ceiling_table(m):
    """--ridge-ceiling: per layer, the returned gate's held-out Spearman and overlap at 0.2 beside
    those of the linear (ridge) ceiling: a gate well below it is under-trained, one at it is held
    back by what its input shows (or by the targets), not by its training."""
    num = lambda x: "     -" if x is None else f"{x:6.3f}"
    rows = ["\nthe gate against a linear ceiling (ridge regression of the log teacher score on "
            "the gate's input, fit on the training tokens), on the held-out tokens",
            f"{'layer':>5}  {'spearman gate':>13}  {'ridge':>6}  {'overlap@0.2 gate':>16}  "
            f"{'ridge':>6}"]
    for j, layer in enumerate(m["layers"]):
        rows.append(f"{layer:>5}  {num(m['gate_val_spearman'][j]):>13}  "
                    f"{num(m['ceiling_val_spearman'][j])}  {num(m['gate_val_overlap'][j]):>16}  "
                    f"{num(m['ceiling_val_overlap'][j])}")
    return "\n".join(rows)


def ridge_ceiling(hidden, scores, train_idx, val_idx, dtype, device, floor=1e-6, block=8192):
    """--ridge-ceiling (a report; train_gate.train measures it beside the gate): per layer, closed-
    form ridge regression from the gate's input to the teacher's log score of each KV head,
    log max(t, floor) (floor: train_gate.LOG_FLOOR), fit on the training tokens -> its predictions
    on the validation tokens (L, H, n_val) float64. The input is the recorded hidden state as the
    gate reads it: cast to the gate's dtype, nothing else (gate.sink_gate normalises its projections,
    not its input). With the features X and targets Y centred on the training tokens' means x̄, ȳ:
        W = (XᵀX + λI)⁻¹ XᵀY,   b = ȳ − x̄W (not penalised),   λ = RIDGE_LAMBDA · tr(XᵀX) / D,
    one solve per layer for its H heads. XᵀX and XᵀY are sums over blocks of `block` tokens in
    float64 on `device`; memory: one block and a (D+1)² matrix per layer."""
    L, _, D = hidden.shape
    f64 = dict(dtype=torch.float64, device=device)
    out = []
    for li in range(L):
        xtx, xty = torch.zeros(D + 1, D + 1, **f64), torch.zeros(D + 1, scores.shape[1], **f64)
        for s in range(0, len(train_idx), block):
            idx = train_idx[s:s + block]
            x = hidden[li, idx].to(dtype).to(**f64)
            x = torch.cat([x, torch.ones(len(idx), 1, **f64)], 1)               # (b, D+1)
            y = torch.log(scores[li, :, idx].to(**f64).clamp_min(floor)).T      # (b, H)
            xtx += x.T @ x
            xty += x.T @ y
        n = xtx[D, D]  # the ones column gives the count and the sums: centre without a second pass
        mx, my = xtx[D, :D] / n, xty[D] / n
        sxx = xtx[:D, :D] - n * torch.outer(mx, mx)
        sxy = xty[:D] - n * torch.outer(mx, my)
        lam = RIDGE_LAMBDA * torch.trace(sxx) / D
        w = torch.linalg.solve(sxx + lam * torch.eye(D, **f64), sxy)           # (D, H)
        xv = hidden[li, val_idx].to(dtype).to(**f64)
        out.append((xv @ w + (my - mx @ w)).T.cpu())                           # (H, n_val)
    return torch.stack(out)


def mix_record(folder, mix):
    """What a gate trained with --mix-features records of it: the folder, its documents and tokens
    by split, and the sha256 of its documents' keys (features.doc_key: their token ids)."""
    keys = hashlib.sha256(" ".join(d["key"] for d in mix["documents"]).encode()).hexdigest()
    count = lambda split, k: sum(d[k] if k else 1 for d in mix["documents"] if d["split"] == split)
    return dict(folder=str(Path(folder).absolute()), train_documents=count("train", None),
                train_tokens=count("train", "tokens"), val_documents=count("val", None),
                keys_sha256=keys)


def mix_line(m):
    """One line on the --mix-features held-out documents: the agreement with the teacher, each
    number the mean over the compressed layers (per layer in metrics.json, mix_agreement)."""
    a, n = m["mix_agreement"], m["mix_features"]["val_documents"]
    if not a:
        return f"--mix-features: no held-out document of its {n} to report"
    mean = lambda k: (lambda v: None if not v else sum(v) / len(v))(
        [x for x in a[k] if x is not None])
    pct = lambda k: "-" if mean(k) is None else f"{100 * mean(k):.0f}%"
    return (f"--mix-features held-out documents ({n}): spearman {mean('spearman'):.3f}, "
            f"overlap@0.5 {pct('overlap@0.5')} (chance {pct('chance@0.5')}), digits kept@0.5 "
            f"gate/teacher {pct('digits_student@0.5')} / {pct('digits_teacher@0.5')}, @0.3 "
            f"{pct('digits_student@0.3')} / {pct('digits_teacher@0.3')} (layer means)")


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

@dataclass
class Job:
    """What prepare() found, for the steps of train_gate.main."""
    rank: int
    world: int  # torchrun's processes (1 without torchrun)
    device: torch.device
    model_name: str
    out: str
    dtype: torch.dtype
    folder: Path
    cfg: object
    tokenizer: object
    chat: bool
    fmt: object
    stored_dtype: torch.dtype
    prefill_chunk: int
    log: object  # the step log (off with --quiet)
    manifest: dict = None  # pick_documents'
    data_hash: str = None
    mix: dict = None  # --mix-features: its manifest (features.read_mix)
    eval_sets: list = None  # --eval-features: [(name, folder, manifest)], checked (eval_folders)


def prepare(args):
    """Everything before the documents: threads, torchrun, the device, --out checked, the model's
    config and tokenizer (rank 0 downloads or converts it first, alone)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = init_distributed()
    import torch.distributed as dist
    device = parse_device(args.device) if args.device else torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    model_name, out = names(args.model, args.out)
    check_out(out, rank)
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
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr))
    job = Job(rank, world, device, model_name, out, dtype, folder, cfg, tokenizer, chat, fmt,
              stored_dtype, prefill_chunk, log)
    job.eval_sets = eval_folders(args.eval_features, model_name, cfg)
    return job


def pick_documents(args, job):
    """Step 1: the documents (features.load_documents) and their manifest, checked against one
    already in --out (a resumed run) and written there; only now is --out created."""
    system = encode_prompt(job.tokenizer, job.fmt.system)
    # the longest repeat input: prompt (< 64 tokens with the previous chunk's last 8) + one chunk
    n_pos = job.cfg.max_position_embeddings
    max_context = n_pos - len(system) - args.teacher_chunk - 64
    if max_context < args.min_doc_tokens:
        raise UsageError(f"the model holds {n_pos} positions: with "
                         f"--teacher-chunk {args.teacher_chunk} a document can have at most "
                         f"{max_context} context tokens, fewer than --min-doc-tokens "
                         f"{args.min_doc_tokens}; lower them")
    docs = load_documents(args.data, args.tokens, args.min_doc_tokens, args.max_doc_tokens,
                          args.long_doc_tokens, args.val_docs, job.tokenizer, max_context)
    job.data_hash = data_sha256(args.data)
    if job.rank == 0:
        features.note_bundled_corpus(job.model_name, job.data_hash)
    job.manifest = features.make_manifest(job.model_name, job.cfg, job.dtype, docs,
                                          args.teacher_chunk, args.teacher_softmax, job.chat,
                                          job.stored_dtype)
    check_manifest(job.out, job.manifest)
    if args.mix_features:  # checked before hours of features go into --out
        job.mix = features.read_mix(args.mix_features, job.manifest, job.out)
    make_out(job.out, job.rank)  # only now the input is accepted: a refused run leaves no folder
    if job.rank == 0:
        write_json(Path(job.out) / "manifest.json", job.manifest, indent=1)
        n_val = sum(split == "val" for _, _, split in docs)
        n_tok = sum(len(ids) for _, ids, _ in docs)
        print(f"{len(docs)} documents ({n_val} held out for validation), {n_tok} context tokens -> "
              f"{job.out}/features", file=sys.stderr)
    return docs


def extract(args, job, docs):
    """Step 2: every document's features (features.extract_features), each torchrun process its
    share -> the FeatureStore to train on; None when there is no training here (--steps 0, or a
    process other than rank 0)."""
    import torch.distributed as dist
    t0 = time.perf_counter()
    extract_features(job.out, job.folder, job.dtype, job.device, docs, job.fmt, job.tokenizer,
                     args.teacher_chunk, job.prefill_chunk, args.teacher_softmax, job.stored_dtype,
                     job.rank, job.world, args.quiet)
    if job.world > 1:
        dist.barrier()  # every rank's shards are written before rank 0 trains
        dist.destroy_process_group()
        if job.rank != 0:
            return None
    print(f"features ready ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.steps == 0:
        return None
    if job.mix is None:
        return FeatureStore(job.out, job.manifest)
    # --mix-features: its training documents join this run's, after them (this run's documents
    # keep their places in the store); its held-out ones stay out (mix_held_out)
    extra = features.mix_documents(args.mix_features, job.mix, "train")
    store = FeatureStore(job.out, dict(job.manifest, documents=job.manifest["documents"] + extra))
    n_mix = sum(d["tokens"] for d in extra)
    n_train = sum(d["tokens"] for d in job.manifest["documents"] if d["split"] == "train")
    print(f"--mix-features: {len(extra)} training documents, {n_mix} tokens ("
          f"{100 * n_mix / (n_mix + n_train):.0f}% of the training tokens) from "
          f"{args.mix_features}", file=sys.stderr)
    return store


def mix_held_out(args, job):
    """--mix-features: its held-out documents as (store, documents) for
    train_gate.agreement_with_teacher, reported beside this run's own; None without the flag or
    without a held-out document. The digits and identifiers need the token ids: the shard's own, or
    read back from the document's file (features.read_back); a document with neither counts no
    digit or identifier token."""
    if job.mix is None:
        return None
    val = [d for d in job.mix["documents"] if d["split"] == "val"]
    if not val:
        return None
    store = FeatureStore(args.mix_features, dict(job.mix, documents=val))
    documents = []
    for j, d in enumerate(val):
        ids = store.ids(j)
        documents.append((j, ids if ids is not None else features.read_back(d, job.tokenizer)))
    unknown = sum(ids is None for _, ids in documents)
    if unknown:
        print(f"note: {unknown} of the {len(val)} held-out documents of --mix-features hold no "
              f"token ids and cannot be read back from their files (moved or changed): their "
              f"digit and identifier tokens are not counted", file=sys.stderr)
    return store, documents


def eval_folders(folders, model_name, cfg, flag="--eval-features"):
    """--eval-features (or another `flag` naming features folders), checked before any work: each
    folder must hold features of this model that train_gate.py wrote (its manifest.json and every
    shard; --steps 0 writes only these) -> [(name, folder, manifest)]; the folder's name keys its
    agreement in metrics.json."""
    out = []
    for folder in folders:
        path = Path(folder)
        fix = (f"write one with train_gate.py --model {model_name} --data ... --steps 0 --out DIR "
               f"and pass {flag} DIR")
        try:
            m = json.loads((path / "manifest.json").read_text("utf-8"))
        except (OSError, ValueError) as e:
            why = getattr(e, "strerror", None) or type(e).__name__
            raise UsageError(f"{flag} {folder} is not a features folder (manifest.json: "
                             f"{why}); {fix}") from None
        ours = dict(model=model_name, compressed_layers=list(cfg.compressed_layers),
                    n_kv_heads=cfg.num_key_value_heads, hidden_size=cfg.hidden_size)
        if not (isinstance(m, dict) and isinstance(m.get("documents"), list)
                and ours.keys() <= m.keys()):
            raise UsageError(f"{flag} {folder}: its manifest.json is not one "
                             f"train_gate.py wrote; {fix}")
        differ = [k for k, v in ours.items() if m[k] != v]
        if differ:
            raise UsageError(f"{flag} {folder} holds features of model {m['model']}, not "
                             f"of {model_name} ({', '.join(differ)} differ); {fix}")
        missing = [d["shard"] for d in m["documents"] if not (path / d["shard"]).is_file()]
        if missing:
            raise UsageError(f"{flag} {folder}: {len(missing)} of {len(m['documents'])} "
                             f"feature shards are missing ({missing[0]}); rerun the train_gate.py "
                             f"--steps 0 command that wrote it to finish them")
        name = path.resolve().name
        if name in [n for n, _, _ in out]:
            raise UsageError(f"{flag}: two folders are named {name}, which names each "
                             f"one's report in metrics.json; rename one")
        out.append((name, str(folder), m))
    return out


def eval_stores(job):
    """Each --eval-features folder as (name, folder, FeatureStore, documents), documents =
    [(index, token ids)] of all its documents, for train_gate.agreement_with_teacher (one store at
    a time)."""
    for name, folder, manifest in job.eval_sets:
        store = FeatureStore(folder, manifest)
        documents = [(i, store.ids(i)) for i in range(len(manifest["documents"]))]
        unknown = sum(ids is None for _, ids in documents)
        if unknown:
            print(f"note: --eval-features {folder}: {unknown} of {len(documents)} shards hold no "
                  f"token ids (written by an older version): their digit and identifier tokens "
                  f"are not counted", file=sys.stderr)
        yield name, folder, store, documents


def check_split(args, store, n_train, n_val, val_every):
    """Enough training tokens for one batch, and at least one validation token."""
    if n_train < args.batch_tokens:
        dropped = (" (--final-chunk drop leaves out each document's last teacher chunk shorter "
                   "than --teacher-chunk)" if args.final_chunk == "drop" else "")
        raise UsageError(f"only {n_train} training tokens{dropped} for --batch-tokens "
                         f"{args.batch_tokens}; add data (--tokens) or lower it")
    if n_val == 0:
        raise UsageError(f"only {store.n_tokens} tokens: need at least {val_every} for "
                         f"one validation token; raise --tokens")


def save(args, job, store, docs, gates, metrics, agreement, settings):
    """Step 3's outputs: gate.safetensors (with a training summary: the recipe's settings and
    what it trained on), the authors' layout with --export-pt, metrics.json, the per-layer tables,
    curves.png with --plot, and one line."""
    metrics["n_val_docs"] = sum(d["split"] == "val" for d in job.manifest["documents"])
    metrics["agreement"] = agreement
    metrics["command"] = " ".join(sys.argv)
    mix = {} if job.mix is None else dict(mix_features=mix_record(args.mix_features, job.mix),
                                          mix_agreement=metrics.get("mix_agreement"))
    metrics.update(mix)
    means = lambda a: a and a["all"]
    summary = dict(command=metrics["command"], data=args.data, data_sha256=job.data_hash,
                   documents=len(docs), tokens=store.n_tokens, steps=args.steps,
                   batch_tokens=args.batch_tokens, seed=args.seed, recipe_name=args.recipe,
                   **settings,
                   **({"selected_step": metrics["selected_step"]} if "selected_step" in metrics
                      else {}),
                   val_loss=metrics["val_loss"][-1], val_acc=metrics["val_acc"][-1],
                   const_val_loss=metrics["const_val_loss"], teacher=job.manifest["teacher"],
                   val_docs=metrics["n_val_docs"],
                   # the agreements' means only (all layers pooled); per layer and head in
                   # metrics.json
                   agreement=means(agreement),
                   **({"eval_agreement": {name: means(e["agreement"])
                                          for name, e in metrics["eval_agreement"].items()}}
                      if metrics.get("eval_agreement") else {}),
                   **({} if not mix else dict(mix_features=mix["mix_features"],
                                              mix_agreement=means(mix["mix_agreement"]))))
    out = job.out
    gate_path = Path(out) / "gate.safetensors"
    save_gate(str(gate_path), gates, dict(model=job.model_name, layers=metrics["layers"],
                                          training=summary))
    if args.export_pt:  # the authors' layout, for their code and kvpress (METHOD.md §2)
        save_gate(str(Path(out) / authors_file_name(gates)), gates,
                  curves=(metrics["val_loss"], metrics["val_acc"]))
    write_json(Path(out) / "metrics.json", metrics, indent=1)
    print(summary_table(metrics))
    if "ceiling_val_spearman" in metrics:
        print(ceiling_table(metrics))
    if mix:
        print(mix_line(metrics))
    if args.plot:
        plot_curves(metrics, Path(out) / "curves.png")
    L = len(metrics["layers"])
    print(f"trained {args.steps} steps on {store.n_tokens} tokens in {metrics['seconds']:.0f} s "
          f"({metrics['steps_per_s']:.1f} steps/s); val BCE {sum(metrics['val_loss'][-1]) / L:.4f} "
          f"(constant {sum(metrics['const_val_loss']) / L:.4f}); gate -> {gate_path}")


def init_distributed():
    """torchrun sets WORLD_SIZE/RANK -> (rank, world). The processes only meet at a barrier after
    the feature step, so the gloo backend serves CPU and GPU alike; the long timeout covers uneven
    document lengths."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=24))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), world


def auto_layer_groups(store, share=MEMORY_SHARE):
    """--layer-groups 0: the fewest layer groups whose features each fit in `share` of this
    machine's memory (train_gate.train caps it at one layer per group)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return math.ceil(store.nbytes / (share * memory))


GATE_RUN = "a train_gate.py run"  # what --out must hold if it holds anything (cli.claim_folder)


def is_gate_run(folder):
    """Whether `folder` is one train_gate.py wrote, which a run may resume or replace: its
    manifest.json (the features) or its metrics.json (a gate trained) is train_gate.py's."""
    def read(name):
        try:
            obj = json.loads((Path(folder) / name).read_text("utf-8"))
        except (OSError, ValueError):
            return {}
        return obj if isinstance(obj, dict) else {}
    manifest, metrics = read("manifest.json"), read("metrics.json")
    return ({"format", "teacher", "documents"} <= manifest.keys()
            or {"command", "layers", "val_loss"} <= metrics.keys())


def check_out(out, rank=0):
    """--out must be a folder we can write into, or create: checked before hours of work go into
    it, without creating it (make_out does, once the input is accepted). Rank 0 claims it for the
    run (cli.claim_folder: a folder of other files, or one another run holds, is refused); the
    other ranks of a torchrun share it."""
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
    if rank == 0:
        cli.claim_folder(out, "--out", is_gate_run, GATE_RUN)


def make_out(out, rank=0):
    if rank == 0:
        cli.claim_folder(out, "--out", is_gate_run, GATE_RUN, create=True)
        return
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


def parse_args(argv, recipes, parts):
    """The flags of argv, checked; recipes: train_gate.RECIPES (--recipe), parts: what each part of
    a recipe may be named (train_gate.PARTS: --optimizer, --loss, --select)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model(p)
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
    p.add_argument("--mix-features", metavar="DIR", help="the features of another corpus (made "
                   "by train_gate.py --steps 0 --data TEXT --out DIR with this run's model and "
                   "teacher flags, e.g. the numeric text of offline/numeric_text.py): its training "
                   "documents join this run's training tokens, its held-out documents are reported "
                   "on their own (mix_agreement); this run's held-out documents stay its "
                   "validation, so runs with and without it on the same features and --seed are "
                   "an ablation")
    p.add_argument("--out", help="folder for features, gate and metrics (default ./out/<model>): "
                   "a new or empty folder, or one train_gate.py wrote (resumed); one run at a time")
    p.add_argument("--steps", type=int, default=5000,
                   help="optimiser steps (0 = compute features only)")
    p.add_argument("--batch-tokens", type=int, default=1000,
                   help="tokens per step, shared by all layers")
    cli.add_seed(p, "the gate init and the batch order")
    p.add_argument("--recipe", choices=sorted(recipes), default=DEFAULT_RECIPE, help="the training "
                   "recipe whose settings the next ten flags default to: paper (default) = the "
                   "paper's (SGD momentum 0.9, lr 0.2, the authors' schedule, BCE, the last step; "
                   "METHOD.md §5.3-5.4); adam-logmse = Adam lr 3e-3 on the MSE of log scores, the "
                   "same schedule (METHOD.md §13.14)")
    p.add_argument("--optimizer", choices=parts["optimizer"],
                   help="sgd (momentum 0.9) or adam (AdamW with --weight-decay)")
    p.add_argument("--lr", type=float, help="base learning rate")
    p.add_argument("--schedule", choices=("step", "cosine"), help="step: the authors' piecewise "
                   "schedule; cosine: 1%% warm-up, then cosine to 0")
    p.add_argument("--weight-decay", type=float, help="decoupled weight decay (adam only)")
    p.add_argument("--loss", choices=parts["loss"], help="bce: the paper's (METHOD.md §5.3); "
                   "rank: BCE plus a pairwise ranking term within each layer and head (see "
                   "rank_per_layer); logmse: MSE of log scores, as KVzap (see logmse_per_layer)")
    p.add_argument("--select", choices=parts["select"], help="last: the gates after the "
                   "last step; spearman / overlap: per layer, the gates of the validation step "
                   "(every 50) with the best held-out rank correlation with the teacher / share "
                   "of the pairs the teacher keeps at budget 0.2 among each head's top-k at the "
                   "teacher's count there (topk_overlap@0.2; train_gate.overlap_per_layer)")
    p.add_argument("--keep-term", type=float, metavar="W", help="add W times a logistic loss on "
                   "which side of the teacher's cut each pair's gate score falls, at budgets "
                   "0.1-0.5 by the cache's rule, one threshold per document over all layers "
                   "(train_gate.keep_drop_per_layer; default 0: off)")
    p.add_argument("--cut-pairs", type=float, metavar="W", help="add W times a ranking term over "
                   "pairs of one document, layer and head, one kept and one dropped by the "
                   "teacher's cut at a budget of 0.1-0.5 (train_gate.CutPairs; default 0: off)")
    p.add_argument("--final-chunk", choices=("keep", "drop"), help="drop: no training target in a "
                   "document's last teacher chunk when it is shorter than --teacher-chunk (its "
                   "scores come out inflated); keep (default): train on every token")
    p.add_argument("--clip", type=float, metavar="NORM", help="clip each layer's gradient norm to "
                   "NORM (per layer: the layers train on their own; default 0: off)")
    p.add_argument("--calibrate-heads", action="store_true", default=None, help="after training, "
                   "give each KV head an offset at the prefill's cut so that the cut keeps the "
                   "teacher's share of each head on the training documents at budgets 0.2 and 0.3; "
                   "the gate's scores, and decoding, stay as trained (teacher.calibrate_heads; "
                   "ours, not the paper's; default off; the gate must be saved as .safetensors)")
    p.add_argument("--ridge-ceiling", action="store_true", help="also report, per layer, a ridge "
                   "regression of the log teacher score on the gate's input (fit on the training "
                   "tokens) beside the gate on the held-out tokens: Spearman and overlap at 0.2. "
                   "A report: the gate is unchanged")
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
                   "are the same); 0: as few as fit in "
                   f"{MEMORY_SHARE * 100:.0f}%% of this machine's memory")
    cli.add_threads(p, default=None, note="On small or shared CPUs 1 is often much faster: the "
                    "gate's small ops pay for every thread hand-off")
    p.add_argument("--export-pt", action="store_true", help="also write the gate in the authors' "
                   "layout, --out/q{G}_dim16_sink16.pt, which their code and kvpress's "
                   "FastKVzipPress load (METHOD.md §2)")
    p.add_argument("--eval-features", action="append", default=[], metavar="DIR",
                   help="also report the trained gate's agreement with its teacher on every "
                   "document of DIR, a features folder of the same model (written by train_gate.py "
                   "--steps 0 --out DIR), under DIR's name in metrics.json; may be repeated")
    p.add_argument("--plot", action="store_true", help="also write curves.png (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or step log")
    args = p.parse_args(argv)
    for flag in ("tokens", "min_doc_tokens", "max_doc_tokens", "batch_tokens", "teacher_chunk",
                 "prefill_chunk", "lr"):
        value = getattr(args, flag)
        if value is not None and not (0 < value < math.inf):  # also refuses nan
            p.error(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
    for flag in ("keep_term", "cut_pairs", "clip"):
        value = getattr(args, flag)
        if value is not None and not (0 <= value < math.inf):
            p.error(f"--{flag.replace('_', '-')} must be a number >= 0, got {value}")
    if args.weight_decay is not None and not 0 <= args.weight_decay < 1:
        p.error(f"--weight-decay must be in [0, 1), got {args.weight_decay}")
    if args.weight_decay and (args.optimizer or recipes[args.recipe].optimizer) == "sgd":
        p.error("--weight-decay applies to --optimizer adam (the paper's SGD takes none)")
    if args.mix_features and args.steps == 0:
        p.error("--mix-features joins features at training: it needs --steps > 0")
    if args.steps < 0 or args.long_doc_tokens < 0 or args.layer_groups < 0:
        p.error("--steps, --long-doc-tokens and --layer-groups must be >= 0")
    if args.export_pt and (args.calibrate_heads or recipes[args.recipe].calibrate_heads):
        p.error("--export-pt writes the authors' layout, which has no place for the cut offsets "
                "of --calibrate-heads (METHOD.md §13.17): drop one of the two")
    if args.eval_features and args.steps == 0:
        p.error("--eval-features evaluates the trained gate: it needs --steps above 0")
    if not 0 <= args.val_docs <= 0.5:
        p.error(f"--val-docs must be in [0, 0.5], got {args.val_docs}")
    if args.min_doc_tokens >= args.max_doc_tokens:
        p.error("--min-doc-tokens must be below --max-doc-tokens")
    if 0 < args.long_doc_tokens <= args.min_doc_tokens:  # one document would fill a "long" sample
        p.error(f"--long-doc-tokens {args.long_doc_tokens} is not above --min-doc-tokens "
                f"{args.min_doc_tokens}: every concatenation would be one document, repeating the "
                f"single-document half; raise it, or pass 0 for single documents only")
    return args


def main(argv, run, recipes, parts):
    """run(args) (train_gate.main's steps) with the flags of argv (parse_args); bad input as one
    line, exit 2; a stopped run says what it kept."""
    args = parse_args(argv, recipes, parts)
    cli.main(run, args, ModelError, ArgumentError,
             kept=lambda a: kept(names(a.model, a.out)[1], a.steps))
