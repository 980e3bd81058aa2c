"""bench.py and harness/quality.py: the fast path equals the real path bit for bit, the metrics are
right, --quick runs clean.

The first and last tests use the real offline Gemma3 270M (converted on first use, ~1 min) and the
Austen assets; together they take about 2.5 minutes on 2 cores.
"""
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import bench
import gate
import generate
from cache import Budget
from cli import OFFLINE_DEFAULT, UsageError, resolve_model
from formats import gate_file
from harness import quality, quality_report, report, speed
from offline import fetch_assets
from prompts import prompt_format
from teacher import KVzipTeacher
from tests.assets import require_asset
from tests.helpers import QWEN3_TINY, assert_close

# ---------------------------------------------------------------------------------------- metrics

def test_wilson_interval():
    lo, hi = quality.wilson(0, 10)
    assert lo == 0.0 and 0.25 < hi < 0.35  # the rule of three, roughly
    lo, hi = quality.wilson(10, 10)
    assert hi == 1.0 and 0.65 < lo < 0.75
    lo, hi = quality.wilson(50, 100)
    # ≈ normal approx.
    assert abs((lo + hi) / 2 - 0.5) < 1e-9 and abs(hi - lo - 2 * 1.96 * 0.05) < 0.01


def test_relative_definitions():
    assert quality.relative("passkey", 0.3, 0.6) == pytest.approx(0.5)
    # undefined when the full cache scores 0
    assert math.isnan(float(quality.relative("kv", 0.3, 0.0)))
    assert quality.relative("nll_next", 2.0, 2.0) == pytest.approx(1.0)
    # = ppl_full / ppl
    assert quality.relative("nll_repeat", 2.5, 2.0) == pytest.approx(math.exp(-0.5))
    assert quality.relative("agreement", 0.8, 1.0) == pytest.approx(0.8)
    assert np.allclose(quality.relative("passkey", np.array([0.2, 0.4]), np.array([0.4, 0.4])),
                       [0.5, 1.0])


def test_tally_ratio_of_sums_and_bootstrap():
    t = quality.Tally()
    for num, den in [(1, 2), (3, 4), (0, 4)]:
        t.add(num, den)
    # pooled over contexts, not a mean of per-context ratios
    assert t.value() == pytest.approx(4 / 10)
    idx = np.array([[0, 0, 0], [1, 2, 1]])
    assert np.allclose(t.value(idx), [0.5, 6 / 12])


def fake_run(n_ctx=6, seed=0):
    """Tallies for full and one method that is exactly half as accurate and 0.1 nats worse."""
    nlls = 2 + np.random.default_rng(seed).random(n_ctx)  # per context, shared by both caches
    tallies, extras = {}, {}
    for key, acc, dn in ((("full", 1.0), 0.8, 0.0), (("streaming", 0.5), 0.4, 0.1)):
        tallies[key] = {t: quality.Tally() for t in quality.TASKS}
        extras[key] = dict(kept_fraction=0.5, kept_fraction_per_layer=[0.5, 0.5], kv_bytes=1.0,
                           kv_fraction=0.5, decode_tok_s=1.0)
        for nll in nlls:
            for task in ("passkey", "kv"):
                tallies[key][task].add(acc * 10, 10)
            tallies[key]["nll_next"].add(64 * (nll + dn), 64)
            tallies[key]["nll_repeat"].add(48 * (nll + dn), 48)
            tallies[key]["agreement"].add(10 if key[0] == "full" else 7, 10)
    return tallies, extras


def test_summarize_rows_and_figure10_average():
    tallies, extras = fake_run()
    rows = quality.summarize(tallies, extras, n_boot=200, seed=0)
    get = lambda task, method: next(r for r in rows if r["task"] == task and r["method"] == method)
    assert get("passkey", "streaming")["relative"] == pytest.approx(0.5)
    assert get("nll_next", "streaming")["relative"] == pytest.approx(math.exp(-0.1))
    assert get("nll_next", "streaming")["increase"] == pytest.approx(0.1)
    assert get("agreement", "streaming")["score"] == pytest.approx(0.7)
    avg = get("average", "streaming")
    assert avg["relative"] == pytest.approx((0.5 + 0.5 + 2 * math.exp(-0.1)) / 4)
    lo, hi = avg["ci"]
    assert lo <= avg["relative"] + 1e-9 and hi >= avg["relative"] - 1e-9
    assert get("passkey", "full")["relative"] == 1.0 and get("passkey", "full")["n"] == 60
    for r in rows:  # the JSON contract of generate.py --json
        assert {"task", "method", "budget", "score", "relative", "n", "level",
                "kept_fraction_per_layer", "ci"} <= r.keys()


def test_average_leaves_out_tasks_the_full_cache_fails():
    tallies, extras = fake_run()
    for key in tallies:  # nobody answers a single kv question
        tallies[key]["kv"] = quality.Tally()
        for _ in range(6):
            tallies[key]["kv"].add(0, 10)
    rows = quality.summarize(tallies, extras, n_boot=100, seed=0)
    avg = next(r for r in rows if r["task"] == "average" and r["method"] == "streaming")
    assert (avg["relative"] == pytest.approx((0.5 + 2 * math.exp(-0.1)) / 3)
            and avg["ci"] is not None)
    assert next(r for r in rows if r["task"] == "kv"
                and r["method"] == "streaming")["relative"] is None


