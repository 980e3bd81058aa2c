"""The decode suite's closed loop (harness/closed_loop.py): the list's parsing, the scoring of a
forced generation against what it wrote, the cache each method gets, the report's table and its
Wilson interval against a naive computation, the flags."""
import math

import pytest
import torch

import bench
from cache import EvictingCache, KVCache
from harness import closed_loop, decode, decode_report
from prompts import encode_prompt, encode_text
from tests.test_decode_suite import short_text, tiny_decode  # noqa: F401 (a fixture: its flags)
from tests.test_saved_cache import tiny_setup


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_setup("qwen3", tmp_path_factory.mktemp("qwen3"))


def test_a_code_is_written_with_the_digit_tokens_the_tokenizer_uses(tiny, monkeypatch):
    """The digits the model samples are the tokens the tokenizer writes in a list line, so a code
    in the cache reads as the same text it would encode to; a tokenizer that writes a digit in
    several tokens is refused."""
    tok = tiny["tok"]
    ids = closed_loop.digit_ids(tok)
    assert [tok.decode([i]) for i in ids] == list("0123456789")
    line = encode_text(tok, closed_loop.HEAD.format(i=3, name="Hammer") + "5172)")
    assert line[-5:-1] == [ids[5], ids[1], ids[7], ids[2]]
    monkeypatch.setattr(closed_loop, "encode_text", lambda tok, text: [1, 2])  # two per digit
    with pytest.raises(ValueError, match="several tokens"):
        closed_loop.digit_ids(tok)


def test_an_answer_is_its_first_code_like_word():
    assert closed_loop.parse_answer(" 4821.") == "4821"
    assert closed_loop.parse_answer(" 12 or 4821") == "12"
    assert closed_loop.parse_answer(" 2626-1, the key") == "2626-1"
    assert closed_loop.parse_answer(" VERZI-.") == "VERZI"
    assert closed_loop.parse_answer(" ...") is None


class Scripted:
    """A fake model for generate's prefill / begin_answer / decode_one: the cache is the list of
    ids fed; after a list line's head it says `codes[i]` and a line break, after the story header
    `story`, after a question's cue `answers[name]`, else "x". Peaked logits: the harness's
    sampling (at temperature 0.7, its digits among the digit tokens) takes what it says."""

    def __init__(self, tok, sample, codes, story, answers):
        self.tok, self.sample, self.story = tok, sample, story
        self.says = {closed_loop.HEAD.format(i=i, name=n): c
                     for i, (n, c) in enumerate(zip(sample.names, codes), 1)}
        self.says[closed_loop.STORY] = story
        self.says.update({closed_loop.question(n): answers[n] + "\n" for n in sample.names})
        self.eos = tok.token_to_id("<|im_end|>")
        self.config = type("Cfg", (), dict(eos_token_ids=[self.eos]))()
        self.asked = []  # the text each question's copy of the cache was fed

    def logits(self, cache):
        vocab = self.tok.get_vocab_size()
        text = self.tok.decode(cache[len(self.sample.prompt):])
        say = "x"
        for head, what in self.says.items():
            if head in text:
                done = text[text.rindex(head) + len(head):]
                if what.startswith(done) and done != what:  # part of what it says is left
                    say = what[len(done):]
        if any(text.endswith(closed_loop.question(n)) for n in self.sample.names):
            self.asked.append(text)
        out = torch.full((vocab,), -1e4)
        out[encode_text(self.tok, say)[0]] = 0.0
        out[self.eos] = -1.0  # next best: a greedy answer ends on it only when told to
        return out

    def prefill(self, model, cache, ids, n_protected):
        cache.extend(ids)
        return self.logits(cache)

    def begin_answer(self, model, cache, question, logits, max_new_tokens=None):
        return logits

    def decode_one(self, model, cache, token):
        cache.append(int(token))
        return self.logits(cache)


def scripted_run(tiny, monkeypatch, codes, answers, story=" It rained all day."):
    tok = tiny["tok"]
    sample = closed_loop.make_sample(tok, tiny["fmt"], seed=3, n_items=3)
    fake = Scripted(tok, sample, codes, story, answers)
    for name in ("prefill", "begin_answer", "decode_one"):
        monkeypatch.setattr(closed_loop.generate, name, getattr(fake, name))
    n_story = len(encode_text(tok, story))
    return sample, fake, closed_loop.run_sample(fake, tok, [], sample, n_story)


