"""The gate's agreement with its teacher where the cut is (teacher.agreement, pool_agreement,
token_marks) and train_gate.py's report of it: per layer and head, at the teacher's own counts,
on the held-out documents and on --eval-features folders."""
import json

import pytest
import torch
from safetensors.torch import load_file
from test_teacher import tiny_model_folder
from test_train_gate import SMALL, run_main, sharpen, write_docs

from commands import features
from formats.checkpoint import read_tokenizer
from formats.gate_file import gate_metadata, load_gate
from model import ModelConfig
from teacher import agreement, is_identifier_word, kept_by_rule, pool_agreement, token_marks, token_texts
from tests.assets import require_asset
from tests.helpers import pairs_within

BUDGETS = (0.5, 0.3, 0.2, 0.1)


def naive_counts(student, teacher, marks, r, window):
    """One context's counts at budget r by loops over Python lists: per (layer, head) the teacher's
    kept positions T (kept_by_rule, the cache's own rule, tested against the cache), the student's
    S, and the student's k highest positions K with k = |T| in that head; with each marked set of
    positions M, |T|, |S|, |T & S|, |T & K|, |M|, |M & T|, |M & S|, |M & K|."""
    L, H, n = student.shape
    kt, _ = kept_by_rule(teacher, r, 1000, window)
    ks, w = kept_by_rule(student, r, 1000, window)
    seg = range(n - w)
    out = {}
    for l in range(L):
        for h in range(H):
            T = {i for i in seg if kt[l, h, i]}
            S = {i for i in seg if ks[l, h, i]}
            by_score = sorted(seg, key=lambda i: -student[l, h, i].item())
            K = set(by_score[:len(T)])
            c = dict(teacher=len(T), student=len(S), both=len(T & S), topk_both=len(T & K),
                     segment=len(seg))
            for name, mark in marks.items():
                M = {i for i in seg if mark[i]}
                c.update({name: len(M), f"{name}_teacher": len(M & T),
                          f"{name}_student": len(M & S), f"{name}_topk": len(M & K)})
            out[l, h] = c
    return out


def test_overlap_at_the_teachers_counts_equals_a_naive_count():
    """pool_agreement over two contexts of different lengths against loops: per head and per layer
    the top-k overlap at the teacher's counts, the kept shares and share errors, the digit and
    identifier shares of the three kept sets, all pooled as sums of counts (not means of ratios)."""
    torch.manual_seed(3)
    L, H = 3, 2
    contexts = []
    for n in (70, 110):
        # distinct student scores within every head: no tie can make the top-k ambiguous
        student = torch.stack([torch.stack([torch.randperm(n).float() / n for _ in range(H)])
                               for _ in range(L)])
        assert all(pairs_within(student[l, h], 0.0) == 0 for l in range(L) for h in range(H))
        teacher = torch.rand(L, H, n) ** 3  # skewed, as the teacher's scores are
        teacher[1] = student[1] / 2 + 0.2 * torch.rand(H, n)  # a layer that agrees closely
        contexts.append((student, teacher, dict(digits=torch.rand(n) < 0.3,
                                                identifiers=torch.rand(n) < 0.2)))
    per = [agreement(s, t, m["digits"], BUDGETS, chunk_size=1000, window=0,
                     is_identifier=m["identifiers"]) for s, t, m in contexts]
    p = pool_agreement(per, BUDGETS)
    ratio = lambda a, b: a / b if b else None
    approx = lambda x: None if x is None else pytest.approx(x, abs=1e-12)
    for r in BUDGETS:
        naive = [naive_counts(s, t, m, r, 0) for s, t, m in contexts]
        total = lambda key, keys: sum(c[k][key] for c in naive for k in keys)
        for l in range(L):
            for h in range(H):
                at = lambda key: total(key, [(l, h)])
                assert p["heads"][f"topk_overlap@{r}"][l][h] == approx(
                    ratio(at("topk_both"), at("teacher"))), (r, l, h)
                assert p["heads"][f"kept_teacher@{r}"][l][h] == approx(
                    at("teacher") / at("segment"))
                assert p["heads"][f"share_error@{r}"][l][h] == approx(
                    (at("student") - at("teacher")) / at("segment"))
                assert p["heads"][f"overlap@{r}"][l][h] == approx(ratio(at("both"), at("teacher")))
            at = lambda key: total(key, [(l, h) for h in range(H)])
            assert p[f"topk_overlap@{r}"][l] == approx(ratio(at("topk_both"), at("teacher")))
            assert p[f"overlap@{r}"][l] == approx(ratio(at("both"), at("teacher")))
            assert p[f"share_error@{r}"][l] == approx((at("student") - at("teacher"))
                                                      / at("segment"))
            assert p[f"share_error@{r}"][l] == approx(p[f"chance@{r}"][l] - p[f"kept_teacher@{r}"][l])
            for m in ("digits", "identifiers"):
                for side in ("student", "teacher", "topk"):
                    assert p[f"{m}_{side}@{r}"][l] == approx(ratio(at(f"{m}_{side}"), at(m)))
        every = lambda key: total(key, [(l, h) for l in range(L) for h in range(H)])
        assert p["all"][f"topk_overlap@{r}"] == approx(ratio(every("topk_both"), every("teacher")))
        assert p["all"][f"identifiers_topk@{r}"] == approx(ratio(every("identifiers_topk"),
                                                                 every("identifiers")))
        # both cuts keep exactly as many pairs (one global cut each): the errors cancel overall
        assert p["all"][f"share_error@{r}"] == 0
        assert p["all"][f"abs_share_error@{r}"] == approx(
            sum(abs(e) for e in p[f"share_error@{r}"]) / L)
    # the closely agreeing layer ranks far better inside its heads than the random ones
    assert p["topk_overlap@0.2"][1] > 0.6 > max(p["topk_overlap@0.2"][0], p["topk_overlap@0.2"][2])
    assert p["all"]["spearman"] == pytest.approx(sum(p["spearman"]) / L)