def test_average_over_chosen_tasks():
    """--average picks the tasks of the Figure-10 average, in the rows and in the paired differences
    alike."""
    tallies, extras = fake_run()
    rows = quality.summarize(tallies, extras, n_boot=50, seed=0, averaged=("passkey", "nll_next"))
    avg = next(r for r in rows if r["task"] == "average" and r["method"] == "streaming")
    assert avg["relative"] == pytest.approx((0.5 + math.exp(-0.1)) / 2)
    tallies[("fastkvzip", 0.5)], tallies[("kvzip", 0.5)] = (tallies.pop(("streaming", 0.5)),
                                                            tallies[("full", 1.0)])
    (c,) = quality.contrasts(tallies, n_boot=50, seed=0, averaged=("nll_repeat",))
    assert c["diff"] == pytest.approx(math.exp(-0.1) - 1.0)
    assert (bench.parse_args(["--average", "passkey,nll_next,passkey"]).average
            == ["passkey", "nll_next"])
    for bad in ("passkey,json", ""):
        with pytest.raises(SystemExit):
            bench.parse_args(["--average", bad])


def test_contrasts_are_paired_differences_of_the_average():
    tallies, extras = fake_run()
    # half as accurate, 0.1 nats worse
    tallies[("fastkvzip", 0.5)] = tallies.pop(("streaming", 0.5))
    tallies[("kvzip", 0.5)] = tallies[("full", 1.0)]                # lossless
    (c,) = quality.contrasts(tallies, n_boot=200, seed=0)
    want = (0.5 + 0.5 + 2 * math.exp(-0.1)) / 4 - 1.0
    assert ((c["a"], c["b"], c["budget"]) == ("fastkvzip", "kvzip", 0.5)
            and c["diff"] == pytest.approx(want))
    # the same loss on every context: paired, no spread
    assert c["ci"] == pytest.approx([want, want])
    tallies[("kvzip", 0.5)] = tallies[("fastkvzip", 0.5)]
    assert quality.contrasts(tallies, n_boot=50, seed=0)[0]["ci"] == [0.0, 0.0]


def test_markdown_renders_every_task():
    tallies, extras = fake_run()
    rows = quality.summarize(tallies, extras, n_boot=50, seed=0)
    cfg = dict(started="now", git_commit="0" * 40, git_dirty=False,
               gate=dict(source="g", sha256="ab"),
               flags=dict(model="m", lengths=[512], passkeys=1, kv_questions=1, kv_pairs=8,
                          chunk_size=16384, seed=0))
    tallies[("kvzip", 0.5)], tallies[("fastkvzip", 0.5)] = (tallies[("full", 1.0)],
                                                            tallies[("streaming", 0.5)])
    md = report.markdown(dict(config=cfg, rows=rows, compressed_layers=[5, 11], n_contexts=6,
                              seconds=1.0, contrasts=quality.contrasts(tallies, n_boot=50, seed=0)))
    # (0.5 + 0.5 + 2e^-0.1)/4 - 1
    assert "| the gate minus its teacher | -0.30 [-0.30, -0.30] |" in md
    for title in ("Relative performance", "Kept fraction", "Pass-key", "Key-value",
                  "repeated passage", "Agreement", "Paired differences"):
        assert title in md
    assert "| streaming | 0.50/0.50 |" in md  # the kept-fraction grid: one cell per budget


def test_plot_writes_a_png(tmp_path):
    tallies, extras = fake_run()
    quality_report.plot(dict(rows=quality.summarize(tallies, extras, n_boot=50, seed=0)),
                 tmp_path / "relative.png")
    assert (tmp_path / "relative.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # written atomically, nothing left over
    assert [p.name for p in tmp_path.iterdir()] == ["relative.png"]


# ------------------------------------------------------------------------------------ real model

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    import model as M
    require_asset("austen_parts")
    folder = resolve_model(OFFLINE_DEFAULT)
    model = M.load_model(folder, "cpu", torch.float32)
    tok = M.load_tokenizer(folder)
    fmt = prompt_format(model.config, OFFLINE_DEFAULT, chat=False)
    gate_path = gate_file.GATES_DIR / f"{OFFLINE_DEFAULT}.safetensors"
    # before train_gate.py has bundled one: a random gate exercises the same code
    if not gate_path.is_file():
        cfg = model.config
        torch.manual_seed(0)
        gates = gate.Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                           cfg.group_size)
        gate_path = tmp_path_factory.mktemp("gate") / "random.safetensors"
        gate_file.save_gate(gate_path, gates, {"note": "random, tests only"})
    return dict(model=model, tok=tok, fmt=fmt, gate=str(gate_path), docs=quality.load_docs(tok)[:4])


def same_cache(a, b, exact=True):
    """Same kept positions in every layer and head; keys and values equal bit for bit (exact) or to
    2e-5 of their layer's largest entry: a second forward sums in another order (and the order
    depends on the thread count), and fp32 rounding grows with the size of the terms, up to ~100
    here. Measured: at most 4.6e-6 of the scale (layer 15 values; 1.25e-4 absolute on layer 11's
    keys of magnitude 87)."""
    assert a.n_seen == b.n_seen
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        assert torch.equal(x.lens, y.lens), f"layer {i}: kept lengths differ"
        for h in range(x.n_heads):
            assert torch.equal(x.head_pos(h), y.head_pos(h)), (
                f"layer {i} head {h}: kept positions differ")
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        rows = lambda kv: torch.cat([torch.arange(int(s), int(s) + int(n))
                                     for s, n in zip(kv.starts, kv.lens)])
        for j, name in ((0, "keys"), (1, "values")):
            u, w = x.keys_values()[j][rows(x)], y.keys_values()[j][rows(y)]
            if exact:
                assert torch.equal(u, w), (f"layer {i}: {name} differ, max |diff| "
                                           f"{(u - w).abs().max():.3e}")
            else:
                assert_close(u, w, atol=0, scale_rtol=2e-5, name=f"layer {i} {name}")


