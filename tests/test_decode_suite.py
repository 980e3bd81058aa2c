"""The decode suite (bench.py --suite decode, harness/decode.py): block-wise teacher forcing equals
token-by-token decoding, the streams hold what they claim, the summary's arithmetic, the flags."""
import math
from pathlib import Path

import pytest
import torch

import bench
import gate
import generate
import model as M
from gate import Gates
from harness import decode, decode_config, decode_report, decode_suite, stats
from harness.timing import time_scorer
from tests.helpers import tiny_checkpoint
from tests.test_decode_memory import authors_attention, authors_redundancy

# tokens per KV head: above the 4 sinks + 128-token window (else no score is ever used), far below
# the streams, so that the scorer chooses at every 128-token eviction
BUDGET = 192


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    # 1,024 positions: streams of several 128-token decode buffers
    folder = tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param),
                             max_position_embeddings=1024)
    return M.load_model(folder, "cpu", torch.float32)


def spread_gates(cfg):
    torch.manual_seed(0)
    gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                  cfg.group_size)
    with torch.no_grad():  # away from the all-zero init: spread-out scores, no ties
        gates.b.normal_()
        gates.k_base.normal_()
    return gates


def kept_positions(cache):
    return [[cache.layers[i].head_pos(h).tolist() for h in range(cache.layers[i].n_heads)]
            for i in cache.compressed]


def budget_groups(per_layer, level):
    """cache.keep_within_budget's groups of [layer][head] rows, each flattened: one top-k each.
    "calibrated" (one cut over each layer's scores divided by their mean) is one group of the
    same order as "global" where one layer is compressed (the tiny Gemma3's)."""
    if level == "calibrated":
        assert len(per_layer) == 1, "calibrated: a group of scores rescaled per layer"
        level = "global"
    assert level in ("global", "layer", "head"), level
    heads = [s for per_head in per_layer for s in per_head]
    return (heads if level == "head" else [torch.cat(p) for p in per_layer] if level == "layer"
            else [torch.cat(heads)])


def first_free_flip(calls_a, calls_b):
    """Two runs' decode-time evictions, each a list of (n_seen, [(scores, keep) per budget group])
    -> n_seen at the first eviction where the runs may keep other rows, None if they never may.
    Scores that agree to fp32 summation order may swap a near-tie at the cut of a group: a kept and
    a dropped row within 2·(the largest score move) of each other, exact ties included. Anything
    else kept differently fails, and so do scores that moved by more than 1e-4 of their scale."""
    assert len(calls_a) == len(calls_b) > 0
    for (n, groups_a), (n_b, groups_b) in zip(calls_a, calls_b):
        assert n == n_b and len(groups_a) == len(groups_b), "the runs evicted at other points"
        free = False
        for (sa, ka), (sb, kb) in zip(groups_a, groups_b):
            assert sa.shape == sb.shape, f"the runs held other rows at n_seen {n}"
            inf = sa.isinf()
            assert torch.equal(inf, sb.isinf()) and torch.equal(ka[inf], kb[inf])
            x, y = sa[~inf].double(), sb[~inf].double()
            moved = float((x - y).abs().max()) if len(x) else 0.0
            assert moved <= 1e-4 * float(x.abs().max()), f"scores moved by {moved:.2e} (n_seen {n})"
            kept, dropped = sa[ka & ~inf].double(), sa[~ka & ~inf].double()
            if len(kept) and len(dropped):
                near = ((ka & (sa.double() <= dropped.max() + 2 * moved))
                        | (~ka & (sa.double() >= kept.min() - 2 * moved))) & ~inf
            else:
                near = torch.zeros_like(ka)
            assert torch.equal(ka[~near], kb[~near]), f"kept rows differ off the cut (n_seen {n})"
            free |= not torch.equal(ka, kb)
        if free:
            return n
    return None


@pytest.mark.parametrize("method", ["fastkvzip", "streaming", "random", "snapkv", "rkv"])
def test_block_teacher_forcing_equals_token_by_token_decoding(tiny, method, monkeypatch):
    """128 tokens per forward then after_step (the suite's teacher forcing) gives the logits and the
    kept rows of decode_one, token by token, with eviction happening at every buffer."""
    import cache as C
    cfg = tiny.config
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (1000,), generator=g).tolist()
    gates = spread_gates(cfg)
    # every eviction's scores and kept rows, and the token-by-token logits: the two paths sum in
    # other orders, so a near-tie at the cut or between the top two logits may go either way
    calls, logits, n_seen = [], [], []
    evict, keep_within_budget, decode_one = (C.EvictingCache._evict_to_budget,
                                             C.keep_within_budget, generate.decode_one)

    def evict_(self):
        n_seen.append(self.n_seen)
        return evict(self)

    def keep_within_budget_(scores, budget, level):
        keep = keep_within_budget(scores, budget, level)
        calls[-1].append((n_seen[-1], list(zip(budget_groups(scores, level),
                                               budget_groups(keep, level)))))
        return keep

    def decode_one_(*a, **kw):
        out = decode_one(*a, **kw)
        logits.append(out.float())
        return out

    monkeypatch.setattr(C.EvictingCache, "_evict_to_budget", evict_)
    monkeypatch.setattr(C, "keep_within_budget", keep_within_budget_)
    monkeypatch.setattr(generate, "decode_one", decode_one_)
    runs = {}
    for block in (True, False):
        calls.append([])
        cache = decode.decode_cache(tiny, method, 2, BUDGET, gates, seed=5)
        nll, hit = decode.teacher_force(tiny, cache, ids, 40, 2, block=block)
        runs[block] = nll, hit, kept_positions(cache), cache.n_seen
    (nb, hb, kb, sb), (nt, ht, kt, st) = runs[True], runs[False]
    assert sb == st == len(ids) - 1  # every token but the last was fed
    flip = first_free_flip(*calls)
    # the prediction for ids[40 + j] was made having seen 40 + j tokens: up to a near-tie that went
    # the other way at the cut, both runs held the same rows (after it, the runs part)
    same = len(nb) if flip is None else flip - 40 + 1
    if flip is None:
        assert kb == kt, "the kept rows differ"
    torch.testing.assert_close(nb[:same], nt[:same], atol=1e-4, rtol=1e-4)
    # the first prediction comes from begin_answer (one path); the others from decode_one here
    assert len(logits) == len(nt) - 1
    top2 = torch.stack(logits).topk(2, -1).values
    clear = torch.cat([torch.tensor([True]), top2[:, 0] - top2[:, 1] > 1e-4])[:same]
    assert clear.float().mean() > 0.9
    assert torch.equal(hb[:same][clear], ht[:same][clear])
    # eviction happened, and chose: at most the budget plus one buffer per head, and rows outside
    # the sinks and the last window were dropped
    assert sum(len(h) for layer in kb for h in layer) <= (BUDGET + 128) * len(kb) * len(kb[0])
    middle = [p for layer in kb for h in layer for p in h if 4 <= p < sb - 128]
    assert 0 < len(middle) < (sb - 132) * len(kb) * len(kb[0])


def test_teacher_forcing_matches_a_plain_forward(tiny):
    """The full cache's teacher-forced NLL is the NLL of one forward over the whole sequence."""
    cfg = tiny.config
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, cfg.vocab_size, (300,), generator=g).tolist()
    nll, hit = decode.teacher_force(tiny, decode.decode_cache(tiny, "full", 0, None, None, 0),
                                    ids, 10, 0)
    with torch.no_grad():
        logits = tiny(torch.tensor(ids), generate.make_cache("full", tiny, 0))
    logp = torch.log_softmax(logits, -1)
    want = -logp[torch.arange(9, len(ids) - 1), torch.tensor(ids[10:])]
    torch.testing.assert_close(nll, want, atol=1e-4, rtol=1e-4)
    # the argmax of another summation order: it may differ only where the top two logits of the
    # plain forward are within the logits' own rounding apart (the nll's 1e-4)
    top2 = logits[9:-1].topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > 1e-4
    assert clear.float().mean() > 0.9  # the comparison covers nearly every position
    assert torch.equal(hit[clear],
                       (logits[9:-1].argmax(-1) == torch.tensor(ids[10:])).float()[clear])


