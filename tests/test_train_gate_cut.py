"""train_gate.py's training aimed at the cache's cut (METHOD.md §13.15): each option against a naive
computation of what it says (the short final chunk, the teacher's cuts and their thresholds, the
keep/drop and cut-pair terms, the pairs themselves, the per-layer overlap and its selection,
clipping, the ridge ceiling), the options together under layer groups, the flags, and the named
recipes trained bit for bit as the plain loop they were before the options."""
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_teacher import tiny_model_folder
from test_train_gate import SMALL, run_main, sharpen, write_docs

import teacher as T
import train_gate as TG
from cache import plan_prefill
from commands import features
from commands import train_gate as cmd
from formats.gate_file import gate_metadata
from gate import Gates

CPU = torch.device("cpu")
CFG = SimpleNamespace(compressed_layers=[0, 2, 4], hidden_size=16, num_key_value_heads=2,
                      group_size=2)
CUTS = dict(keep_term=1.0, cut_pairs=1.0, final_chunk="drop", clip=0.5)


def make_store(tmp_path, docs=((900, "train"), (400, "val"), (1100, "train"), (300, "val")),
               chunk=128, seed=7, half=False):
    """Random features of len(docs) documents, (length, split) each, 3 layers of 2 heads; scores
    of a skewed distribution, as the teacher's (most pairs small)."""
    torch.manual_seed(seed)
    entries = []
    for i, (n, split) in enumerate(docs):
        x = torch.randn(3, n, 16)
        features.write_shard(features.shard_path(tmp_path, i), x.half() if half else x,
                             torch.rand(3, 2, n) ** 4, {})
        entries.append(dict(shard=features.shard_path("", i).as_posix(), split=split))
    manifest = dict(documents=entries, dtype="float32", teacher=dict(chunk=chunk))
    return features.FeatureStore(tmp_path, manifest)


def run(store, recipe, steps=60, groups=1, ceiling=None, seed=3):
    return TG.train(store, CFG, CPU, steps=steps, batch_tokens=100, seed=seed, log=lambda s: None,
                    recipe=recipe, groups=groups, ceiling=ceiling)


# -------------------------------------------------------------------------------------------------
# the targets