def kept_near_the_cut(a, b, n_protected, x, y, budget):
    """KVzip's one eviction (generate.evict_once: one global top-k over the context but its window)
    from scores x (cache a) and y (cache b), (L_c, H, n_context), equal to rounding: the kept
    positions differ at most where a kept and a dropped pair lie within 2·max|x - y| of each other;
    where they agree, so do keys and values (same_cache) -> whether any pair went the other way."""
    n = x.shape[-1]
    seg = n - budget.plan(n).window
    x, y = x[..., :seg].double().cpu(), y[..., :seg].double().cpu()
    inf = x.isinf()  # never evicted
    assert torch.equal(inf, y.isinf())
    moved = float((x - y)[~inf].abs().max())
    assert moved <= 1e-4 * float(x[~inf].abs().max()), f"teacher scores moved by {moved:.2e}"

    def kept(cache):  # (L_c, H, seg) bool
        rows = [[cache.layers[i].head_pos(h) - n_protected for h in range(cache.layers[i].n_heads)]
                for i in cache.compressed]
        keep = torch.zeros(x.shape, dtype=torch.bool)
        for li, heads in enumerate(rows):
            for h, p in enumerate(heads):
                keep[li, h, p[(p >= 0) & (p < seg)]] = True
        return keep

    ka, kb = kept(a), kept(b)
    near = ((ka & (x <= x[~ka].max() + 2 * moved))
            | (~ka & (x >= x[ka & ~inf].min() - 2 * moved))) & ~inf
    assert torch.equal(ka[~near], kb[~near]), "kept positions differ away from the cut"
    assert ka.sum() == kb.sum()
    if torch.equal(ka, kb):
        same_cache(a, b, exact=False)
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("method,level,budget,chunk", [
    ("fastkvzip", "global", 0.3, 16384), ("fastkvzip", "calibrated", 0.2, 16384),
    ("snapkv", "head", 0.5, 16384), ("kvzip", "global", 0.3, 16384),
    ("fastkvzip", "global", 0.3, 160), ("kvzip", "global", 0.3, 160)])
def test_fast_path_equals_generate_prefill(real, method, level, budget, chunk, monkeypatch):
    """The benchmark's cache (one chunk: the replay; several: the real chunked prefill) keeps
    exactly the positions, keys and values that generate.prefill keeps on a real evicting cache
    (KVzip: generate.prefill_kvzip), and gives bit-identical logits afterwards."""
    model, tok = real["model"], real["tok"]
    args = bench.parse_args(["--gate", real["gate"], "--chunk-size", str(chunk), "--window", "32"])
    maker = quality.SampleMaker(tok, real["fmt"], real["docs"], seed=1, n_passkeys=2,
                                n_kv_questions=1, n_probe=16)
    s = maker.make(400)
    teacher = KVzipTeacher(model, tok, real["fmt"]) if method == "kvzip" else None
    scored, score = [], KVzipTeacher.score  # each teacher scoring, the last: prefill_kvzip's
    monkeypatch.setattr(KVzipTeacher, "score",
                        lambda *a, **kw: scored.append(score(*a, **kw)) or scored[-1])
    with torch.no_grad():
        full, logits, tscores = quality.capture_prefill(model, s.ids, args.chunk_size, teacher,
                                                        s.n_protected)
        fast = quality.method_cache(model, method, level, s.n_protected, args.model, args.gate, 7,
                                    tscores)
        quality.prefill_from_capture(model, full, logits, fast, method, s, budget, args.chunk_size,
                                     args.window)
        real_cache = quality.method_cache(model, method, level, s.n_protected, args.model,
                                          args.gate, 7)
        if method == "kvzip":
            generate.prefill_kvzip(model, teacher, real_cache, s.ids, s.n_protected,
                                       Budget(budget, args.chunk_size, args.window))
        else:
            generate.prefill(model, real_cache, s.ids, s.n_protected,
                             Budget(budget, args.chunk_size, args.window))
        # generate.prefill_kvzip feeds the last token in a second forward (for its logits): its keys
        # and values match the one-forward replay to rounding only, so KVzip is held to positions +
        # 2e-5 of scale; and so are its teacher scores, so a near-tie at the cut may go either way
        if method == "kvzip":
            swapped = kept_near_the_cut(fast, real_cache, s.n_protected,
                                        tscores[..., s.n_protected:], scored[-1],
                                        Budget(budget, args.chunk_size, args.window))
        else:
            same_cache(fast, real_cache)
        kept = fast.kept_fraction_per_layer(s.n_protected, len(s.ids))
        assert abs(np.mean(kept) - budget) < 0.01 and min(kept) < 1.0
        q = s.questions[0].prompt
        fast.start_decoding(), real_cache.start_decoding()  # as generate.answer does
        a, b = model(torch.tensor(q), fast), model(torch.tensor(q), real_cache)
        if method == "kvzip":
            if not swapped:  # one other row kept: other logits
                assert_close(a, b, atol=1e-3, name="logits")
        else:
            assert torch.equal(a, b), f"logits differ: max |diff| {(a - b).abs().max():.3e}"