def test_each_answer_is_scored_against_the_code_the_model_wrote(tiny, monkeypatch):
    codes = ["4821", "2627", "9090"]
    sample = closed_loop.make_sample(tiny["tok"], tiny["fmt"], seed=3, n_items=3)
    a, b, c = sample.names
    answers = {a: "4821).", b: "2620)", c: "9090 or 12"}  # 2620 is not 2627
    _, fake, out = scripted_run(tiny, monkeypatch, codes, answers)
    assert out["valid"] and out["codes"] == codes
    assert out["lines"] == [closed_loop.HEAD.format(i=i, name=n) + f"{x})"
                            for i, (n, x) in enumerate(zip(sample.names, codes), 1)]
    assert out["answers"] == [answers[a], answers[b], answers[c]]
    assert out["right"] == [True, False, True]
    assert out["story_tail"] == " It rained all day." and out["restated"] == [False] * 3


def test_every_question_is_asked_of_the_cache_the_story_left(tiny, monkeypatch):
    """Each question on its own copy: its cue follows the story directly, no earlier question or
    answer in between, and it does not say the item's number."""
    sample = closed_loop.make_sample(tiny["tok"], tiny["fmt"], seed=3, n_items=3)
    answers = {n: "1111" for n in sample.names}
    _, fake, out = scripted_run(tiny, monkeypatch, ["1111", "2222", "3333"], answers)
    assert out["right"] == [True, False, False]
    assert len(fake.asked) == 3
    for i, (text, name) in enumerate(zip(fake.asked, sample.names), 1):
        assert text.endswith("It rained all day." + closed_loop.question(name))
        assert f"{i}." not in closed_loop.question(name)


def test_a_list_that_repeats_a_code_is_invalid_and_never_asked(tiny, monkeypatch):
    sample = closed_loop.make_sample(tiny["tok"], tiny["fmt"], seed=3, n_items=3)
    answers = {n: "1111" for n in sample.names}
    _, fake, out = scripted_run(tiny, monkeypatch, ["1234", "2222", "1234"], answers)
    assert not out["valid"] and out["codes"] == ["1234", "2222", "1234"]
    assert out["right"] == [] and out["answers"] == [] and "story_tail" not in out
    assert not fake.asked


def test_the_story_restating_a_code_is_noted(tiny, monkeypatch):
    sample = closed_loop.make_sample(tiny["tok"], tiny["fmt"], seed=3, n_items=3)
    answers = {n: "1111" for n in sample.names}
    _, _, out = scripted_run(tiny, monkeypatch, ["1111", "2222", "3333"], answers,
                             story=" The code 2222 was lost.")
    assert out["restated"] == [False, True, False]


def test_each_method_gets_the_suites_decode_cache(tiny, monkeypatch):
    """decode.loop_samples: the full cache, and for each method and loop budget the cache
    decode.decode_cache makes (generate.py --decode-tokens-per-head B), protecting the loop
    prompt's system prompt; cut runs the full cache stopped at the budget; seeds spread over
    documents."""
    model, tok = tiny["model"], tiny["tok"]
    got = []

    def run_sample(model_, tok_, cache, sample, n_tokens, stop_at=None):
        got.append((cache, sample, n_tokens, stop_at))
        return dict(seed=sample.seed, valid=True, right=[True, False], codes=["111", "222"])

    monkeypatch.setattr(closed_loop, "run_sample", run_sample)
    exp = decode.DecodeExperiment(
        methods=["full", "fastkvzip", "streaming", "cut"], budgets=[300, 400], contexts=2,
        length=900, gaps=[256], prompt_tokens=16, generations=0, gen_tokens=16, gen_budgets=[],
        seed=1, loop=decode.loop_settings(3, 50, [400]))
    out = decode.loop_samples(model, tok, tiny["fmt"], exp, 0, 2, tiny["gates"])
    assert set(out) == {"full", "fastkvzip@400", "streaming@400", "cut@400"}
    assert [x["seed"] for x in out["full"]] == [1000, 1002]  # documents 0 and 1 take 0,2 and 1
    assert decode.loop_samples(model, tok, tiny["fmt"], exp, 1, 2, tiny["gates"]).keys() == out.keys()
    cut_cache, _, _, stop_at = got[3]  # seed 1000's fourth: cut@400
    assert type(cut_cache) is KVCache and stop_at == 400
    for cache, sample, n_tokens, stop_at in got[:3]:  # seed 1000: full, fastkvzip@400, streaming@400
        assert n_tokens == 50 and sample.n_protected == len(encode_prompt(tok, tiny["fmt"].system))
    full, gated, streaming = (c for c, *_ in got[:3])
    assert type(full) is KVCache
    for cache, method in ((gated, "fastkvzip"), (streaming, "streaming")):
        want = decode.decode_cache(model, method, got[0][1].n_protected, 400, tiny["gates"], 1000)
        assert isinstance(cache, EvictingCache) and cache.decode_tokens_per_head == 400
        assert type(cache.scorer) is type(want.scorer) and cache.level == want.level
        assert cache.n_protected == got[0][1].n_protected
    assert all(len(sample.names) == closed_loop.N_ITEMS for _, sample, *_ in got)
    got.clear()  # --loop-items: every sample's list, and its prompt, has that many items
    exp.loop = decode.loop_settings(3, 50, [400], items=5)
    decode.loop_samples(model, tok, tiny["fmt"], exp, 0, 2, tiny["gates"])
    assert got and all(len(sample.names) == 5 for _, sample, *_ in got)
    assert "list of 5 " in tok.decode(got[0][1].prompt)