# ------------------------------------------------------------------------- streams and summaries

@pytest.fixture(scope="module")
def smollm2_tok():
    from cli import resolve_model
    from tests.assets import require_asset
    require_asset("austen_parts")
    return M.load_tokenizer(resolve_model("smollm2-135m-gguf"))


def test_streams_hold_their_facts_where_they_claim(smollm2_tok):
    """Every probe's answer tokens spell the value its fact stated, at least `gap` tokens after the
    statement; the nll task's positions are document tokens, in order, none inside a fact."""
    from prompts import PromptFormat
    tok = smollm2_tok
    exp = decode.DecodeExperiment(methods=["full"], budgets=[256], contexts=2, length=2000,
                                  gaps=[300, 900, 1500], prompt_tokens=64, generations=0,
                                  gen_tokens=1, gen_budgets=[], seed=3)
    streams = decode.make_streams(tok, PromptFormat("", ""), exp)  # plain text, no BOS
    assert len(streams) == 2 and streams[0].doc != streams[1].doc
    for s in streams:
        assert len(s.ids) == 2000 and s.n_prompt == s.n_protected + 64
        assert sorted(g for g, _, _ in s.probes) == [300, 900, 1500]
        for gap, pos, stated in s.probes:
            value = tok.decode([s.ids[p] for p in pos]).strip()
            # the statement ends with the value and a full stop; the question comes gap later
            assert tok.decode(s.ids[stated - 8:stated]).endswith(f" is {value}.")
            assert pos[0] - stated >= gap
            assert tok.decode(s.ids[pos[0] - 4:pos[0]]).endswith(" is")
        inside = {p for _, pos, _ in s.probes for p in pos}
        assert not inside & set(s.doc_pos) and s.doc_pos == sorted(s.doc_pos)


def test_streams_come_from_the_text_asked_and_an_austen_run_keeps_its_key(smollm2_tok):
    """--text prose: every stream's document tokens are a held-out prose text's, in order; the
    experiment's key names the text only when it is not Austen (earlier folders resume)."""
    from dataclasses import replace

    from harness import quality
    from prompts import PromptFormat
    args = bench.parse_args(["--suite", "decode", "--text", "prose", "--lengths", "2000",
                             "--decode-gaps", "300,900", "--contexts", "2"])
    exp = decode_suite.experiment(args)
    assert exp.text == "prose"
    prose = dict(quality.load_docs(smollm2_tok, "prose"))
    streams = decode.make_streams(smollm2_tok, PromptFormat("", ""), exp)
    assert len(streams) == 2
    for s in streams:
        assert [s.ids[p] for p in s.doc_pos] == prose[s.doc][:len(s.doc_pos)]
    config = dict(model=dict(sha256="m"), gate=dict(sha256="g", source="g"), flags=dict(model="m"),
                  git_commit="c" * 40, git_dirty=False, started="t")
    for text, words in (("prose", "(held-out prose texts of the gates' corpus)"),
                        ("austen", "(held-out Austen chapters)")):
        key = decode.run_key(replace(exp, text=text), config)
        assert key.get("text") == (None if text == "austen" else text)
        assert words in decode_report.header(dict(config=dict(config, quality_key=key)))[2]


def fake_records():
    """Three documents: the gate at 256 loses NLL and one answer; cut answers nothing (as records
    written before cut was run held it), and its generation stopped at 200 tokens."""
    recs = []
    for c, (s_m, s_f, n) in enumerate([(30.0, 20.0, 10), (50.0, 45.0, 20), (12.0, 12.0, 6)]):
        full_probes = [[512, 2, 2.0, 1.0, 1.0], [1024, 3, 3.0, 2.0, 2.0]]
        gate_probes = [[512, 2, 2.0, 1.5, 1.0], [1024, 3, float(c != 0), 6.0, 2.0]]
        recs.append(dict(context=c, doc=f"d{c}", n_tokens=2000, seconds=1.0, entries={
            "full": dict(nll=[s_f, n, s_f], probes=full_probes,
                         gen=dict(first_diff=100, same=True, correct=c == 1)),
            "fastkvzip@256": dict(nll=[s_m, n, s_f], probes=gate_probes, kept_nbytes=10,
                                  gen=dict(first_diff=10 * (c + 1), same=c == 2, correct=False)),
            "cut@256": dict(nll=None, probes=[[512, 2, 0.0, None, 1.0], [1024, 3, 0.0, None, 2.0]],
                            gen=dict(first_diff=200, same=False, correct=False, stopped=True))}))
    return recs


def test_summary_is_ratios_of_sums_with_intervals_over_documents():
    res = decode_report.results(fake_records(), n_boot=500, seed=0)
    row = lambda task, m, **kw: next(r for r in res["rows"] if r["task"] == task
                                     and r["method"] == m
                                     and all(r.get(k) == v for k, v in kw.items()))
    nll = row("nll", "fastkvzip")
    assert nll["budget"] == 256 and nll["n"] == 36
    assert math.isclose(nll["score"], math.exp((77 - 92) / 36))  # exp(NLL_full - NLL)
    # its interval: the ratio estimator's linearized standard error, Student t with 2 dof
    y, x, r = [-10.0, -5.0, 0.0], [10, 20, 6], -15 / 36
    se = math.sqrt(sum((a - r * b) ** 2 for a, b in zip(y, x)) / 2) / math.sqrt(3) / 12
    assert nll["ci"] == pytest.approx([math.exp(r - 4.302653 * se), math.exp(r + 4.302653 * se)])
    assert "ci_boot" not in nll and res["interval"] == dict(kind="t", n=3, level=0.95,
                                                            bootstrap=False)
    assert row("nll", "cut")["score"] is None  # it never scores a token past its budget
    rec = row("recall", "fastkvzip", gap=None)
    assert math.isclose(rec["score"], (2 + 0 + 2 + 1 + 2 + 1) / 15)  # answer tokens right
    assert math.isclose(rec["exact"], 3 / 6)  # answers with every token right: the gap-512 ones
    assert math.isclose(row("recall", "fastkvzip", gap=512)["score"], 1.0)
    assert math.isclose(rec["nll_ratio"], math.exp((9 - 22.5) / 15))
    assert row("recall", "cut", gap=None)["score"] == 0 and "nll" not in row("recall", "cut")
    assert row("recall", "full", gap=None)["score"] == 1.0
    gen = row("generation", "fastkvzip")
    assert gen["first_diff"] == 20 and math.isclose(gen["same"], 1 / 3) and gen["n"] == 3
    assert row("generation", "full")["correct"] == pytest.approx(1 / 3)
    md = "\n".join(decode_report.markdown(res))
    assert "| fastkvzip | 256 |" in md and "| cut | 256 | n/a |" in md
    assert "Student-t interval over the n = 3 documents (2 degrees of freedom" in md


@pytest.mark.parametrize("method", ["fastkvzip", "rkv"])
def test_scorer_clock_times_the_scorer_and_changes_nothing(tiny, method):
    """The harness's own timer around the scorer: its seconds grow with every scoring call, and
    the cache keeps the rows and gives the logits it gives untimed."""
    cfg = tiny.config
    ids = torch.randint(3, cfg.vocab_size, (500,), generator=torch.Generator().manual_seed(3))
    gates, out = spread_gates(cfg), []
    for timed in (False, True):
        cache = decode.decode_cache(tiny, method, 0, BUDGET, gates, 0)
        clock = time_scorer(cache.scorer, cache.device) if timed else None
        nll, _ = decode.teacher_force(tiny, cache, ids.tolist(), 20, 0)
        out.append((nll, kept_positions(cache)))
    assert clock.seconds > 0
    assert out[0][1] == out[1][1] and torch.equal(out[0][0], out[1][0])