@pytest.mark.slow
def test_each_method_keeps_its_own_scorer(real):
    """The teacher's scores, computed once per context, go to KVzip only (regression: they once
    replaced every method's scorer, which made all methods identical)."""
    args = bench.parse_args(["--gate", real["gate"]])
    scores = torch.rand(3, 1, 101)
    want = dict(fastkvzip=gate.GateScorer, kvzip=gate.KVzipScorer, snapkv=gate.SnapKVScorer,
                streaming=gate.StreamingScorer, random=gate.RandomScorer, knorm=gate.KnormScorer)
    for method, cls in want.items():
        cache = quality.method_cache(real["model"], method, gate.METHODS[method].level, 1,
                                     args.model, args.gate, 0, scores)
        assert type(cache.scorer) is cls, (method, type(cache.scorer))
        assert cache.level == gate.METHODS[method].level


@pytest.mark.slow
def test_needles_and_probes_are_where_they_claim(real):
    tok = real["tok"]
    maker = quality.SampleMaker(tok, real["fmt"], real["docs"], seed=3, n_passkeys=3,
                                n_kv_questions=2, n_probe=32)
    s = maker.make(1000)
    assert abs(len(s.ids) - s.n_protected - 1000) <= 2  # needle tokens counted in the length
    text = tok.decode(s.ids)
    for q in s.questions:
        if q.answer:
            # the question does not leak it
            assert q.answer in text and q.answer not in tok.decode(q.prompt)
    ctx = s.ids[s.n_protected:]
    cue, target = s.probes["nll_repeat"]
    passage = cue[-16:] + target
    # a real passage of the context
    assert any(ctx[i:i + len(passage)] == passage for i in range(len(ctx)))
    depths = sorted(q.depth for q in s.questions if q.task == "passkey")
    assert depths[0] < 1 / 3 + 1e-9 and depths[-1] >= 2 / 3 - 1e-9  # stratified over the context


@pytest.mark.slow
def test_prose_contexts_are_held_out_corpus_text(real):
    """--text prose: contexts cut from the last documents of each source of the gates' training
    corpus (none of which train_gate.py selects before document 672), with needles as in Austen's;
    the experiment's key names the text (austen or prose)."""
    texts = quality.prose_texts()
    corpus = fetch_assets.text_docs("corpus")
    index = {p.stem.split("-")[0]: i for i, p in enumerate(corpus)}
    sources = {p.stem.split("-")[1] for p in corpus}
    assert {name.split()[0] for name, _ in texts} == sources
    for name, text in texts:
        first, last = (index[x] for x in name.split()[1].split("-"))
        assert first >= 672 and text.startswith(corpus[first].read_text(encoding="utf-8").strip())
    args = bench.parse_args(["--gate", real["gate"], "--text", "prose", "--lengths", "1500",
                             "--contexts", "2"])
    _, samples = quality.make_samples(real["tok"], real["fmt"], bench.experiment(args))
    prose = dict(quality.load_docs(real["tok"], "prose"))
    for s in samples:
        hay = s.ids[s.n_protected:s.n_protected + 50]  # the context starts with its document's text
        assert s.doc in prose and any(prose[s.doc][i:i + 50] == hay
                                      for i in range(len(prose[s.doc]) - 49))
    config = dict(model=dict(sha256="m"), gate=dict(sha256="g"))
    assert quality.quality_key(bench.experiment(args), config)["text"] == "prose"
    results = dict(config=dict(config, flags=vars(args), started="t",
                               gate=dict(source="g", sha256="g"), git_commit="c" * 10,
                               git_dirty=False), n_contexts=2, rows=[], seconds=1)
    assert "2 held-out prose contexts" in report.markdown(results)
    austen = bench.experiment(bench.parse_args(["--gate", real["gate"]]))
    assert quality.quality_key(austen, config)["text"] == "austen"


@pytest.mark.slow
def test_chat_flag_sets_the_prompt_format_and_the_experiment(real, tmp_path, monkeypatch):
    """--chat / --no-chat: the contexts' prompt format (as generate.py's flag), part of the
    experiment's key (None when not given: the model's default) and named in results.md."""
    seen = []

    def stop(model, tok, fmt, *args, **kwargs):
        seen.append(fmt)
        # the format is all it needs: stop before any context runs
        raise UsageError("stopped by the test")

    monkeypatch.setattr(quality, "run", stop)
    for flag in ("--chat", "--no-chat"):
        with pytest.raises(UsageError, match="stopped by the test"):
            bench.main([flag, "--quick", "--gate", real["gate"], "--out", str(tmp_path / flag),
                        "--no-gpu"])
    cfg = real["model"].config
    assert seen == [prompt_format(cfg, OFFLINE_DEFAULT, chat=True),
                    prompt_format(cfg, OFFLINE_DEFAULT, chat=False)]
    assert seen[0] != seen[1]
    config = dict(model=dict(sha256="m"), gate=dict(sha256="g"))
    keys = [quality.quality_key(bench.experiment(bench.parse_args(f)), config)
            for f in ([], ["--chat"], ["--no-chat"])]
    assert keys[0]["chat"] is None and keys[1]["chat"] is True and keys[2]["chat"] is False
    args = bench.parse_args(["--no-chat", "--lengths", "1500", "--contexts", "2"])
    results = dict(config=dict(config, flags=vars(args), started="t",
                               gate=dict(source="g", sha256="g"), git_commit="c" * 10,
                               git_dirty=False), n_contexts=2, rows=[], seconds=1)
    assert "tokens, no chat template, 3 pass keys" in report.markdown(results)