def test_short_final_chunk_is_each_documents_short_tail(tmp_path):
    """Positions from the last multiple of the chunk on, in documents whose length is not one; the
    store reads the chunk from its manifest; split(drop_final) trains on none of them."""
    lengths = torch.tensor([5, 8, 3, 12, 9])
    want = []
    for n in lengths.tolist():
        full = (n // 4) * 4
        want += [n % 4 != 0 and p >= full for p in range(n)]
    assert TG.short_final_chunk(lengths, 4).tolist() == want
    store = make_store(tmp_path, docs=((300, "train"), (256, "train"), (200, "val")))
    assert store.teacher_chunk == 128 and store.lengths.tolist() == [300, 256, 200]
    keep, _ = TG.split(store)
    drop, val = TG.split(store, drop_final=True)
    assert set(keep.tolist()) - set(drop.tolist()) == set(range(256, 300))  # 300 = 2·128 + 44
    assert val.tolist() == list(range(556, 756))  # the held-out document: all its tokens


def naive_cut(scores, ratio):
    """The global cut of one document written out: the cache's window (cache.plan_prefill, at
    kept_by_rule's defaults), then the top ⌊r'·L·H·s⌋ of all pairs before it, ties to the earlier
    (layer, head, position) -> (kept set of (l, h, p), segment length, log threshold or None)."""
    L, H, n = scores.shape
    plan = plan_prefill(n, ratio, 16384, 4096)
    s = n - plan.window
    pairs = sorted(((float(scores[l, h, p]), -(l * H * s + h * s + p), (l, h, p))
                    for l in range(L) for h in range(H) for p in range(s)), reverse=True)
    k = int(plan.segment_ratio * L * H * s)
    if k in (0, L * H * s):
        return set(), s, None
    log = lambda x: math.log(max(x, TG.LOG_FLOOR))
    return {q for _, _, q in pairs[:k]}, s, (log(pairs[k - 1][0]) + log(pairs[k][0])) / 2


@pytest.mark.parametrize("drop", [False, True], ids=["whole", "drop-final"])
def test_cut_targets_are_a_naive_global_cut(tmp_path, drop):
    """Labels: what a global top-k over all layers and heads keeps at each budget, outside the
    window; thresholds: the log-space midpoint between the weakest kept and the strongest dropped
    pair, one per document and budget, shared by every layer; held-out documents get none. With
    drop_final the document is cut before its short final chunk first."""
    store = make_store(tmp_path, docs=((300, "train"), (150, "val"), (420, "train")), chunk=128)
    train_idx, _ = TG.split(store, drop)
    cut = TG.cut_targets(store, drop, train_idx)
    assert cut.kept.shape == store.scores.shape and cut.is_train.nonzero().squeeze(1).equal(
        train_idx)
    assert cut.decided[:, 1].eq(0).all() and cut.kept[:, :, 300:450].eq(0).all()
    for d, (start, n) in ((0, (0, 300)), (2, (450, 420))):
        m = n - n % 128 if drop else n
        for r, ratio in enumerate(TG.CUT_BUDGETS):
            kept, s, tau = naive_cut(store.scores[:, :, start:start + m], ratio)
            bits = (cut.kept[:, :, start:start + n] >> r) & 1
            got = {tuple(q) for q in bits.nonzero().tolist()}
            assert got == kept, (d, ratio)
            assert int(cut.decided[r, d]) == (s if tau is not None else 0)
            if tau is not None:
                assert float(cut.log_tau[r, d]) == pytest.approx(tau, abs=1e-6)
                seg = torch.log(store.scores[:, :, start:start + s].clamp_min(TG.LOG_FLOOR))
                on = bits[..., :s].bool()
                assert (seg[on] > cut.log_tau[r, d]).all() and (seg[~on] < cut.log_tau[r, d]).all()


def test_keep_drop_term_is_its_literal_formula():
    """keep_drop_per_layer against softplus(−y·(log p − log τ_r)) written out pair by pair: mean
    over (budget, decided token), sum over heads."""
    torch.manual_seed(2)
    L, H, B, R = 2, 3, 6, len(TG.CUT_BUDGETS)
    pred = torch.rand(L, H, B) * 0.9 + 0.01
    pred[0, 0, 0] = 0.0  # floored at LOG_FLOOR: finite
    kept = torch.randint(0, 2 ** R, (L, H, B), dtype=torch.uint8)
    log_tau = torch.randn(R, B) - 2
    decided = torch.rand(R, B) > 0.3
    want = torch.zeros(L, dtype=torch.float64)
    for l in range(L):
        for h in range(H):
            for r in range(R):
                for b in range(B):
                    if decided[r, b]:
                        y = 1 if int(kept[l, h, b]) >> r & 1 else -1
                        lp = math.log(max(float(pred[l, h, b]), TG.LOG_FLOOR))
                        want[l] += math.log1p(math.exp(-y * (lp - float(log_tau[r, b]))))
    want /= int(decided.sum())
    got = TG.keep_drop_per_layer(pred, kept, log_tau, decided.float())
    assert torch.isfinite(got).all() and torch.allclose(got.double(), want, rtol=1e-5), (got, want)


def test_cut_pairs_straddle_the_cut(tmp_path):
    """Every valid pair: two training tokens of one document inside its cut's segment, in the same
    layer and head, the first kept and the second dropped at one budget; most draws valid; a layer
    group draws the very rows of the joint draw; the pair term is rank_per_layer's RankNet over
    those pairs, times the heads."""
    store = make_store(tmp_path, docs=((700, "train"), (200, "val"), (500, "train")))
    store.is_val_doc[:] = False  # --val-docs 0: every 100th token is held out inside the documents
    train_idx, _ = TG.split(store, True)
    cut = TG.cut_targets(store, True, train_idx)
    pairs = TG.CutPairs(cut, store.scores, 400, seed=1)
    tok, head, valid = pairs.draw()
    L, P = valid.shape
    assert tok.shape == head.shape == (3, 2 * P) and head[:, :P].equal(head[:, P:])
    assert valid.float().mean() > 0.9
    doc = lambda t: int(torch.searchsorted(store.starts, t, right=True)) - 1
    for li in range(L):
        for p in valid[li].nonzero().squeeze(1).tolist():
            i, j, h = int(tok[li, p]), int(tok[li, P + p]), int(head[li, p])
            d = doc(i)
            assert d == doc(j) and cut.is_train[i] and cut.is_train[j]
            s = int(store.starts[d])
            straddle = [r for r in range(len(TG.CUT_BUDGETS))
                        if max(i, j) - s < int(cut.decided[r, d])
                        and int(cut.kept[li, h, i]) >> r & 1 and not int(cut.kept[li, h, j]) >> r & 1]
            assert straddle, (li, p, i, j, h)
    part = slice(1, 3)
    sub = TG.CutPairs(cut.layers(part), store.scores[part], 400, seed=1).draw()
    assert all(a.equal(b[part]) for a, b in zip(sub, (tok, head, valid)))
    # the term: RankNet on the pairs in their heads, over the valid ones
    pred = torch.rand(L, 2 * P) * 0.9 + 0.05
    t = store.scores[torch.arange(L)[:, None], head, tok]
    got = TG.cut_pair_per_layer(pred, t, valid, 2)
    for li in range(L):
        num = den = 0.0
        for p in valid[li].nonzero().squeeze(1).tolist():
            z = [math.log(float(pred[li, q]) / (1 - float(pred[li, q]))) for q in (p, P + p)]
            ti, tj = float(t[li, p]), float(t[li, P + p])
            num += abs(ti - tj) * math.log1p(math.exp(-((ti > tj) - (ti < tj)) * (z[0] - z[1])))
            den += abs(ti - tj)
        assert float(got[li]) == pytest.approx(2 * num / den, rel=1e-5)


# -------------------------------------------------------------------------------------------------
# selection, clipping, the ceiling

def test_overlap_per_layer_is_a_naive_top_k_and_the_reports():
    """Per layer: of the teacher's kept pairs outside the window (the global cut at 0.2), the share
    among each head's top k by the prediction, k = the teacher's count in that head, pooled over the
    segments: a naive count, and the held-out report's topk_overlap@0.2 (teacher.agreement pooled)."""
    from teacher import agreement, pool_agreement
    torch.manual_seed(4)
    y, pred = torch.rand(3, 2, 500) ** 4, torch.rand(3, 2, 500)
    pred[1] = y[1] + 0.01 * torch.rand(2, 500)  # layer 1 close to its teacher
    segments = [(0, 200), (200, 500)]
    kept = TG.teacher_kept(y, segments)
    got = TG.overlap_per_layer(pred, kept, segments)
    for li in range(3):
        both = total = 0
        for (a, b), (keep, w) in zip(segments, kept):
            n = b - a - w
            for h in range(2):
                teacher = {p for p in range(n) if keep[li, h, p]}
                order = sorted(((float(pred[li, h, a + p]), -p) for p in range(n)), reverse=True)
                top = {-q for _, q in order[:len(teacher)]}
                both, total = both + len(top & teacher), total + len(teacher)
        assert got[li] == pytest.approx(both / total, abs=1e-12)
    assert got[1] > 0.8 > max(got[0], got[2])
    pooled = pool_agreement([agreement(pred[:, :, a:b], y[:, :, a:b], torch.zeros(b - a).bool(),
                                       budgets=(TG.SELECT_BUDGET,)) for a, b in segments],
                            budgets=(TG.SELECT_BUDGET,))
    assert got == pytest.approx(pooled[f"topk_overlap@{TG.SELECT_BUDGET}"], abs=1e-12)


def test_select_overlap_keeps_each_layers_best(tmp_path):
    """--select overlap: per layer, the parameters of the validation step whose held-out overlap
    at 0.2 was best; the returned gates score exactly that overlap again; the training itself is
    --select last's."""
    store = make_store(tmp_path)
    recipe = TG.Recipe(optimizer="adam", lr=0.01, schedule="cosine")
    last, m_last = run(store, recipe, steps=301)
    best, m = run(store, replace(recipe, select="overlap"), steps=301)
    assert m["val_spearman"] == m_last["val_spearman"]
    per_layer = list(zip(*m["val_overlap"]))
    assert m["selected_val_overlap"] == [max(r) for r in per_layer]
    assert m["selected_step"] == [m["step"][r.index(max(r))] for r in per_layer]
    assert m["selected_step"] != [300] * 3  # some layer peaked before the end
    val_idx = store.is_val_doc.nonzero().squeeze(1)
    segments = TG.val_segments(store, val_idx)
    x, y = store.load_layers(slice(None))[:, val_idx], store.scores[:, :, val_idx]
    kept = TG.teacher_kept(y, segments)
    assert TG.evaluate(best, x, y, segments, CPU, kept=kept)[3] == m["selected_val_overlap"]


def test_clip_per_layer_bounds_each_layers_norm():
    """Each layer's gradient over all parameters scaled to norm <= NORM, layers under it untouched:
    torch.nn.utils.clip_grad_norm_ applied to each layer's rows alone."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(3, 4, 5)), torch.nn.Parameter(torch.zeros(3, 7))]
    grads = [torch.randn(3, 4, 5), torch.randn(3, 7)]
    for g in grads:
        g[0] *= 10  # layer 0 far above the bound, layer 1 near it, layer 2 below
        g[2] *= 0.01
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norms = TG.clip_per_layer(params, 2.0)
    for li in range(3):
        ref = [torch.nn.Parameter(g[li].clone()) for g in grads]
        for r, g in zip(ref, grads):
            r.grad = g[li].clone()
        before = torch.nn.utils.clip_grad_norm_(ref, 2.0)
        assert float(norms[li]) == pytest.approx(float(before), rel=1e-6)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad[li], r.grad, rtol=1e-6, atol=0)
        after = math.sqrt(sum(float(p.grad[li].norm()) ** 2 for p in params))
        assert after <= 2.0 * (1 + 1e-5) and (float(before) > 2.0 or after == pytest.approx(
            float(before)))
    assert float(norms[0]) > 2.0 > float(norms[2])


def test_ridge_ceiling_is_lstsq_with_an_unpenalised_intercept():
    """ridge_ceiling against torch.linalg.lstsq on [X 1; √λ·I 0] w = [log y; 0] (the ridge with a
    free intercept), λ = RIDGE_LAMBDA · trace of the centred XᵀX / D, per layer for all heads, over
    blocks smaller than the training set."""
    torch.manual_seed(3)
    L, H, N, D = 2, 3, 400, 5
    hidden = torch.randn(L, N, D) * 3 + 1
    scores = torch.rand(L, H, N) ** 3
    scores[0, 0, :5] = 0.0  # floored
    train_idx, val_idx = torch.arange(0, 300), torch.arange(300, 400)
    got = cmd.ridge_ceiling(hidden, scores, train_idx, val_idx, torch.float32, CPU, block=64)
    assert got.shape == (L, H, 100) and got.dtype == torch.float64
    for li in range(L):
        x = hidden[li, train_idx].double()
        xc = x - x.mean(0)
        lam = cmd.RIDGE_LAMBDA * float((xc * xc).sum()) / D
        a = torch.cat([torch.cat([x, torch.ones(300, 1, dtype=torch.float64)], 1),
                       torch.cat([math.sqrt(lam) * torch.eye(D, dtype=torch.float64),
                                  torch.zeros(D, 1, dtype=torch.float64)], 1)])
        y = torch.log(scores[li, :, train_idx].double().clamp_min(1e-6)).T
        b = torch.cat([y, torch.zeros(D, H, dtype=torch.float64)])
        w = torch.linalg.lstsq(a, b).solution                                  # (D+1, H)
        xv = torch.cat([hidden[li, val_idx].double(), torch.ones(100, 1, dtype=torch.float64)], 1)
        torch.testing.assert_close(got[li], (xv @ w).T, rtol=1e-9, atol=1e-9)


# -------------------------------------------------------------------------------------------------
# the options together, and the recipes without them

def test_cut_margins_are_naive_global_cuts(tmp_path):
    """Per head, the pairs each document's global cut keeps outside its window, summed over the
    documents asked for; their number; and every such pair's logit distance to its document's
    weakest kept pair, >= 0 exactly where the pair is kept."""
    store = make_store(tmp_path, docs=((300, "train"), (150, "val"), (420, "train")))
    starts, lengths = store.starts, store.lengths
    logit = lambda p: math.log(max(p, 1e-12) / (1 - p))  # floored as cut_margins
    for ratio in (0.2, 0.3):
        kept, total, margins = torch.zeros(3, 2), 0, []
        for start, n in ((0, 300), (450, 420)):
            got, s, _ = naive_cut(store.scores[:, :, start:start + n], ratio)
            tau = min(float(store.scores[l, h, start + p]) for l, h, p in got)
            m = torch.tensor([[[logit(float(store.scores[l, h, start + p])) - logit(tau)
                                for p in range(s)] for h in range(2)] for l in range(3)])
            assert {tuple(q) for q in (m >= 0).nonzero().tolist()} == got
            for q in got:
                kept[q[:2]] += 1
            total, margins = total + s, margins + [m]
        k, n, m = T.cut_margins(store.scores, starts, lengths, [0, 2], ratio)
        assert k.tolist() == kept.tolist() and n == total
        torch.testing.assert_close(m, torch.cat(margins, -1).double(), rtol=0, atol=1e-6)


def test_calibrate_heads_gives_each_head_the_teachers_share(tmp_path):
    """A gate whose heads sit exp(c) below or above its teacher (the teacher: the gate's own scores
    scaled per head, G = 1): the cut offsets bring the heads' kept shares to the teacher's at both
    budgets, near -c; the gate's parameters and scores are untouched, the order inside every head
    at the cut stays the gate's, and each step is logged."""
    store = make_store(tmp_path, docs=((900, "train"), (400, "val"), (1100, "train")))
    torch.manual_seed(0)
    gates = Gates(3, 16, 2, 1)
    with torch.no_grad():
        gates.b -= 4  # small scores: sigmoid(z) ≈ exp(z)
        c = torch.tensor([[1.5, -1.0], [0.0, 2.0], [-1.5, 0.5]])
        x = store.load_layers(slice(None))
        before = torch.stack([gates.score_layer(li, x[li]) for li in range(3)])
        store.scores = before * c.exp()[..., None]
    params = {k: p.clone() for k, p in gates.named_parameters()}
    logged = []
    rows = T.calibrate_heads(gates, store, CPU, log=logged.append)
    assert len(rows) == len(logged) - 1 == T.CALIBRATE_ITERS + 1
    (kept,) = [row for row in rows if row["kept"]]
    assert kept["step"] > 0 and f"kept step {kept['step']}" in logged[-1]
    for r in T.CALIBRATE_BUDGETS:
        assert rows[0][f"train@{r:g}"] > 0.02 and rows[0][f"val@{r:g}"] > 0.02, rows[0]
        assert kept[f"train@{r:g}"] < rows[0][f"train@{r:g}"] / 5, rows
        assert kept[f"val@{r:g}"] < rows[0][f"val@{r:g}"] / 5, rows
    for k, p in gates.named_parameters():
        assert torch.equal(p, params[k]), k
    with torch.no_grad():
        assert torch.equal(torch.stack([gates.score_layer(li, x[li]) for li in range(3)]), before)
    # the offsets undo the teacher's scaling, up to a constant the global cut cannot see
    o = gates.cut_offset - gates.cut_offset.mean()
    torch.testing.assert_close(o, c - c.mean(), rtol=0, atol=0.3)
    after = gates.cut_scores(before)
    assert (after.gather(-1, before.argsort(-1)).diff(dim=-1) >= 0).all()  # monotone in each head


def test_the_options_together_train_the_gates_of_one_joint_run(tmp_path):
    """Every option on, a ridge ceiling beside: layer groups give the gates and metrics of one
    joint run (the pairs are drawn for all layers, clipping and both terms are per layer); each
    option logs its numbers; the options change the gate."""
    store = make_store(tmp_path, half=True)
    recipe = TG.Recipe(optimizer="adam", lr=3e-3, select="overlap", **CUTS)
    (one, m1), (three, m3) = (run(store, recipe, groups=g, ceiling=cmd.ridge_ceiling)
                              for g in (1, 3))
    for (name, p), q in zip(one.named_parameters(), three.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=name)
    for k in ("train_keep_loss", "train_cut_pair_loss", "train_grad_norm", "val_overlap"):
        assert len(m1[k]) == len(m1["step"]) and len(m1[k][-1]) == 3, k
        torch.testing.assert_close(torch.tensor(m3[k]), torch.tensor(m1[k]), rtol=1e-4, atol=1e-5)
    for k in ("ceiling_val_spearman", "ceiling_val_overlap"):  # the ridge fit, of the features alone
        assert len(m1[k]) == 3 and m1[k] == pytest.approx(m3[k], abs=1e-6), k
    # the two gates agree to 1e-5 (above), and a near-tie of their scores that goes the other way
    # moves a Spearman by ~1e-5 (8e-6 seen on an AMD EPYC): ranks flip with the summation order
    assert len(m1["gate_val_spearman"]) == 3
    assert m1["gate_val_spearman"] == pytest.approx(m3["gate_val_spearman"], abs=1e-4)
    assert m1["n_train"] < sum(n for n, s in ((900, "train"), (1100, "train")))  # final chunks
    assert max(max(row) for row in m1["train_grad_norm"]) > CUTS["clip"]  # clipping did act
    plain, _ = run(store, TG.Recipe(optimizer="adam", lr=3e-3))
    assert not any(torch.equal(a, b) for a, b in zip(plain.parameters(), one.parameters()))
    print(cmd.ceiling_table(dict(m1, layers=CFG.compressed_layers)))


def reference_train(store, steps, B, seed, optimizer, lr, loss):
    """The training loop before the cut's options, written plainly from its parts: one group, the
    seed's init, a fresh permutation of the training tokens every ⌊n/B⌋ steps, the loss summed over
    layers, the authors' schedule, the optimiser's step."""
    train_idx = (~store.is_val_doc).nonzero().squeeze(1)
    torch.manual_seed(seed)
    gates = Gates(3, 16, 2, 2, dtype=store.dtype)
    hidden, params = store.load_layers(slice(None)), list(gates.parameters())
    state, n_split = [None] * len(params), len(train_idx) // B
    for i in range(steps):
        if i % n_split == 0:
            perm = torch.randperm(len(train_idx))
        idx = train_idx[perm[(i % n_split) * B:(i % n_split + 1) * B]]
        pred, y = gates(hidden[:, idx].to(gates.dtype)), store.scores[:, :, idx]
        (TG.bce_per_layer if loss == "bce" else TG.logmse_per_layer)(pred, y).sum().backward()
        step_lr = lr * TG.lr_multiplier(i, steps)
        if optimizer == "sgd":
            TG.sgd_step(params, state, step_lr)
        else:
            TG.adam_step(params, state, step_lr, i + 1)
    return gates


@pytest.mark.parametrize("name", ["paper", "adam-logmse"])
def test_named_recipes_train_as_the_plain_loop(tmp_path, name):
    """With the cut's options off (the named recipes as they stand), train gives the plain loop's
    gates bit for bit."""
    store = make_store(tmp_path)
    recipe = TG.RECIPES[name]
    gates, _ = run(store, recipe, steps=120)
    ref = reference_train(store, 120, 100, 3, recipe.optimizer, recipe.lr, recipe.loss)
    for (k, a), b in zip(gates.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), k


def test_the_cut_flags():
    """Each option is a flag that sets its Recipe field, alone or together, on any recipe; negative
    or infinite weights and norms are refused."""
    def recipe(*flags):
        args = cmd.parse_args(["--data", "d", *flags], TG.RECIPES, TG.PARTS)
        return TG.make_recipe(args.recipe,
                              {f: getattr(args, f) for f in TG.Recipe.__dataclass_fields__}), args
    assert recipe()[0] == TG.RECIPES["paper"] and not recipe()[1].ridge_ceiling
    assert recipe("--keep-term", "0.5")[0] == TG.Recipe(keep_term=0.5)
    assert recipe("--calibrate-heads")[0] == TG.Recipe(calibrate_heads=True)
    both, args = recipe("--recipe", "adam-logmse", "--keep-term", "1", "--cut-pairs", "2",
                        "--final-chunk", "drop", "--select", "overlap", "--clip", "1.5",
                        "--ridge-ceiling")
    assert both == TG.Recipe(optimizer="adam", lr=3e-3, loss="logmse", select="overlap", clip=1.5,
                             keep_term=1.0, cut_pairs=2.0, final_chunk="drop")
    assert args.ridge_ceiling
    for bad in (["--keep-term", "-1"], ["--cut-pairs", "inf"], ["--clip", "nan"],
                ["--final-chunk", "cut"], ["--select", "overlap@0.3"],
                ["--calibrate-heads", "--export-pt"]):
        with pytest.raises(SystemExit) as e:
            cmd.parse_args(["--data", "d", *bad], TG.RECIPES, TG.PARTS)
        assert e.value.code == 2, bad


def test_the_command_line_trains_with_every_option_and_prints_the_ceiling(tmp_path, capsys):
    """python train_gate.py with every option and --ridge-ceiling: the tiny model's features, the
    gate file's training summary names the options, metrics.json holds each option's numbers and
    the ceiling beside the gate, and the ceiling's table is printed; --final-chunk drop with too few
    tokens left says why."""
    folder = tiny_model_folder(tmp_path / "models", "qwen3", seed=1)
    sharpen(folder)
    data, out = write_docs(tmp_path / "data", 8), tmp_path / "out"
    flags = ["--model", folder, "--data", data, "--tokens", 3000, "--long-doc-tokens", 0,
             "--batch-tokens", 100, *SMALL]
    run_main([*flags, "--out", out, "--steps", 60, "--keep-term", 1, "--cut-pairs", 1,
              "--final-chunk", "drop", "--select", "overlap", "--clip", 1, "--ridge-ceiling",
              "--calibrate-heads"])
    printed = capsys.readouterr().out
    assert "the gate against a linear ceiling" in printed
    m = json.loads((out / "metrics.json").read_text())
    L = len(m["layers"])
    for k in ("train_keep_loss", "train_cut_pair_loss", "train_grad_norm", "val_overlap"):
        assert len(m[k]) == len(m["step"]) and len(m[k][-1]) == L, k
    for k in ("selected_val_overlap", "ceiling_val_spearman", "ceiling_val_overlap",
              "gate_val_spearman", "gate_val_overlap"):
        assert len(m[k]) == L, k
    assert m["gate_val_overlap"] == m["selected_val_overlap"]  # the returned gate: the selected
    training = gate_metadata(out / "gate.safetensors")["training"]
    assert (training["keep_term"], training["cut_pairs"], training["final_chunk"],
            training["select"], training["clip"]) == (1.0, 1.0, "drop", "overlap", 1.0)
    assert list(training["cut_budgets"]) == list(TG.CUT_BUDGETS)
    assert training["calibrate_heads"] and list(training["calibrate_budgets"]) == list(
        T.CALIBRATE_BUDGETS)
    assert len(m["head_calibration"]) == T.CALIBRATE_ITERS + 1
    assert "--calibrate-heads: mean abs per-head share error @0.2" in printed
    lengths = [d["tokens"] for d in json.loads((out / "manifest.json").read_text())["documents"]
               if d["split"] == "train"]
    batch = sum(n - n % 128 for n in lengths) + 1  # one token more than the drop leaves
    assert batch <= sum(lengths)
    run_main([*flags, "--out", out, "--steps", 1, "--batch-tokens", batch])
    with pytest.raises(SystemExit) as e:
        run_main([*flags, "--out", out, "--steps", 1, "--final-chunk", "drop",
                  "--batch-tokens", batch])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--final-chunk drop leaves out" in err, err


def test_calibrate_gate_sets_only_the_cut_offsets_of_a_trained_gate(tmp_path, capsys):
    """python -m harness.calibrate_gate on a gate train_gate.py trained and its features: the new
    gate holds the old one's parameters bit for bit and cut offsets beside them, the shares come
    closer to the teacher's, the metadata says where it came from; an existing --out, a .pt --out
    and a folder without features are refused in one line, exit 2."""
    from formats.checkpoint import read_config
    from formats.gate_file import load_gate
    from harness import calibrate_gate
    folder = tiny_model_folder(tmp_path / "models", "qwen3", seed=1)
    sharpen(folder)
    data, out = write_docs(tmp_path / "data", 8), tmp_path / "out"
    run_main(["--model", folder, "--data", data, "--tokens", 3000, "--long-doc-tokens", 0,
              "--batch-tokens", 100, *SMALL, "--out", out, "--steps", 30])
    cal = tmp_path / "cal.safetensors"
    argv = ["--gate", out / "gate.safetensors", "--features", out, "--out", cal, "--model", folder]
    calibrate_gate.main([str(a) for a in argv])
    assert f"calibrated gate -> {cal}" in capsys.readouterr().out
    cfg = read_config(folder)
    old, new = load_gate(out / "gate.safetensors", cfg), load_gate(cal, cfg)
    for (name, a), b in zip(old.named_parameters(), new.parameters()):
        assert torch.equal(a, b), name
    assert not old.cut_offset.any() and new.cut_offset.abs().max() > 0
    c = new.meta["calibration"]
    assert c["source"] == str(out / "gate.safetensors") and len(c["share_error"]) == 4
    assert c["source_tensors_sha256"] == old.meta["tensors_sha256"] != new.meta["tensors_sha256"]
    assert not {"source", "tensors_sha256"} & set(gate_metadata(cal))  # not the source's, stale
    (kept,) = [row for row in c["share_error"] if row["kept"]]
    assert sum(kept[f"train@{r:g}"] for r in T.CALIBRATE_BUDGETS) <= sum(
        c["share_error"][0][f"train@{r:g}"] for r in T.CALIBRATE_BUDGETS)
    for bad, says in ((argv, "exists"), ([*argv[:5], tmp_path / "x.pt", *argv[6:]],
                                         "no place for the cut offsets"),
                      ([*argv[:3], tmp_path / "data", "--out", tmp_path / "x"],
                       "is not a features folder")):
        with pytest.raises(SystemExit) as e:
            calibrate_gate.main([str(a) for a in bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and err.count("\n") == 1, err