def test_pooling_leaves_out_what_older_counts_lack():
    """Counts written before per-head numbers and budgets 0.2/0.1 existed (a resumed benchmark's
    records) pool with new ones on what they share; nothing is invented for the rest."""
    torch.manual_seed(0)
    s, t, d = torch.rand(2, 2, 50), torch.rand(2, 2, 50), torch.rand(50) < 0.5
    new = agreement(s, t, d, chunk_size=1000, window=0)
    old = agreement(s, t, d, budgets=(0.5, 0.3), chunk_size=1000, window=0)
    for r in ("0.5", "0.3"):
        old[r] = {k: old[r][k] for k in ("teacher", "both", "student", "segment", "digits",
                                         "digits_teacher", "digits_student")}
    p = pool_agreement([new, old])
    assert p["overlap@0.5"] == pool_agreement([new, new])["overlap@0.5"]
    assert "topk_overlap@0.5" not in p and "overlap@0.2" not in p and p["heads"] == {}
    assert "share_error@0.5" in p and "identifiers_student@0.5" not in p


@pytest.mark.parametrize("word, expected", [
    ("sha256", True), ("x86", True), ("0x1F", True), ("A7K2Q", True), ("1990s", True),
    ("snake_case", True), ("__init__", True), ("_x", True), ("camelCase", True),
    ("getHTTP", True), ("iPhone", True),
    ("Paris", False), ("HTTP", False), ("2024", False), ("_", False), ("__", False),
    ("hello", False), ("Hello", False)])
def test_identifier_rule(word, expected):
    assert is_identifier_word(word) == expected