def test_a_real_loop_runs_through_the_decode_path(tiny, monkeypatch):
    """The tiny random model through generate's real decode path, evicting at 160 per head: its
    codes sampled among the digit tokens, every item asked on a deep copy of the evicting cache."""
    model, tok = tiny["model"], tiny["tok"]
    sample = closed_loop.make_sample(tok, tiny["fmt"], seed=0, n_items=3)
    cache = decode.decode_cache(model, "streaming", sample.n_protected, 160, None, 0)
    out = closed_loop.run_sample(model, tok, cache, sample, 200)
    assert cache.n_seen > 200 + len(sample.prompt)  # the story was decoded, and evicted
    assert max(cache.layers[i].lens.max() for i in cache.compressed) <= 160 + 128
    assert out["valid"] and len(out["answers"]) == 3 and len(out["right"]) == 3


def test_cut_asks_where_the_questions_still_fit_the_budget(tiny, monkeypatch):
    """cut (run_sample's stop_at=B, the authors' forced answer): on the full cache, the same list
    and a prefix of the full run's story (one seed, one generator), stopped so that the longest
    question and its answer fit in B positions, and only just (one more story token would not)."""
    model, tok = tiny["model"], tiny["tok"]
    sample = closed_loop.make_sample(tok, tiny["fmt"], seed=0, n_items=3)
    room = max(len(encode_text(tok, closed_loop.question(n)))
               for n in sample.names) + closed_loop.ANSWER_TOKENS
    runs = []
    for stop_at in (None, "B"):
        cache = decode.decode_cache(model, "full", sample.n_protected, None, None, 0)
        budget = None if stop_at is None else runs[0][1] + room - 120  # a story of ~120 tokens
        runs.append((closed_loop.run_sample(model, tok, cache, sample, 200, stop_at=budget),
                     cache.n_seen, budget))
    (full, _, _), (cut, held, budget) = runs
    assert cut["lines"] == full["lines"] and full["story_tokens"] == 200
    assert 0 < cut["story_tokens"] < 200 and full["story_head"].startswith(cut["story_head"][:40])
    assert held + room <= budget < held + 1 + room
    assert len(cut["answers"]) == 3


def loop_records():
    """Two documents, three samples of the full cache and the gate; one gate sample invalid."""
    s = lambda valid, right, restated=None, codes=("1", "2", "3"), answers=None: dict(
        valid=valid, right=right, restated=restated or [False] * len(right), codes=list(codes),
        **({} if answers is None else dict(answers=answers)))
    return [dict(context=0, entries={
                "full": dict(probes=[], loop=[s(True, [True, True, False], [True, False, False],
                                                ("12", "12", "34")),
                                              s(True, [True] * 3)]),
                "fastkvzip@256": dict(probes=[], loop=[s(True, [True, False, False],
                                                         answers=["1)", "3.", "9"]),
                                                       s(False, [])])}),
            dict(context=1, entries={
                "full": dict(probes=[], loop=[s(True, [False, True, True])]),
                "fastkvzip@256": dict(probes=[], loop=[s(True, [False] * 3,
                                                         answers=["x", "22", "2)"])])})]