@pytest.mark.parametrize("flags, words", [
    (["--decode-budgets", "0"], "--decode-budgets is empty"),
    (["--decode-budgets", "-5"], "token counts must be positive"),
    (["--methods", "full,kvzip"], "--methods 'kvzip': 'kvzip' scores the context once and "
                                  "cannot evict while decoding"),
    # configurations (harness/decode_config.py): each wrong part named, before any work
    (["--methods", "fastkvzip@pair"], "--methods 'fastkvzip@pair': unknown level 'pair'"),
    (["--methods", "rkv/8"], "--methods 'rkv/8': the window is /wN with N >= 1"),
    (["--methods", "rkv@head/w0"], "--methods 'rkv@head/w0': the window is /wN with N >= 1"),
    (["--methods", "full@head"], "--methods 'full@head': full evicts nothing"),
    (["--methods", "cut/w8"], "--methods 'cut/w8': cut evicts nothing"),
    (["--methods", "split@head"], "--methods 'split@head': split keeps whole heads"),
    (["--methods", "gate@head"], "--methods 'gate@head': 'gate' is no method"),
    (["--lengths", "2000,3000"], "takes one stream length"),
    (["--lengths", "3000"], "too short for --decode-gaps"),
    (["--decode-gen-tokens", "0"], "--decode-gen-tokens must be >= 1"),
    (["--contexts", "2", "--shard", "3/4"], "shard 3 holds none"),
    (["--decode-budgets", "256,512", "--decode-gen-budgets", "1024"], "one of --decode-budgets"),
    # a recall with no fact, a device that is no device, a prompt that leaves no room: named
    (["--decode-gaps", "0"], "--decode-gaps 0 asks no fact"),
    (["--device", "cuda:x"], "--device cuda:x: cpu, cuda or cuda:N"),
    (["--device", "gpu"], "--device gpu: cpu, cuda or cuda:N"),
    (["--decode-prompt", "5000"], "--decode-prompt 5000"),
    (["--out", ""], "--out '' names no folder"),
    # other suites' flags are refused, not ignored
    (["--budgets", "0.5"], "--budgets: --suite decode does not read it (its budgets are "
                           "--decode-budgets"),
    (["--window", "64"], "--window: --suite decode does not read it"),
    (["--ruler-only", "niah_single_1"], "--ruler-only: --suite decode does not read it"),
    (["--speed-budget", "0.5"], "--speed-budget: --suite decode does not read it"),
    (["--quick"], "--quick: --suite decode does not read it"),
])
def test_bad_decode_flags_exit_2(capsys, flags, words):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--suite", "decode", *flags])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_decode_flags_under_another_suite_are_refused(capsys):
    for flags in (["--decode-budgets", "256"], ["--suite", "ruler", "--decode-gaps", "512"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(flags)
        assert e.value.code == 2 and "is a flag of --suite decode" in capsys.readouterr().err


def test_decode_defaults_and_explicit_flags():
    args = bench.parse_args(["--suite", "decode"])
    assert args.methods == list(decode.METHODS) and args.lengths == [decode.LENGTH]
    assert args.speed_lengths == [1024, 2048, 4096, 8192] and args.decode_budgets == [256, 512,
                                                                                      1024, 2048]
    assert args.decode_generations == args.contexts
    args = bench.parse_args(["--suite", "decode", "--methods", "fastkvzip", "--lengths", "1600",
                             "--decode-gaps", "512,1024", "--speed-lengths", "0"])
    assert args.methods == ["full", "fastkvzip"] and args.speed_lengths == []


def test_speed_rows_and_the_peer_on_a_tiny_gemma3(tmp_path):
    """The speed section end to end on a tiny Gemma3: a row per length for the full cache, the gate
    and transformers' generate; the budget's KV stays flat while the full cache's grows; the
    report's table and plot are written."""
    pytest.importorskip("transformers")
    from cli import pyplot as cli_pyplot
    from harness.speed import load_peer
    folder = tiny_checkpoint("gemma3", tmp_path / "tiny", max_position_embeddings=1024)
    model = M.load_model(folder, "cpu", torch.float32)
    cfg = model.config
    prompt = [cfg.bos_token_id] + list(range(3, 40))
    rows = decode_suite.speed(model, load_peer(folder), prompt, 1, [300, 600, 900], [160],
                               spread_gates(cfg), 0)
    by = lambda m: [r for r in rows if r["method"] == m]
    assert [r["length"] for r in by("full")] == [300, 600, 900] == [r["length"]
                                                                  for r in by("transformers")]
    gate_rows, full_rows = by("fastkvzip"), by("full")
    assert [r["length"] for r in gate_rows] == [300, 600, 900]
    assert all(r["ms_per_token"] > 0 for r in rows)
    # the gate's cache is bounded by its budget (+ a buffer per head), the full cache's grows
    H, row = cfg.num_key_value_heads, 2 * cfg.head_dim * 4  # fp32 keys and values
    sliding = sum(t == "sliding_attention" for t in cfg.layer_types)
    bound = ((160 + 128) * H * len(cfg.compressed_layers) + cfg.sliding_window * H * sliding) * row
    assert all(r["kv_kept_bytes"] <= bound < full_rows[2]["kv_kept_bytes"] for r in gate_rows)
    # the full cache reserves its whole answer at begin_answer: nothing regrows on the way
    assert full_rows[0]["kv_bytes"] == full_rows[2]["kv_bytes"]
    assert full_rows[0]["kv_kept_bytes"] < full_rows[1]["kv_kept_bytes"] < full_rows[2][
        "kv_kept_bytes"]
    assert all(0 < r["score_share"] < 1 for r in gate_rows)
    assert all(r["score_share"] is None for r in full_rows)
    assert by("transformers")[2]["kv_bytes"] > by("transformers")[0]["kv_bytes"]
    res = dict(rows=[], decode_speed=rows)
    md = "\n".join(decode_report.markdown(res))
    assert md.count("| fastkvzip | 160 |") == 3 and "| transformers | – | 900 |" in md
    decode_report.plot(res, tmp_path / "decode.png")
    assert (tmp_path / "decode.png").exists() or cli_pyplot() is None  # matplotlib may be missing


def fake_run(folder, key, records=(), speed=None, no_quality=False):
    import json
    (folder / "contexts").mkdir(parents=True)
    config = dict(flags=dict(model="m", no_quality=no_quality), quality_key=key, command="bench.py",
                  started="t", gate=dict(source=None, sha256=None), git_commit="0" * 10,
                  git_dirty=False)
    (folder / "config.json").write_text(json.dumps(config))
    for r in records:
        (folder / "contexts" / f"context-{r['context']:03d}.json").write_text(
            json.dumps({**r, "key": key}))
    (folder / "results.json").write_text(json.dumps(dict(config=config, decode_speed=speed,
                                                         seconds=5.0)))
    return folder


KEY = dict(suite="decode", contexts=3, length=2000, prompt_tokens=64, budgets=[256],
           gaps=[512, 1024], generations=3, gen_tokens=100, seed=0, model="m", gate="g")
SPEED = [dict(method="full", budget=None, length=1024, ms_per_token=5.0, score_share=None,
              kv_bytes=10, kv_kept_bytes=10)]


def test_merge_refuses_speed_rows_of_another_model_or_gate(tmp_path):
    """A speed-only run was compared by suite alone: its rows, measured on another checkpoint or
    gate, were filed under the first run's model."""
    from cli import UsageError
    a = fake_run(tmp_path / "a", KEY, fake_records())
    for what, key in (("model", dict(KEY, model="other")), ("gate", dict(KEY, gate="other"))):
        s = fake_run(tmp_path / what, dict(key, contexts=1), speed=SPEED, no_quality=True)
        with pytest.raises(UsageError, match=f"{s} is a run of another experiment .*\\({what} "
                                             f"differ\\); leave {s} out of --merge"):
            bench.main(["--merge", f"{a},{s}", "--out", str(tmp_path / "m"), "--bootstrap", "10"])
    assert not (tmp_path / "m").exists()


def damage_decode(folder, kind):
    import json
    rec, config = folder / "contexts" / "context-000.json", folder / "config.json"
    edit = lambda path, fn: path.write_text(json.dumps(fn(json.loads(path.read_text()))))
    if kind == "a record without entries":
        edit(rec, lambda r: {k: v for k, v in r.items() if k != "entries"})
    elif kind == "a record with malformed entries":
        edit(rec, lambda r: dict(r, entries={"full": dict(nll=[1.0], probes="x")}))
    elif kind == "a record whose seconds are not a number":
        edit(rec, lambda r: dict(r, seconds="1 h"))
    elif kind == "config.json without flags":
        edit(config, lambda c: {k: v for k, v in c.items() if k != "flags"})
    elif kind == "config.json without started":
        edit(config, lambda c: {k: v for k, v in c.items() if k != "started"})
    elif kind == "results.json seconds that are not a number":
        edit(folder / "results.json", lambda r: dict(r, seconds="1 h"))
    elif kind == "speed rows that are not objects":
        edit(folder / "results.json", lambda r: dict(r, decode_speed=[1, 2]))
    elif kind == "contexts a file":
        for p in (folder / "contexts").iterdir():
            p.unlink()
        (folder / "contexts").rmdir()
        (folder / "contexts").write_text("x")
    return {"contexts a file": folder / "contexts", "config.json without flags": config,
            "config.json without started": config}.get(
        kind, folder / "results.json" if "results.json" in kind or "speed" in kind else rec)


@pytest.mark.parametrize("kind", [
    "a record without entries", "a record with malformed entries",
    "a record whose seconds are not a number", "config.json without flags",
    "config.json without started", "results.json seconds that are not a number",
    "speed rows that are not objects", "contexts a file"])
def test_a_damaged_decode_run_folder_is_one_line_naming_the_file(tmp_path, kind):
    """Each was a KeyError, TypeError or IndexError traceback (or, contexts a file, a merge that
    silently dropped the run's documents)."""
    from cli import UsageError
    a = fake_run(tmp_path / "a", KEY, fake_records()[:1], speed=SPEED)
    bad = damage_decode(a, kind)
    with pytest.raises(UsageError) as e:
        bench.main(["--merge", str(a), "--out", str(tmp_path / "m"), "--bootstrap", "10"])
    assert str(bad) in str(e.value) and ("delete it" in str(e.value) or "out of --merge" in
                                         str(e.value) or "move it away" in str(e.value))
    assert not (tmp_path / "m").exists()


def test_a_failed_merge_removes_what_it_wrote_and_can_be_rerun(tmp_path, monkeypatch):
    """A full disk at results.md left results.json in the (existing, empty) --out, and the next
    merge refused the folder for it."""
    import cli
    a = fake_run(tmp_path / "a", KEY, fake_records())
    out = tmp_path / "m"
    out.mkdir()
    real = Path.write_text

    def full(self, *a, **kw):
        if self.name.startswith(".results.md"):
            raise OSError(28, "No space left on device")
        return real(self, *a, **kw)
    monkeypatch.setattr(Path, "write_text", full)
    for _ in range(2):  # the second fails for the same reason, not for the first one's files
        with pytest.raises(cli.WriteError, match="results.md: No space left on device"):
            bench.main(["--merge", str(a), "--out", str(out), "--bootstrap", "10"])
        assert list(out.iterdir()) == []


@pytest.fixture(scope="module")
def tiny_decode(tmp_path_factory):
    """bench.py --suite decode's flags for a tiny random Gemma3 (1,024 positions) and its gate:
    one 900-token stream, streaming at 160, speed to 600 positions (seconds)."""
    pytest.importorskip("transformers")
    from tests.assets import require_asset
    from tests.test_saved_cache import tiny_setup
    require_asset("austen_parts")
    t = tiny_setup("gemma3", tmp_path_factory.mktemp("tiny") / "model")
    return ["--suite", "decode", "--model", str(t["folder"]), "--gate", str(t["gate_file"]),
            "--lengths", "900", "--decode-gaps", "256", "--decode-prompt", "16", "--contexts",
            "1", "--decode-budgets", "160", "--methods", "streaming", "--decode-gen-tokens", "16",
            "--no-peer", "--decode-speed-budgets", "160", "--speed-lengths", "300,600",
            "--bootstrap", "10"]


def short_text(tok, text="austen"):
    """Austen's first chapter, cut short, twice: two documents enough for one 900-token stream
    each (tokenizing all of Austen with the tiny tokenizer takes seconds)."""
    from offline import fetch_assets
    from prompts import encode_text
    first = sorted(fetch_assets.text_docs("austen_parts"))[0]
    ids = encode_text(tok, first.read_text(encoding="utf-8")[:6000])
    return [("c0", ids), ("c1", list(ids))]


@pytest.mark.parametrize("flags, words", [
    (["--speed-lengths", "10"], "--speed-lengths 10: not past the speed run's prompt"),
    (["--speed-lengths", "300,17"], "--speed-lengths 17: not past the speed run's prompt"),
    (["--decode-budgets", "900"], "--decode-budgets 900: not below --lengths 900"),
    (["--decode-budgets", "160,5000"], "--decode-budgets 5000: not below --lengths 900"),
    (["--decode-speed-budgets", "600"], "--decode-speed-budgets 600: not below --speed-lengths"),
    (["--decode-budgets", "1"], "--decode-budgets 1 leaves nothing to the scorer"),
    (["--decode-budgets", "100,160", "--methods", "fastkvzip"],
     "--decode-budgets 100 leaves nothing to the scorer: fastkvzip"),
    (["--decode-speed-budgets", "20"], "--decode-speed-budgets 20 leaves nothing to the scorer"),
    (["--contexts", "3", "--decode-generations", "0"], "--contexts 3: only 2 Austen chapters"),
])
def test_decode_values_that_measure_nothing_are_refused_before_the_model_and_out(
        tiny_decode, tmp_path, monkeypatch, flags, words):
    """Each ran (and was reported), or failed mid-run, or after config.json was written; now one
    line before the weights load, nothing written into --out (here an existing empty folder)."""
    from cli import UsageError

    def reached(*a, **k):
        raise AssertionError("the weights were loaded: the refusal came late")
    monkeypatch.setattr(decode_suite, "load_checked", reached)
    monkeypatch.setattr(decode, "load_docs", short_text)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UsageError, match="use at least|give|ask fewer") as e:
        bench.main([*tiny_decode, *flags, "--out", str(out)])
    assert words in str(e.value)
    assert list(out.iterdir()) == []


def test_cuda_without_cuda_is_refused_before_out(tiny_decode, tmp_path):
    from model import ModelError
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ModelError, match=f"--device {device}: CUDA is not available"):
            bench.main([*tiny_decode, "--device", device, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_rerun_without_speed_lengths_keeps_the_speed_rows(tiny_decode, tmp_path, monkeypatch):
    """--speed-lengths 0 (to resume, or for --plot) threw away the rows the folder's run measured:
    they were kept only if the settings, lengths included (now none), were equal."""
    import json
    monkeypatch.setattr(decode_suite, "load_docs", short_text)  # the speed prompt's text
    out = str(tmp_path / "out")
    bench.main([*tiny_decode, "--no-quality", "--out", out])
    first = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["length"] for r in first["decode_speed"]] == [300, 600, 300, 600]
    for other in ([], ["--decode-speed-budgets", "300"]):  # not measured again: kept as measured
        bench.main([*tiny_decode, "--no-quality", "--speed-lengths", "0", *other, "--out", out])
        res = json.loads((tmp_path / "out" / "results.json").read_text())
        assert res["decode_speed"] == first["decode_speed"]
        assert res["config"]["speed_key"] == first["config"]["speed_key"]
        assert "[300, 600]" in (tmp_path / "out" / "results.md").read_text()


def test_merge_joins_shards_and_a_speed_run(tmp_path):
    import json

    from cli import UsageError
    key = dict(suite="decode", contexts=3, length=2000, prompt_tokens=64, budgets=[256],
               gaps=[512, 1024], generations=3, gen_tokens=100, seed=0)
    recs = fake_records()
    speed = [dict(method="full", budget=None, length=1024, ms_per_token=5.0, score_share=None,
                  kv_bytes=10, kv_kept_bytes=10)]
    a = fake_run(tmp_path / "a", key, [recs[0], recs[2]])
    b = fake_run(tmp_path / "b", key, [recs[1]])
    c = fake_run(tmp_path / "c", dict(key, contexts=1), speed=speed, no_quality=True)
    bench.main(["--merge", f"{a},{b},{c}", "--out", str(tmp_path / "m")])
    res = json.loads((tmp_path / "m" / "results.json").read_text())
    assert res["complete"] and res["n_contexts"] == 3 and res["decode_speed"] == speed
    assert res["rows"] == json.loads(json.dumps(decode_report.results(recs, 2000, 0)["rows"]))
    assert "| full | – | 1024 | 5.0 |" in (tmp_path / "m" / "results.md").read_text()
    other = fake_run(tmp_path / "o", dict(key, seed=1), [recs[1]])
    with pytest.raises(UsageError, match="another experiment .* leave .* out of --merge"):
        bench.main(["--merge", f"{a},{other}", "--out", str(tmp_path / "m2")])
    (Path(a) / "results.json").write_text("{")  # damaged: one line, no traceback
    with pytest.raises(UsageError, match="results.json is unreadable; leave .* out of --merge"):
        bench.main(["--merge", f"{a},{b}", "--out", str(tmp_path / "m3")])
    assert not (tmp_path / "m3").exists()


def test_a_speed_only_run_reports_its_speed_section_alone(tmp_path, monkeypatch):
    """A --no-quality run's results.md said '0 of N documents ... recall gaps ...' and decode.png
    drew two empty quality panels: its header now tells the speed run, its plot the speed panels."""
    key = dict(suite="decode", contexts=6, length=6600, prompt_tokens=64, budgets=[256],
               gaps=[1024], generations=6, gen_tokens=2048, seed=0)
    config = dict(flags=dict(model="m", no_quality=True), quality_key=key, started="t",
                  speed_key=dict(lengths=[1024, 2048], budgets=[512]), git_commit="0" * 10,
                  gate=dict(source=None, sha256=None), git_dirty=False)
    speed = [dict(method=m, budget=b, length=n, ms_per_token=5.0, score_share=None,
                  kv_bytes=10, kv_kept_bytes=10) for m, b in (("full", None), ("fastkvzip", 512))
             for n in (1024, 2048)]
    res = dict(config=config, decode_speed=speed, complete=True, seconds=60)
    head = " ".join(decode_report.header(res))
    assert "Speed and memory only" in head and "[1024, 2048]" in head and "[512]" in head
    assert "documents" not in head and "recall" not in head
    full = " ".join(decode_report.header(dict(res, config=dict(config, flags=dict(model="m")))))
    assert "0 of 6 documents" in full and "recall gaps [1024]" in full
    figures = []
    monkeypatch.setattr(decode_report, "save_figure", lambda fig, path: figures.append(fig))
    if decode_report.pyplot() is None:
        pytest.skip("matplotlib is not installed")
    decode_report.plot(res, tmp_path / "decode.png")
    quality = decode_report.results(fake_records(), 50, 0)["rows"]
    decode_report.plot(dict(res, decode_speed=[], rows=quality), tmp_path / "q.png")
    titles = [[ax.get_title() for ax in fig.axes] for fig in figures]
    assert titles == [["decode speed", "KV memory"],
                      ["NLL ratio past the budget (1 = full)", "recall: answer tokens right"]]


# ------------------------------------------------------------ intervals, paired comparisons

# two-sided 95% (p = 0.975) and one-sided 95% (p = 0.95) Student-t quantiles as printed in the
# NIST/SEMATECH e-Handbook of Statistical Methods, §1.3.6.7.2 (critical values of the t
# distribution), to the 3 decimals printed there
T_TABLE = [(0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 4, 2.776), (0.975, 9, 2.262),
           (0.975, 19, 2.093), (0.975, 30, 2.042), (0.975, 60, 2.000), (0.975, 100, 1.984),
           (0.95, 4, 2.132), (0.95, 10, 1.812), (0.99, 5, 3.365), (0.995, 3, 5.841)]


@pytest.mark.parametrize("p, dof, t", T_TABLE)
def test_t_quantiles_match_the_printed_table(p, dof, t):
    assert round(stats.t_quantile(p, dof), 3) == t
    assert math.isclose(stats.t_quantile(1 - p, dof), -stats.t_quantile(p, dof))


def test_t_cdf_matches_its_closed_forms():
    """1 and 2 degrees of freedom have closed forms (Cauchy: 1/2 + atan(t)/pi; 1/2 + t/(2 sqrt(2 +
    t^2))), and I_x(a, 1) = x^a, I_x(1, b) = 1 - (1 - x)^b."""
    for t in (-30.0, -2.5, -0.3, 0.0, 0.7, 4.0, 100.0):
        assert math.isclose(stats.t_cdf(t, 1), 0.5 + math.atan(t) / math.pi,
                            abs_tol=1e-12)
        assert math.isclose(stats.t_cdf(t, 2), 0.5 + t / (2 * math.sqrt(2 + t * t)),
                            abs_tol=1e-12)
    for x in (0.01, 0.3, 0.5, 0.9, 0.999):
        assert math.isclose(stats.betainc(3.5, 1, x), x ** 3.5, rel_tol=1e-12)
        assert math.isclose(stats.betainc(1, 2.5, x), 1 - (1 - x) ** 2.5, rel_tol=1e-12)


def paired_records(gate, other):
    """Documents whose gate and `other` method at 256 have the given recall (one 10-token probe)
    and NLL ratios exp(-g/10) (NLL sums over 10 tokens, the full cache's 0)."""
    entry = lambda nll, hits: dict(nll=[nll, 10, 0.0], probes=[[512, 10, hits, 1.0, 1.0]])
    return [dict(context=c, doc=f"d{c}", n_tokens=100, seconds=1.0, entries={
        "full": dict(nll=[0.0, 10, 0.0], probes=[[512, 10, 10.0, 1.0, 1.0]]),
        "fastkvzip@256": entry(*g), "streaming@256": entry(*o)})
        for c, (g, o) in enumerate(zip(gate, other))]


def test_paired_differences_are_per_document_with_t_intervals():
    """Against a naive computation: per document, the gate's NLL ratio and recall minus the
    method's; their mean ± t_{0.975, n-1} · sd / sqrt(n) (t from the printed table); a verdict
    per comparison."""
    gate = [(1.0, 9.0), (2.0, 8.0), (0.5, 9.0), (1.5, 7.0), (1.0, 10.0)]
    other = [(2.0, 5.0), (2.5, 9.0), (2.0, 4.0), (2.0, 6.0), (3.0, 3.0)]
    res = decode_report.results(paired_records(gate, other), n_boot=100, seed=0)
    rows = {r["task"]: r for r in res["paired"]}
    assert set(rows) == {"nll", "recall"} and all(r["method"] == "streaming" and r["budget"] == 256
                                                 and r["n"] == 5 for r in rows.values())
    for task, value in (("nll", lambda e: math.exp(-e[0] / 10)), ("recall", lambda e: e[1] / 10)):
        d = [value(g) - value(o) for g, o in zip(gate, other)]
        mean = sum(d) / 5
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
        half = 2.776 * sd / math.sqrt(5)
        assert rows[task]["diff"] == pytest.approx(mean)
        assert rows[task]["ci"] == pytest.approx([mean - half, mean + half], abs=2e-3 * half)
    # recall: +0.32 ± 0.40 holds 0; nll: the gate's ratio above the other's in every document
    assert rows["recall"]["verdict"] == "tie" and rows["nll"]["verdict"] == "gate better"
    worse = decode_report.results(paired_records(other, gate), 100, 0)["paired"]
    assert [r["verdict"] for r in worse] == ["gate worse", "tie"]
    md = "\n".join(decode_report.markdown(res))
    assert "paired by document" in md and "n = 5 differences" in md
    assert "| 256 | streaming | +" in md and "gate better |" in md and "tie |" in md
    # from 20 documents the bootstrap is kept beside the t-interval
    many = decode_report.results(paired_records(gate * 4, other * 4), 200, 0)
    assert all("ci_boot" in r for r in many["paired"]) and many["interval"]["bootstrap"]
    # one document: no interval, a tie
    one = decode_report.results(paired_records(gate[:1], other[:1]), 100, 0)
    assert all(r["ci"] is None and r["verdict"] == "tie" for r in one["paired"])


def test_results_md_names_every_commit_its_documents_ran_at(tmp_path):
    """A resumed run's results.md named one commit (config.json's, rewritten at each start) while
    its documents came from several; records written before each kept its own are 'unrecorded'."""
    recs = fake_records()
    for r, commit in zip(recs, ("a" * 40, "b" * 40, None)):
        if commit:
            r["provenance"] = dict(git_commit=commit, git_dirty=commit == "b" * 40, started="t")
    a = fake_run(tmp_path / "a", KEY, recs)
    bench.main(["--merge", str(a), "--out", str(tmp_path / "m"), "--bootstrap", "10"])
    md = (tmp_path / "m" / "results.md").read_text()
    assert ("documents run at commit aaaaaaaaaa (1 document), commit bbbbbbbbbb (dirty) "
            "(1 document), unrecorded commit (1 document)") in md


@pytest.mark.parametrize("folder", sorted(
    p.parent.name for p in (Path(__file__).resolve().parent.parent / "benchmarks"
                            / "decode-cpu").glob("*/results.json")))
def test_committed_decode_results_still_render(folder):
    """The committed runs' results.json render with today's report: those from before the
    t-intervals and provenance (rows with bootstrap intervals, no per-document records) say what
    they lack; the others name their documents' commits and their interval."""
    import json
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "decode-cpu" / folder
    res = json.loads((path / "results.json").read_text())
    md = "\n".join(decode_report.header(res) + decode_report.markdown(res))
    if res.get("provenance"):
        assert "documents run at commit" in md and "Student-t interval over the n = " in md
    elif res.get("rows"):
        assert res["config"]["git_commit"][:10] in md
        assert "which commit ran each document was not recorded" in md
        assert "[95% bootstrap interval over documents.]" in md
        assert "paired by document" not in md  # it needs the documents' records
    else:
        assert res["config"]["git_commit"][:10] in md


# ------------------------------------------------------------------ cut, as the authors run it

def cut_stream(cfg, n=700, seed=4):
    """Random ids with two probes (a 6-token question, a 2- and a 3-token answer) at positions 300
    and 600, a 20-token prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
    probes = [(200, [306, 307], 100), (500, [606, 607, 608], 100)]
    return decode.Stream(ids=ids, n_prompt=20, n_protected=0, doc_pos=list(range(20, n)),
                         probes=probes, doc="d", questions={306: 300, 606: 600})


def plain_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids), generate.make_cache("full", model, 0))  # (T, vocab)


def test_cut_asks_a_probe_past_its_budget_at_the_budget(tiny):
    """Against a plain forward: at budget 450 the first probe (its answer ends at 307) is the full
    cache's, the second (question at 600) is asked after the stream's first 450 - 9 tokens, its
    answer scored as one forward over those tokens, the question and the answer scores it."""
    stream = cut_stream(tiny.config)
    ref = decode.teacher_force(tiny, decode.decode_cache(tiny, "full", 0, None, None, 0),
                               stream.ids, stream.n_prompt, 0)
    full = decode.entry(*ref, ref, stream, 0)
    probes, asked = decode.cut_probes(tiny, stream, 450, full)
    assert probes[0] == full["probes"][0] and asked == [300, 441]
    seq = stream.ids[:441] + stream.ids[600:609]  # 450 tokens: the budget holds the answer
    logits = plain_logits(tiny, seq)
    logp = torch.log_softmax(logits, -1)
    answer = [447, 448, 449]
    want = -sum(float(logp[p - 1, seq[p]]) for p in answer)
    gap, n, hits, nll, nll_full = probes[1]
    assert (gap, n, nll_full) == (500, 3, full["probes"][1][4])
    assert nll == pytest.approx(want, rel=1e-4, abs=1e-4)
    top2 = logits[[p - 1 for p in answer]].topk(2, -1).values
    if bool((top2[:, 0] - top2[:, 1] > 1e-4).all()):  # no near-tie: the argmax is the plain one
        assert hits == sum(int(logits[p - 1].argmax()) == seq[p] for p in answer)
    # a budget too small for the prompt and the probe: asked right after the prompt
    assert decode.cut_probes(tiny, stream, 25, full)[1] == [20, 20]
    # a budget past both answers: the full cache's
    assert decode.cut_probes(tiny, stream, 650, full) == (full["probes"], [300, 600])


def test_cut_generation_asks_its_question_where_it_fills_the_budget(tiny):
    """Against greedy decoding by plain forwards over the whole sequence: the generation stops
    where the prompt, it, the question and ANSWER_TOKENS fill the budget, then the question is fed
    and answered."""
    g = torch.Generator().manual_seed(5)
    prompt, question = (torch.randint(3, tiny.config.vocab_size, (n,), generator=g).tolist()
                        for n in (30, 7))
    budget = 30 + 25 + 7 + decode.ANSWER_TOKENS
    out, answer = decode.cut_generation(tiny, prompt, 0, budget, 200, question, set(), set())
    assert len(out) == 25 and len(answer) == decode.ANSWER_TOKENS
    seq, want, clear = list(prompt), [], True
    for i in range(25 + len(question) + decode.ANSWER_TOKENS):
        if i == 25:
            seq += question
        if 25 <= i < 25 + len(question):
            continue
        last = plain_logits(tiny, seq)[-1]
        top2 = last.topk(2).values
        clear &= float(top2[0] - top2[1]) > 1e-4  # past a near-tie either token is right
        if not clear:
            break
        want.append(int(last.argmax()))
        seq.append(want[-1])
    assert (out + answer)[:len(want)] == want
    assert len(prompt) + len(out) + len(question) + len(answer) <= budget
    # a budget past the whole generation: the full cache's generation and answer
    full = decode.free_generation(tiny, decode.decode_cache(tiny, "full", 0, None, None, 0),
                                  prompt, 0, 40, question, set(), set())
    assert decode.cut_generation(tiny, prompt, 0, 500, 40, question, set(), set()) == full


def test_resume_keeps_each_documents_commit_and_refuses_other_settings(tiny_decode, tmp_path,
                                                                      monkeypatch):
    """Each record holds the commit it ran at and its settings (key); a resumed run's results.md
    names every commit (a record from before: unrecorded); a rerun with another setting is refused
    in one line naming it, config.json untouched."""
    import json

    from cli import UsageError
    monkeypatch.setattr(decode, "load_docs", short_text)
    out = tmp_path / "out"
    flags = [*tiny_decode, "--contexts", "2", "--methods", "full,streaming,cut",
             "--speed-lengths", "0", "--out", str(out)]
    bench.main(flags)
    config = json.loads((out / "config.json").read_text())
    recs = [out / "contexts" / f"context-00{c}.json" for c in (0, 1)]
    rec = json.loads(recs[0].read_text())
    assert rec["provenance"] == dict(git_commit=config["git_commit"],
                                     git_dirty=config["git_dirty"], started=config["started"])
    assert rec["key"] == config["quality_key"] and rec["key"]["gaps"] == [256]
    cut = rec["entries"]["cut@160"]  # every probe past 160: asked there, answered, scored
    assert cut["nll"] is None and all(p[3] is not None for p in cut["probes"])
    assert cut["gen"]["stopped"] and cut["gen"]["generated"] == 0  # the chat prompt fills 160
    # the first document from another commit, the second run again at this one
    (recs[0]).write_text(json.dumps(dict(rec, provenance=dict(git_commit="c" * 40,
                                                              git_dirty=True, started="t"))))
    recs[1].unlink()
    bench.main(flags)
    md = (out / "results.md").read_text()
    here = config["git_commit"][:10] + (" (dirty)" if config["git_dirty"] else "")
    assert (f"documents run at commit cccccccccc (dirty) (1 document), commit {here} "
            "(1 document)") in md
    # a record from before records kept their commit: read, its commit unrecorded
    recs[0].write_text(json.dumps({k: v for k, v in rec.items() if k != "provenance"}))
    recs[1].unlink()
    bench.main(flags)
    assert "unrecorded commit (1 document)" in (out / "results.md").read_text()
    before = (out / "config.json").read_text()
    with pytest.raises(UsageError) as e:  # cli's edge: one line, exit 2
        bench.main([*flags, "--decode-gaps", "300"])
    assert "\n" not in str(e.value) and str(e.value).startswith(str(recs[0]))
    assert "comes from another configuration (gaps differ); use a new --out" in str(e.value)
    assert (out / "config.json").read_text() == before


# ------------------------------------------- configurations and the static split (decode_config)

# a stream that ends at an eviction: the prompt, then 7 whole 128-token buffers
N_PROMPT, N_FED = 40, 40 + 7 * 128


def held(cache):
    """[layer][head] the positions each compressed head holds, as a set."""
    return [set(h) for layer in kept_positions(cache) for h in layer]


def forced(tiny, config, budget, fill=None, seed=7, scorer=None):
    """config's cache teacher-forced over a random stream of N_FED + 1 tokens (the last eviction
    comes after the last forward); scorer: put in place of the config's own."""
    ids = torch.randint(3, tiny.config.vocab_size, (N_FED + 1,),
                        generator=torch.Generator().manual_seed(seed)).tolist()
    cache = decode.decode_cache(tiny, config, 2, budget, spread_gates(tiny.config), 0, fill)
    if scorer is not None:
        cache.scorer = scorer
    decode.teacher_force(tiny, cache, ids, N_PROMPT, 2)
    assert cache.n_seen == N_FED
    return cache