@pytest.fixture(scope="module")
def quick(real, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick"
    bench.main(["--quick", "--gate", real["gate"], "--out", str(out), "--no-gpu"])
    return out


@pytest.mark.slow
def test_quick_smoke(quick):
    """`bench.py --quick` as CI runs it: every method, finite results, all files written."""
    out = quick
    res = json.loads((out / "results.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert res["complete"] and (out / "results.md").read_text().startswith("# Fast KVzip benchmark")
    assert cfg["gate"]["sha256"] and cfg["model"]["sha256"] and cfg["flags"]["quick"]
    methods = {r["method"] for r in res["rows"]}
    assert methods == set(bench.METHODS)
    for r in res["rows"]:
        assert r["n"] > 0 and math.isfinite(r["score"]), r
        assert r["relative"] is None or math.isfinite(r["relative"]), r
        full = next(x for x in res["rows"] if x["task"] == r["task"] and x["method"] == "full")
        if r["task"] != "average" and full["score"] and full["score"] > 0:
            assert r["relative"] is not None, r  # defined whenever the full cache scores above 0
        assert all(0 < k <= 1 for k in r["kept_fraction_per_layer"]), r
    for r in res["speed"]:
        for k in ("prefill_s", "kv_bytes", "peak_kv_bytes", "decode_tok_s", "score_fraction"):
            assert math.isfinite(r[k]) and r[k] >= 0, (k, r)
    assert {(r["method"], r["budget"]) for r in res["speed"]} == {
        ("full", 1.0), ("fastkvzip", 0.3), ("kvzip", 0.3), ("fastkvzip", 0.5), ("fastkvzip", 0.2)}


@pytest.mark.slow
def test_shards_resume_and_merge_equal_one_run(real, quick, tmp_path):
    """An experiment split into shards, interrupted and resumed, then merged, gives exactly the rows
    of one uninterrupted run (same contexts, same scores, same bootstrap intervals; decode speed
    aside). The second shard runs alone (its context made with nothing run before it); the first
    shard's record is the uninterrupted run's, which shard 0/2 would recompute."""
    flags = ["--quick", "--gate", real["gate"], "--no-gpu", "--speed-lengths", "0"]
    run = lambda out, *a: bench.main(flags + ["--out", str(tmp_path / out), *a])
    untimed = lambda rows: [{k: v for k, v in r.items() if k != "decode_tok_s"} for r in rows]
    rows = lambda out: untimed(json.loads((out / "results.json").read_text())["rows"])
    run("b", "--shard", "1/2")  # context 1 only
    assert [p.name for p in (tmp_path / "b" / "contexts").iterdir()] == ["context-001.json"]
    # the shard's record first: merge keeps the first folder's record of a context
    bench.main(["--merge", f"{tmp_path / 'b'},{quick}", "--out", str(tmp_path / "merged")])
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert (merged["complete"] and merged["n_contexts"] == 2
            and untimed(merged["rows"]) == rows(quick))
    # b as one whole run, given context 0's record: resumes from both records and runs nothing
    # (a resume that runs the contexts it lacks: test_run_folders' kill -9 test)
    shutil.copy(quick / "contexts" / "context-000.json", tmp_path / "b" / "contexts")
    records = lambda: {p.name: (p.stat().st_mtime_ns, p.read_bytes())
                       for p in (tmp_path / "b" / "contexts").iterdir()}
    before = records()
    run("b")
    assert sorted(before) == ["context-000.json", "context-001.json"] and records() == before
    assert rows(tmp_path / "b") == rows(quick)
    # other flags: refused, not mixed
    with pytest.raises(UsageError, match="another configuration"):
        run("b", "--seed", "1")


def test_gpu_section_code_path_on_cpu(tmp_path):
    """The GPU section (random weights in Qwen3-8B's shape) on a tiny Qwen3 shape, on the CPU: it
    runs, and memory is accounted as on the real model (evicting keeps less than full)."""
    require_asset("tokenizers", "qwen3")
    args = bench.parse_args(["--gpu-lengths", "96", "--speed-decode", "3"])
    shape = dict(QWEN3_TINY, model_type="qwen3", vocab_size=151936, max_position_embeddings=4096)
    rows = speed.gpu_section(bench.speed_settings(args), args.gpu_lengths, tmp_path, shape=shape,
                             device="cpu", chunk=32, window=16)  # 3 chunks: evicts twice
    # every budget's decode speed on the first length
    assert ([(r["method"], r["budget"]) for r in rows] == [("full",
                                                            1.0), ("fastkvzip", 0.3),
                                                           ("kvzip",
                                                            0.3)]
            + [("fastkvzip", b) for b in (0.75, 0.5, 0.4, 0.2, 0.1)])
    full, fast, kvzip = rows[:3]
    assert rows[-1]["kv_bytes"] < fast["kv_bytes"] < rows[3]["kv_bytes"]  # 0.1 < 0.3 < 0.75
    assert fast["kv_bytes"] < full["kv_bytes"] and kvzip["kv_bytes"] < full["kv_bytes"]
    # chunked prefill never holds the whole context
    assert fast["peak_kv_bytes"] < full["peak_kv_bytes"]
    # the teacher's repeat pass sits on a full cache
    assert kvzip["peak_kv_bytes"] > full["peak_kv_bytes"]
    assert all(math.isfinite(r["prefill_s"]) and r["decode_tok_s"] > 0 for r in rows)


def test_speed_rows_of_another_configuration_are_refused(real, quick, tmp_path):
    """A run that measures no speed keeps the speed rows already in its --out only if they were
    measured with the same settings (gate, budgets, chunk, ...); rows of another gate are refused,
    not credited to it."""
    import shutil
    cfg = real["model"].config
    torch.manual_seed(1)
    other = tmp_path / "other.safetensors"
    gate_file.save_gate(other, gate.Gates(len(cfg.compressed_layers), cfg.hidden_size,
                                          cfg.num_key_value_heads, cfg.group_size))
    out = tmp_path / "out"
    shutil.copytree(quick, out)
    shutil.rmtree(out / "contexts")  # speed rows alone, as a --no-quality run leaves them
    with pytest.raises(UsageError,
                       match=r"speed rows of another configuration \(gate, speed_budget differ\)"):
        bench.main(["--quick", "--no-quality", "--speed-lengths", "0", "--gate", str(other),
                    "--speed-budget", "0.5", "--out", str(out), "--no-gpu"])
    with pytest.raises(UsageError,
                       match=r"speed rows of another configuration \(budgets, "
                       r"speed_decode differ\)"):
        bench.main(["--no-quality", "--speed-lengths", "0", "--gate", real["gate"], "--out",
                    str(out), "--no-gpu"])
    bench.main(["--quick", "--no-quality", "--speed-lengths", "0", "--gate", real["gate"], "--out",
                str(out), "--no-gpu"])
    speed = lambda folder: json.loads((folder / "results.json").read_text())["speed"]
    assert speed(out) == speed(quick)  # the same settings: kept


def test_merge_refuses_speed_rows_of_two_configurations(tmp_path):
    for name, budget in (("a", 0.3), ("b", 0.5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(
            {"quality_key": {}, "command": name}))
        (tmp_path / name / "results.json").write_text(json.dumps(
            {"config": {"speed_key": {"speed_budget": budget}}, "speed": [{"context": 256}]}))
    with pytest.raises(UsageError,
                       match=r"b holds speed rows of another configuration.*speed_budget differ"):
        bench.main(["--merge", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--out",
                    str(tmp_path / "merged")])


def speed_row(context, method, budget):
    return dict(context=context, method=method, budget=budget, prefill_s=1.0, prefill_vs_full=1.0,
                score_fraction=0.0, kv_bytes=2**20, kv_vs_full=1.0, peak_kv_bytes=2**20,
                peak_vs_full=1.0, decode_tok_s=5.0, device="cpu")


def speed_only_run(folder, rows):
    """A bench --out folder as a --no-quality run leaves it: config.json, results.json with speed
    rows."""
    args = bench.parse_args(["--no-quality"])
    config = dict(model=dict(sha256="m"), gate=dict(source="g", sha256="g"))
    config.update(flags=vars(args), command="bench.py --no-quality", started="t",
                  git_commit="c" * 10, git_dirty=False, speed_key={"speed_budget": 0.3},
                  quality_key=quality.quality_key(bench.experiment(args), config))
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    results = dict(config=config, rows=[], speed=rows, complete=True)
    (folder / "results.json").write_text(json.dumps(results))
    return str(folder)


def test_merge_counts_each_run_and_each_speed_row_once(tmp_path):
    """--merge A,A, or shards that each measured the same speed rows: every row once (3 rows stay
    3, not 6). Runs without a finished context (speed only) merge without a quality section,
    complete."""
    rows = [speed_row(256, m, b) for m, b in (("full", 1.0), ("fastkvzip", 0.3), ("kvzip", 0.3))]
    a = speed_only_run(tmp_path / "a", rows)
    b = speed_only_run(tmp_path / "b", rows + [speed_row(512, "full", 1.0)])
    with pytest.raises(UsageError, match="--merge names .*a twice"):
        bench.main(["--merge", f"{a},{a}", "--out", str(tmp_path / "merged")])
    bench.main(["--merge", f"{a},{b}", "--out", str(tmp_path / "merged")])
    res = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert [(r["context"], r["method"]) for r in res["speed"]] == [
        (256, "full"), (256, "fastkvzip"), (256, "kvzip"), (512, "full")]
    assert res["complete"] and res["rows"] == []
    assert "No quality section" in (tmp_path / "merged" / "results.md").read_text()


def test_merge_of_what_is_not_a_bench_run_or_into_a_file_is_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    model_config = json.dumps({"model_type": "llama"})  # a model's folder
    (tmp_path / "model" / "config.json").write_text(model_config)
    with pytest.raises(UsageError, match="model/config.json is not a bench run's"):
        bench.main(["--merge", str(tmp_path / "model"), "--out", str(tmp_path / "merged")])
    a = speed_only_run(tmp_path / "a", [speed_row(256, "full", 1.0)])
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="--out .*file/merged: cannot create the folder"):
        bench.main(["--merge", a, "--out", str(tmp_path / "file" / "merged")])


def test_average_title_names_only_the_tasks_asked():
    """--passkeys 0 --kv-pairs 0 --kv-questions 0: the average is over the two NLL probes, and its
    title says so (it named all four tasks)."""
    args = bench.parse_args(["--passkeys", "0", "--kv-pairs", "0", "--kv-questions", "0"])
    nll = lambda c, worse: [64 * (2 + 0.1 * c + worse), 64]
    entry = lambda c, worse: dict(tally=dict(passkey=[0, 0], kv=[0, 0], nll_next=nll(c, worse),
                                             nll_repeat=nll(c, 2 * worse), agreement=[1, 1]),
                                  kept=[1.0], nbytes=1, decode=[0, 0.0])
    records = [dict(context=c, doc="d", n_tokens=100, answers=[], agreement=None,
                    entries={"full@1": entry(c, 0.0), "streaming@0.5": entry(c, 0.1)})
               for c in range(3)]
    res = quality.quality_results(records, args.bootstrap, args.seed, args.average)
    assert res["averaged"] == ["nll_next", "nll_repeat"]
    avg = next(r for r in res["rows"] if r["task"] == "average" and r["method"] == "streaming")
    assert avg["relative"] == pytest.approx((math.exp(-0.1) + math.exp(-0.2)) / 2)
    title = "## Relative performance (mean of nll_next, nll_repeat; 1 = full cache)"
    assert quality_report.markdown(res)[0] == title


def test_damaged_context_record_is_named(tmp_path):
    (tmp_path / "a" / "contexts").mkdir(parents=True)
    (tmp_path / "a" / "config.json").write_text(json.dumps({"quality_key": {}, "command": "a"}))
    (tmp_path / "a" / "contexts" / "context-000.json").write_text('{"context": 0, "ent')
    with pytest.raises(UsageError, match=r"context-000.json is unreadable; delete it"):
        bench.main(["--merge", str(tmp_path / "a"), "--out", str(tmp_path / "merged")])


def test_quick_keeps_explicit_flags_and_checks_them(capsys):
    args = bench.parse_args(["--quick", "--budgets", "0.4,0.4", "--contexts", "3"])
    assert (args.budgets == [0.4] and args.contexts == 3 and args.lengths == [512]
            and args.bootstrap == 200)
    assert bench.parse_args(["--quick", "--speed-lengths", "0"]).speed_lengths == []
    # argparse's abbreviations count too
    assert bench.parse_args(["--quick", "--budg", "0.7"]).budgets == [0.7]
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--quick", "--budgets", "0.5,1.5"])
    assert (e.value.code == 2
            and "--budgets 0.5,1.5: each must be in (0, 1]" in capsys.readouterr().err)


@pytest.mark.parametrize("flags,words", [
    (["--probe-tokens", "5"], "--probe-tokens must be >= 17"),
    (["--kv-questions", "9"], "--kv-questions 9"), (["--passkeys", "13"], "at most 12"),
    (["--threads", "-1"], "--threads: must be >= 0"), (["--budgets", ""], "--budgets (none)"),
    (["--contexts", "0"], "--contexts must be >= 1"), (["--chunk-size", "0"],
                                                       "--chunk-size must be >= 1"),
    (["--window", "-5"], "--window must be >= 0"), (["--speed-budget", "0"], "--speed-budget 0.0"),
    (["--lengths=-5,200"], "token counts must be positive"),
    (["--lengths", "0"], "--lengths is empty"), (["--methods", "fastkvzip,magic"], "'magic'"),
    (["--seed", str(2**70)], "is not a seed"), (["--seed", "-1"], "-1 is not a seed"),
    # a StopIteration after config.json was written; a benchmark of 0-token contexts; a shard
    # that ran nothing and said "complete"
    (["--speed-repeats", "0"], "--speed-repeats must be >= 1"),
    (["--batch-length", "0"], "--batch-length must be >= 1"),
    (["--shard", "1/2", "--lengths", "512", "--contexts", "1"], "shard 1 holds none"),
])
def test_bad_bench_flags_exit_2(capsys, flags, words):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(flags)
    assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("flags,words", [
    (["--lengths", "60"], "--lengths 60 is too short for its needles"),
    (["--lengths", "30000", "--chunk-size", "40000"], "no document has the"),
    (["--no-quality", "--speed-lengths", "40000"], "--speed-lengths 40000: with the system prompt"),
])
def test_contexts_that_cannot_be_made_are_refused_before_any_work(real, tmp_path, flags, words):
    with pytest.raises(UsageError, match=words):
        bench.main(["--quick", "--gate", real["gate"], "--no-gpu", "--out", str(tmp_path / "out"),
                    *flags])
    assert (not (tmp_path / "out" / "contexts").exists()
            and not (tmp_path / "out" / "results.json").exists())


def test_peer_column_on_a_tiny_gemma3(tmp_path):
    """The transformers column: the same runs through transformers' own cache, taken in turn with
    full and fastkvzip --speed-repeats times; medians, ratios ours / transformers, and the table in
    results.md."""
    pytest.importorskip("transformers")
    import model as M
    from tests.helpers import tiny_checkpoint
    folder = tiny_checkpoint("gemma3", tmp_path / "tiny", max_position_embeddings=512)
    model = M.load_model(folder, "cpu", torch.float32)
    cfg = model.config
    args = bench.parse_args(["--speed-decode", "3", "--speed-chunk", "32", "--speed-window", "16",
                             "--budgets", "0.3"])
    args.gate = str(tmp_path / "random-gate.safetensors")
    gate_file.save_gate(args.gate, gate.Gates(len(cfg.compressed_layers), cfg.hidden_size,
                                              cfg.num_key_value_heads, cfg.group_size),
                        {"note": "random, tests only"})
    g = torch.Generator().manual_seed(0)
    ids_for = lambda n: ([cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (n,),
                                                            generator=g).tolist(), 1)
    rows, peer = speed.speed(model, None, [80], ids_for, bench.speed_settings(args),
                             peer=speed.load_peer(folder))  # 3 chunks
    assert ([(r["method"], r["budget"], r["repeats"]) for r in rows]
            == [("full", 1.0, 2), ("fastkvzip", 0.3, 2)])
    assert len(peer) == 1 and peer[0]["repeats"] == 2 and peer[0]["context"] == 80
    # transformers keeps every token of the global layer and at most the window of the sliding ones
    L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    assert 81 * H * d * 2 * 4 < peer[0]["kv_bytes"] <= L * 81 * H * d * 2 * 4
    for r in rows + peer:
        assert (len(r["prefill_s_runs"]) == 2 and r["prefill_s"]
                == float(np.median(r["prefill_s_runs"])))
    for r in rows:
        assert r["vs_peer"]["prefill"] == peer[0]["prefill_s"] / r["prefill_s"]
        assert r["vs_peer"]["decode"] == r["decode_tok_s"] / peer[0]["decode_tok_s"] > 0
    md = report.peer_markdown(dict(speed=rows, speed_peer=peer))
    assert sum(line.startswith("| 80 |") for line in md) == 2


def test_bad_shard_and_merge_flags_are_refused(tmp_path, capsys):
    for shard in ("3/2", "x", "1/0"):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--shard", shard])
        assert e.value.code == 2 and f"--shard {shard}: expected k/n" in capsys.readouterr().err
    for flags, words in ((["--suite", "ruler", "--ruler-only", "cwe,bogus"], "give tasks of --ruler-tasks"),
                         (["--suite", "ruler", "--ruler-tasks", "vt", "--ruler-only", "cwe"],
                          "give tasks of --ruler-tasks (vt)"),
                         (["--ruler-only", "cwe"], "add --suite ruler"),
                         (["--dataset", str(tmp_path), "--ruler-only", "cwe"], "run whole")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(flags)
        assert e.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(UsageError, match="needs --out"):
        bench.main(["--merge", str(tmp_path)])
    with pytest.raises(UsageError, match="config.json missing"):
        bench.main(["--merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "merged")])


# ------------------------------------------------------------------------------------ damaged or
# failing outputs

def test_corrupt_json_in_out_or_merge_is_named(tmp_path):
    """A results.json cut short in --out, a corrupt config.json given to --merge: one line naming
    the file and what to do (a JSONDecodeError traceback before)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"quality_key": {}, "command": "bench.py"}))
    # a copy that stopped half-way
    (out / "results.json").write_text('{"config": {"speed_key": {"bud')
    with pytest.raises(UsageError,
                       match=r"out/results.json is not valid JSON .*delete it: the "
                       r"finished contexts"):
        bench.main(["--quick", "--no-gpu", "--no-quality", "--speed-lengths", "0", "--out",
                    str(out)])
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text('{"quality_key": {}, "comm')
    with pytest.raises(UsageError,
                       match=r"a/config.json is not valid JSON .*leave it out of --merge"):
        bench.main(["--merge", str(tmp_path / "a"), "--out", str(tmp_path / "merged")])
    (tmp_path / "a" / "config.json").write_text('[]')
    with pytest.raises(UsageError, match=r"a/config.json holds a JSON list, not a bench result"):
        bench.main(["--merge", str(tmp_path / "a"), "--out", str(tmp_path / "merged")])


def test_full_disk_while_writing_results_says_what_is_kept(tmp_path, monkeypatch, capsys):
    """cli.write_text on a full disk: one line naming the file, the finished contexts kept, how to
    resume; the temporary file removed."""
    import errno
    import os

    import cli
    out = tmp_path / "out"
    (out / "contexts").mkdir(parents=True)
    for c in range(2):
        (out / "contexts" / f"context-{c:03d}.json").write_text("{}")
    real = Path.write_text

    def full(self, *a, **kw):
        if self.name.startswith(".results.json"):
            real(self, "half a fi")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "write_text", full)
    # an --out of the default (a new timestamp folder each run) must be named
    for given in (True, False):
        args = bench.parse_args(["--out", str(out)] if given else [])
        args.out_dir = str(out)
        with pytest.raises(SystemExit) as e:
            cli.main(lambda a: bench.write_results(out, {"rows": []}), args, kept=bench.kept)
        again = "the same command" + ("" if given else f" with --out {out}")
        assert e.value.code == 2 and capsys.readouterr().err == (
            f"error: cannot write {out}/results.json: No space left on device; 2 finished contexts "
            f"are kept in {out}; rerun {again} to resume\n")
        assert sorted(p.name for p in out.iterdir()) == ["contexts"]


def test_sigterm_says_what_is_kept(tmp_path):
    """`python bench.py` stopped by SIGTERM (here as the weights start to load): one line, exit code
    143."""
    import os
    import subprocess
    import sys
    out = tmp_path / "out"
    driver = ("import os, signal, sys, model\n"
              "model.load_model = lambda *a, **kw: os.kill(os.getpid(), signal.SIGTERM)\n"
              "sys.argv[0] = 'bench.py'\n"
              "import runpy; runpy.run_path('bench.py', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", driver, "--quick", "--no-gpu", "--out", str(out)],
                       cwd=bench.ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 143 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == ("interrupted: 0 finished contexts are kept in "
                                                 f"{out}; rerun the "
                                                 f"same command to resume"), (r.stderr)


@pytest.mark.parametrize("budgets", ["0.5,0.5000001", "0.3,0.2,0.30000004", "1,0.9999999"])
def test_budgets_that_print_alike_are_refused(capsys, budgets):
    """--budgets 0.5,0.5000001 ran both and kept one (the results name a budget as printed: one
    column, one row)."""
    for suite in ("needle", "ruler"):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--suite", suite, "--budgets", budgets])
        assert e.value.code == 2 and "they print alike" in capsys.readouterr().err
    assert bench.parse_args(["--budgets", "0.5,0.500001"]).budgets == [0.5, 0.500001]