def test_the_loop_table_is_accuracy_over_items_with_a_wilson_interval():
    rows = decode_report.loop_rows(loop_records())
    full = next(r for r in rows if r["method"] == "full")
    gate_ = next(r for r in rows if r["method"] == "fastkvzip")
    assert (full["samples"], full["invalid"], full["n"], full["right"]) == (3, 0, 9, 7)
    assert (gate_["samples"], gate_["invalid"], gate_["n"], gate_["right"]) == (3, 1, 6, 1)
    assert gate_["budget"] == 256 and full["budget"] is None
    assert math.isclose(full["restated"], 1 / 9)
    assert math.isclose(full["chance"], (2 / 3 + 2 / 3 + 1 / 3 + 6 * (1 / 3)) / 9)
    assert math.isclose(gate_["chance"], 1 / 3)
    assert full["listed"] is None  # no answers recorded
    assert math.isclose(gate_["listed"], 3 / 6)  # "1", "3", "2" of the list; "9", "x", "22" not
    for r, k, n in ((full, 7, 9), (gate_, 1, 6)):
        # the Wilson score interval written out: (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1+z²/n)
        p, z = k / n, 1.959963984540054
        centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        lo, hi = (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)
        assert r["score"] == pytest.approx(k / n)
        assert r["ci"] == pytest.approx([lo, hi], abs=1e-3)
    assert decode_report.wilson(0, 0) is None
    assert decode_report.wilson(10, 10)[1] == pytest.approx(1.0)
    md = "\n".join(decode_report.loop_markdown(rows))
    assert "| full | – | 3 | 0 | 9 | 7 | 0.78 [0.45, 0.94] | 0.41 | – | 0.11 |" in md
    assert "| fastkvzip | 256 | 3 | 1 | 6 | 1 | 0.17 [0.03, 0.56] | 0.33 | 0.50 | 0.00 |" in md
    assert decode_report.loop_markdown([]) == []


@pytest.mark.parametrize("flags, words", [
    (["--loop-seeds", "-1"], "--loop-seeds must be >= 0"),
    (["--loop-seeds", "2", "--loop-tokens", "0"], "--loop-tokens must be >= 1"),
    (["--decode-budgets", "256,512", "--loop-budgets", "1024"],
     "--loop-budgets 1024: each must be one of --decode-budgets"),
    (["--loop-seeds", "2", "--loop-items", "1"], "--loop-items must be >= 2"),
    (["--loop-seeds", "2", "--loop-items", str(closed_loop.MAX_ITEMS + 1)],
     f"a list holds at most {closed_loop.MAX_ITEMS} items"),
])
def test_bad_loop_flags_exit_2(capsys, flags, words):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--suite", "decode", *flags])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_loop_flags_under_another_suite_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--suite", "needle", "--loop-seeds", "3"])
    assert e.value.code == 2 and "--loop-seeds is a flag of --suite decode" in \
        capsys.readouterr().err


def test_loop_flags_make_the_experiment_key_and_a_run_without_keeps_its_old_key():
    args = bench.parse_args(["--suite", "decode", "--decode-budgets", "256,512"])
    assert args.loop_seeds == 0 and args.loop_budgets == [256, 512]
    config = dict(model=dict(sha256="m"), gate=dict(sha256="g"))
    from harness import decode_suite
    assert "loop" not in decode.run_key(decode_suite.experiment(args), config)
    args = bench.parse_args(["--suite", "decode", "--decode-budgets", "256,512", "--loop-seeds",
                             "3", "--loop-budgets", "256"])
    key = decode.run_key(decode_suite.experiment(args), config)
    args.loop_items = 5
    assert decode.run_key(decode_suite.experiment(args), config)["loop"]["items"] == 5
    assert key["loop"] == dict(seeds=3, tokens=closed_loop.TOKENS, budgets=[256],
                               items=closed_loop.N_ITEMS, temperature=closed_loop.TEMPERATURE,
                               top_p=closed_loop.TOP_P, code_digits=closed_loop.CODE_DIGITS,
                               code_temperature=closed_loop.CODE_TEMPERATURE)


def test_bench_runs_the_loop_and_reports_it(tiny_decode, tmp_path, monkeypatch):  # noqa: F811
    """bench.py --suite decode --loop-seeds on a tiny random Gemma3: the loop's samples in the
    document's record, its rows in results.json (a valid sample asks its 8 items), its table and
    settings in results.md."""
    import json
    monkeypatch.setattr(decode, "load_docs", short_text)
    out = tmp_path / "out"
    bench.main([*tiny_decode, "--speed-lengths", "0", "--decode-generations", "0", "--loop-seeds",
                "2", "--loop-tokens", "20", "--out", str(out)])
    rec = json.loads(next((out / "contexts").glob("*.json")).read_text())
    assert [len(rec["entries"][k]["loop"]) for k in ("full", "streaming@160")] == [2, 2]
    rows = [r for r in json.loads((out / "results.json").read_text())["rows"]
            if r["task"] == "loop"]
    assert [(r["method"], r["budget"], r["samples"]) for r in rows] == [
        ("full", None, 2), ("streaming", 160, 2)]
    assert all(r["n"] == 8 * (r["samples"] - r["invalid"]) for r in rows)
    md = (out / "results.md").read_text()
    assert "## Closed loop" in md and "| streaming | 160 | 2 |" in md
    assert "closed loop: 2 samples of 8 codes and 20-token stories" in md