class OldestFirst(gate.Scorer):
    """Scores that keep the oldest rows: only the cache's protection keeps a recent one."""

    def score(self, li, hidden, q, k, pos):
        return -pos.float()[None].expand(self._heads(k), -1).contiguous()


@pytest.mark.parametrize("window", [8, 128])
@pytest.mark.parametrize("level", ["head", "global"])
def test_a_configuration_protects_exactly_its_last_w_tokens(tiny, level, window):
    """With scores that prefer the oldest rows, what a head keeps past its budget's oldest rows is
    exactly its first 4 positions and the last `window`: the window is the configuration's."""
    B = 200
    config = f"random@{level}/w{window}"
    cache = forced(tiny, config, B, scorer=OldestFirst(tiny.config.num_key_value_heads))
    assert cache.decode_window == window and cache.level == level
    protected = set(range(4)) | set(range(N_FED - window, N_FED))
    heads = held(cache)
    assert all(protected <= h for h in heads)
    assert all(N_FED - window - 1 not in h for h in heads)  # the row before the window: evicted
    if level == "head":  # the others: the oldest after the sinks, B per head
        assert all(h == protected | set(range(4, 4 + B - len(protected))) for h in heads)
    assert sum(map(len, heads)) == B * len(heads)


@pytest.mark.parametrize("config, window", [("rkv/w128", 128), ("snapkv@global/w128", 128),
                                            ("rkv@global", 8)])