def test_identifier_and_digit_tokens_by_character(models):
    """With the tiny byte-level tokenizer (one token per character) every token is one character:
    the marked ones are exactly the characters of the identifier words, and the digits."""
    tok = read_tokenizer(models["qwen"], ModelConfig.from_json(models["qwen"]))
    text = "call get_value(x86) at 2024, in Paris: key A7K2Q or fooBar."
    ids = tok.encode(text, add_special_tokens=False).ids
    assert "".join(token_texts(tok, ids)) == text and len(ids) == len(text)
    is_digit, is_ident = token_marks(tok, ids)
    words = ("get_value", "x86", "A7K2Q", "fooBar")
    expected = torch.zeros(len(text), dtype=torch.bool)
    for w in words:
        expected[text.index(w):text.index(w) + len(w)] = True
    assert torch.equal(is_ident, expected)
    assert torch.equal(is_digit, torch.tensor([c.isdigit() for c in text]))


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "llama3_1"])
def test_token_marks_with_real_tokenizers(family):
    """Real tokenizers (multi-character tokens, a leading space in the token, '▁' or byte-level
    alphabets): the tokens' texts in context make up the decoded text, and a token is marked
    exactly when its characters overlap an identifier word (or hold a digit)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(require_asset("tokenizers", family, "tokenizer.json")))
    text = ("Call get_value(x86) at 2024 in Paris; the key A7K2Q, hash 0x1F9e and camelCase.\n"
            "Plain words only here, 3.14 and 1,000.")
    ids = tok.encode(text, add_special_tokens=False).ids
    texts = token_texts(tok, ids)
    assert "".join(texts) == tok.decode(ids) == text
    spans = [(text.index(w), text.index(w) + len(w))
             for w in ("get_value", "x86", "A7K2Q", "0x1F9e", "camelCase")]
    is_digit, is_ident = token_marks(tok, ids)
    start = 0
    for j, t in enumerate(texts):
        end = start + len(t)
        assert bool(is_ident[j]) == any(a < end and start < b for a, b in spans), (j, t)
        assert bool(is_digit[j]) == any(c.isdigit() for c in t), (j, t)
        start = end


# -------------------------------------------------------------------------------------------------
# train_gate.py: the report, metrics.json, the gate's metadata and --eval-features

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree_models")
    qwen = tiny_model_folder(root, "qwen3", seed=1)
    sharpen(qwen)
    return dict(qwen=qwen, gemma=tiny_model_folder(root, "gemma3", seed=1))


@pytest.fixture(scope="module")
def eval_folder(models, tmp_path_factory):
    """A features folder of the tiny Qwen on documents of their own (--steps 0), and its docs."""
    root = tmp_path_factory.mktemp("agree_eval")
    data = write_docs(root / "data", 3, seed=11)
    run_main(["--model", models["qwen"], "--data", data, "--tokens", 5000, "--long-doc-tokens", 0,
              "--steps", 0, "--val-docs", 0, *SMALL, "--out", root / "numeric"])
    return root / "numeric", data


def test_eval_features_report_equals_a_direct_evaluation(models, eval_folder, tmp_path, capsys):
    """--eval-features: every document of the folder (training split and all) is evaluated, under
    the folder's name; the numbers are teacher.agreement on the shards' own scores and token ids
    (which are the documents' ids); stdout shows the per-layer tables; the gate's metadata keeps
    numbers pooled over layers only."""
    folder, data = eval_folder
    out = tmp_path / "out"
    run_main(["--model", models["qwen"], "--data", write_docs(tmp_path / "train", 8, seed=2),
              "--tokens", 3000, "--long-doc-tokens", 0, "--steps", 60, "--batch-tokens", 100,
              *SMALL, "--out", out, "--eval-features", folder])
    printed = capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    e = m["eval_agreement"]["numeric"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert e["documents"] == len(manifest["documents"]) == 3 and e["folder"] == str(folder)

    cfg = ModelConfig.from_json(models["qwen"])
    tok = read_tokenizer(models["qwen"], cfg)
    gates = load_gate(out / "gate.safetensors", cfg)
    docs = features.load_documents(str(data), 5000, 300, 900, 0, 0, tok, 10 ** 6)
    per_doc = []
    for d, (_, ids, _) in zip(manifest["documents"], docs):
        shard = load_file(str(folder / d["shard"]))
        assert shard["ids"].tolist() == ids
        with torch.no_grad():
            pred = gates(shard["hidden"]).float()
        is_digit, is_ident = token_marks(tok, ids)
        per_doc.append(agreement(pred, shard["scores"], is_digit, is_identifier=is_ident))
    assert e["agreement"] == pool_agreement(per_doc)
    L, H = len(cfg.compressed_layers), cfg.num_key_value_heads
    for r in BUDGETS:
        assert len(e["agreement"][f"topk_overlap@{r}"]) == L
        assert [len(row) for row in e["agreement"]["heads"][f"topk_overlap@{r}"]] == [H] * L
        assert len(m["agreement"][f"share_error@{r}"]) == L  # the held-out documents too
    assert "the 3 documents of --eval-features numeric" in printed
    assert printed.count("lowest ovl of a head") == 2  # held-out, then the folder

    summary = gate_metadata(out / "gate.safetensors")["training"]
    assert summary["agreement"] == m["agreement"]["all"]
    assert summary["eval_agreement"] == {"numeric": e["agreement"]["all"]}
    for a in (summary["agreement"], summary["eval_agreement"]["numeric"]):
        assert all(v is None or isinstance(v, float) for v in a.values())  # means only


@pytest.mark.parametrize("case", ["other model", "not a features folder", "missing shard",
                                  "--steps 0"])
def test_eval_features_bad_folder_is_one_line_and_exit_2(models, eval_folder, tmp_path, capsys,
                                                          case):
    folder, _ = eval_folder
    model = models["qwen"]
    if case == "other model":
        model = models["gemma"]
    elif case == "not a features folder":
        folder = tmp_path / "empty"
        folder.mkdir()
    elif case == "missing shard":
        import shutil
        shutil.copytree(eval_folder[0], tmp_path / "copy")
        folder = tmp_path / "copy"
        next((folder / "features").glob("*.safetensors")).unlink()
    expect = {"other model": "holds features of model qwen3, not of gemma3",
              "not a features folder": "is not a features folder",
              "missing shard": "1 of 3 feature shards are missing",
              "--steps 0": "--eval-features evaluates the trained gate"}[case]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        run_main(["--model", model, "--data", write_docs(tmp_path / "train", 2), "--tokens", 1000,
                  "--long-doc-tokens", 0, "--steps", 0 if case == "--steps 0" else 10, *SMALL,
                  "--out", out, "--eval-features", folder])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "Traceback" not in err and expect in err[-1], err
    if case != "--steps 0":  # (argparse's own refusal prints its usage line first)
        assert len(err) == 1 and err[0].startswith("error: "), err
    assert not out.exists()  # refused before any work