def test_a_rescoring_baseline_rescores_from_its_configured_window(tiny, config, window):
    """SnapKV and R-KV at another window: the last `window` queries rescore the held rows, and the
    last `window` rows are kept (their +inf)."""
    cache = forced(tiny, config, 200)
    assert cache.decode_window == window
    assert all(q.shape[0] == window for q in cache.queries.values())
    assert all(set(range(N_FED - window, N_FED)) <= h for h in held(cache))


def test_the_gate_at_each_level_keeps_its_budget(tiny):
    """fastkvzip@head: B rows in every head; @layer: B·H per layer; the pool (fastkvzip):
    B·L·H over all, unevenly; the configuration's window is the one kept."""
    B, H = 200, tiny.config.num_key_value_heads
    per_head = [len(h) for h in held(forced(tiny, "fastkvzip@head/w8", B))]
    assert per_head == [B] * len(per_head)
    layer = forced(tiny, "fastkvzip@layer", B)
    assert [sum(len(h) for h in x) for x in kept_positions(layer)] == [B * H] * len(per_head[::H])
    pool = [len(h) for h in held(forced(tiny, "fastkvzip", B))]
    assert sum(pool) == B * len(pool)
    if len(pool) > 2:  # one layer of two heads may split evenly by chance
        assert len(set(pool)) > 1


def split_oracle(fill, n, protected, budget, window):
    """The static split's rule written out: per head, in the order of fill (most first; ties to the
    earlier head), its protected rows, then whole while the pool's rows last, then the most recent
    rows of the first head that does not fit, and nothing else."""
    flat = fill.flatten().tolist()
    order = sorted(range(len(flat)), key=lambda i: -flat[i])
    left = budget * len(flat) - len(protected) * len(flat)
    out = [None] * len(flat)
    for i in order:
        extra = min(n - len(protected), left)
        left -= extra
        out[i] = protected | set(range(n - window - extra, n - window))
    return out


@pytest.mark.parametrize("budget, window", [(300, 8), (150, 8), (600, 128)])
def test_the_static_split_keeps_whole_heads_and_windows_with_the_pools_rows(tiny, budget, window):
    """split/wN ranked on another stream (decode.head_fill of the gate's pool): its heads are the
    rule's (whole heads in the pool's order, one head's most recent rows, the others their sinks
    and window), and it holds exactly the rows of the pool at the same budget and window."""
    cfg = tiny.config
    other = decode.Stream(ids=torch.randint(3, cfg.vocab_size, (N_FED + 1,), generator=torch
                                            .Generator().manual_seed(11)).tolist(),
                          n_prompt=N_PROMPT, n_protected=2, doc_pos=[], probes=[], doc="other")
    fill = decode.head_fill(tiny, spread_gates(cfg), other, budget, window)
    assert fill.shape == (len(cfg.compressed_layers), cfg.num_key_value_heads)
    split = held(forced(tiny, f"split/w{window}", budget, fill))
    protected = set(range(4)) | set(range(N_FED - window, N_FED))
    assert split == split_oracle(fill, N_FED, protected, budget, window)
    pool = held(forced(tiny, decode_config.pool(window), budget))
    assert sum(map(len, split)) == sum(map(len, pool)) == budget * len(pool)
    # the ranking is the pool's: the head it filled most is the fullest here too
    assert len(split[int(fill.flatten().argmax())]) == max(map(len, split))


def test_a_split_without_its_ranking_is_refused(tiny):
    from kernels import ArgumentError
    for fill in (None, torch.zeros(7, 7)):
        with pytest.raises(ArgumentError, match="split needs its heads' fill"):
            decode.decode_cache(tiny, "split", 0, 200, None, 0, fill)


def test_configuration_rows_render_with_their_labels_and_old_runs_render_as_committed():
    """A record's key holds the configuration's name and the budget after its last @; the report
    says what each configuration ran. Every committed decode run renders the rows it shows."""
    import json
    recs = fake_records()
    for r in recs:
        e = r["entries"]
        e["rkv@global/w128@256"], e["split/w8@256"] = e["fastkvzip@256"], e["fastkvzip@256"]
    res = decode_report.results(recs, n_boot=50, seed=0)
    labels = {(r["method"], r["budget"]) for r in res["rows"]}
    assert {("rkv@global/w128", 256), ("split/w8", 256), ("full", None)} <= labels
    md = "\n".join(decode_report.markdown(res))
    assert "| rkv@global/w128 | 256 |" in md and "| split/w8 | 256 |" in md
    assert "`rkv@global/w128`: rkv at level global, window 128; its scorer ranks rows within a " \
           "head" in md and "- `split/w8`: the static split" in md
    assert "configurations" not in "\n".join(decode_report.markdown(
        decode_report.results(fake_records(), n_boot=50, seed=0)))
    runs = [p.parent for p in (Path(__file__).parents[1] / "benchmarks" / "decode-cpu").glob(
        "*/results.json")]
    assert runs
    for run in runs:
        res = json.loads((run / "results.json").read_text())
        shown = (run / "results.md").read_text().splitlines()
        assert shown[len(decode_report.header(res)):] == decode_report.markdown(res), run


def test_configurations_run_through_the_suite(tiny_decode, tmp_path, monkeypatch):
    """bench.py --suite decode with configurations and the split: a row per configuration, the
    split ranked on the calibration document (one more chapter than --contexts, never
    evaluated), the same KV bytes as the pool it is ranked by."""
    import json
    monkeypatch.setattr(decode, "load_docs", short_text)
    out = tmp_path / "out"
    bench.main([*tiny_decode, "--methods", "fastkvzip/w8,split/w8,split-self/w8,rkv@global/w128,"
                "fastkvzip@global/w8", "--decode-generations", "0", "--speed-lengths", "0",
                "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["flags"]["methods"] == ["full", "fastkvzip/w8", "split/w8",
                                                 "split-self/w8", "rkv@global/w128"]
    (rec,) = [json.loads(p.read_text()) for p in (out / "contexts").iterdir()]
    assert rec["doc"] == "c0" and res["n_contexts"] == 1
    e = rec["entries"]
    assert e["split/w8@160"]["kept_nbytes"] == e["fastkvzip/w8@160"]["kept_nbytes"] \
        == e["split-self/w8@160"]["kept_nbytes"]
    md = (out / "results.md").read_text()
    assert "| split-self/w8 | 160 |" in md and "on another document, window 8" in md


# ------------------------------------------- fastkvzip+attn: ours, the gate lifted by attention

@pytest.mark.parametrize("term", ["attn", "red"])
def test_the_gate_with_a_term_of_weight_0_is_the_gate(tiny, term):
    """λ = 0: fastkvzip+attn0 and +red0 keep, at every level, exactly the rows of the gate at the
    same level and window (the gate's scores, kept by position, are the rows' scores)."""
    for level, window in (("global", 128), ("calibrated", 8), ("head", 8)):
        plain = held(forced(tiny, f"fastkvzip@{level}/w{window}", 200))
        mixed = forced(tiny, f"fastkvzip+{term}0@{level}/w{window}", 200)
        assert mixed.decode_window == window and mixed.decode_level == level
        assert held(mixed) == plain, (level, window)


def test_the_attention_term_is_its_formula_on_the_authors_attention():
    """mixed(): g·(1 + λ·a/ā) for each row before the last w, a the authors' decode-time SnapKV
    attention of those rows (tests/test_decode_memory.py: authors_attention), ā its mean, g the
    gate's score kept for the row's position; +inf for the last w."""
    torch.manual_seed(0)
    gates = Gates(1, 32, 2, 2)
    scorer = decode_config.RescoredGateScorer(gates, scale=None, mix=0.3)  # 1/√d, as the authors'
    g = torch.Generator().manual_seed(3)
    n, w, G, d = 37, 5, 2, 8
    keys, queries = torch.randn(n, d, generator=g), torch.randn(w, G, d, generator=g)
    pos = torch.arange(100, 100 + 2 * n, 2)
    scorer.by_pos[0] = torch.rand(2, 200, generator=g)
    out = scorer.mixed(0, 1, pos, keys, queries)
    a = authors_attention(queries.transpose(0, 1)[None], keys[None, None], w=w)[0, 0]  # (n - w,)
    want = scorer.by_pos[0][1, pos[:n - w]] * (1 + 0.3 * a / a.mean())
    torch.testing.assert_close(out[:n - w], want, rtol=1e-5, atol=0)
    assert out[n - w:].isinf().all() and out.shape == (n,)


def test_the_redundancy_factor_is_its_formula_on_the_authors_redundancy():
    """gate.GateScorer.at_decode: scores·(r̄/r)^λ, r the authors' redundancy of the head's held keys
    (tests/test_decode_memory.py: authors_redundancy, their cal_similarity), r̄ its mean; +inf
    stays; λ = 0 the scores themselves."""
    torch.manual_seed(0)
    scorer = gate.GateScorer(Gates(1, 32, 2, 2), redundancy=2.0)
    g = torch.Generator().manual_seed(4)
    n, d = 23, 8
    keys = torch.randn(n, d, generator=g)
    keys[5] = keys[2] + 0.1 * torch.randn(d, generator=g)  # a near-duplicate: a similarity > 0.5
    scores = torch.rand(n, generator=g)
    scores[[0, 21, 22]] = math.inf  # protected rows
    out = scorer.at_decode(scores, keys)
    r = authors_redundancy(keys[None, None])[0]                                  # (n,)
    torch.testing.assert_close(out, scores * (r.mean() / r) ** 2, rtol=1e-5, atol=0)
    assert out[[0, 21, 22]].isinf().all()
    assert gate.GateScorer(scorer.gates).at_decode(scores, keys) is scores  # λ = 0


def test_the_gates_decode_default_holds_the_redundancy_factor_on_a_hybrid_model(tiny, monkeypatch):
    """generate.make_cache's gate: λ = 4 on Gemma 3 (sliding-window layers beside), 0 where every
    layer is compressed; decode-time eviction compares at_decode's scores (the rows' own scores
    stay the gate's); a decode-suite row named fastkvzip runs without it."""
    import cache as C
    hybrid = len(tiny.config.compressed_layers) < tiny.config.num_hidden_layers
    made = generate.make_cache("fastkvzip", tiny, 2, gates=spread_gates(tiny.config),
                               decode_tokens_per_head=200)
    assert made.scorer.redundancy == (4.0 if hybrid else 0.0)
    assert forced(tiny, "fastkvzip@calibrated/w8", 200).scorer.redundancy == 0
    seen, before = [], []
    keep, evict = C.keep_within_budget, C.EvictingCache._evict_to_budget

    def keep_(scores, budget, level):
        seen.append([s.clone() for per_head in scores for s in per_head])
        return keep(scores, budget, level)

    def evict_(self):
        before.append([(kv.head_score(h).clone(), kv.head_keys(h).clone(), kv.head_pos(h).clone())
                       for kv in (self.layers[x] for x in self.compressed)
                       for h in range(kv.n_heads)])
        return evict(self)

    monkeypatch.setattr(C, "keep_within_budget", keep_)
    monkeypatch.setattr(C.EvictingCache, "_evict_to_budget", evict_)
    cache = forced(tiny, "fastkvzip+red4@calibrated/w8", 200)
    assert cache.scorer.redundancy == 4.0 and len(seen) == len(before) > 1
    for (g, keys, pos), s in zip(before[-1], seen[-1]):
        protected = (pos < 4) | (pos >= N_FED - 8)
        r = gate.key_redundancy(keys)
        want = torch.where(protected, torch.tensor(math.inf), g * (r.mean() / r) ** 4)
        torch.testing.assert_close(s, want)
    assert held(cache) != held(forced(tiny, "fastkvzip@calibrated/w8", 200))


def test_the_gate_lifted_by_attention_keeps_its_budget_and_moves_rows(tiny):
    """λ = 1: every head keeps its budget (head level) with its sinks and last w, and some kept rows
    differ from the plain gate's: the term changes the choice. The last w queries are kept."""
    B = 200
    mixed = forced(tiny, "fastkvzip+attn@head/w8", B)
    heads = held(mixed)
    assert all(len(h) == B for h in heads)
    protected = set(range(4)) | set(range(N_FED - 8, N_FED))
    assert all(protected <= h for h in heads)
    assert all(q.shape[0] == 8 for q in mixed.queries.values())
    assert heads != held(forced(tiny, "fastkvzip@head/w8", B))


def test_the_gate_lifted_by_attention_is_named_with_its_weight():
    """fastkvzip+attn[λ]: λ 1 when left out, the gate's own level and window; a λ that is no number
    is refused in one line naming the methods."""
    c = decode_config.parse("fastkvzip+attn0.25@calibrated/w8")
    assert (c.name, c.level, c.window) == ("fastkvzip+attn0.25@calibrated/w8", "calibrated", 8)
    assert decode_config.mix_of(c.method) == ("attention", 0.25)
    assert decode_config.mix_of("fastkvzip+attn") == ("attention", 1)
    assert decode_config.mix_of("fastkvzip+red4") == ("redundancy", 4)
    assert decode_config.parse("fastkvzip+attn").name == "fastkvzip+attn"
    assert decode_config.needs_gate("fastkvzip+attn2/w8")
    assert "λ = 0.25, level calibrated" in decode_config.describe(c)
    for bad in ("fastkvzip+attnx", "fastkvzip+attn-1", "fastkvzip+attn1.2.3"):
        with pytest.raises(ValueError, match=r"is no method: methods are .*fastkvzip\+red\[λ\]"):
            decode_config.parse(bad)
