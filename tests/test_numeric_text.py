"""offline/numeric_text.py (numeric-rich training text) and train_gate.py --mix-features (its
features mixed into the gate's training set)."""
import ast
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_teacher import tiny_model_folder
from test_train_gate import SMALL, run_main, sharpen, write_docs

import train_gate as TG
from offline import numeric_text as NT

REPO = Path(__file__).resolve().parents[1]
# the benchmark's modules: their sentences, names and word lists must not be the training text's
BENCHMARK = ("harness/quality.py", "harness/decode.py", "harness/ruler_tasks.py")
WORD = re.compile(r"[a-z]+")


def digit_share(text):
    return sum(c.isdigit() for c in text) / len(text)


def corpus(seed, n):
    return [NT.document(seed, i) for i in range(n)]


def test_documents_are_deterministic_varied_and_numeric():
    """The same seed and index give the same text (and do not depend on the other documents);
    another seed gives other text. Every kind is present, each document's length is in DOC_CHARS,
    and digits are a share of the text well above English prose's (the Persuasion chapter in
    examples/: 0.3%)."""
    docs = corpus(7, 24)
    assert docs == corpus(7, 24) and NT.document(7, 13) == docs[13]
    assert all(a[1] != b[1] for a, b in zip(docs, corpus(8, 24)))
    assert len({text for _, text in docs}) == len(docs)
    assert {kind for kind, _ in docs} == set(NT.KINDS)
    lo, hi = NT.DOC_CHARS
    assert all(lo <= len(text) <= hi for _, text in docs), [len(t) for _, t in docs]
    prose = digit_share((REPO / "examples" / "persuasion-chapter-1.txt").read_text("utf-8"))
    for kind in NT.KINDS:
        share = min(digit_share(t) for k, t in docs if k == kind)
        assert share > 0.15 and share > 20 * prose, (kind, share, prose)
    # the identifiers are drawn afresh: long numbers hardly repeat across documents
    numbers = [set(re.findall(r"\d{6,}", text)) for _, text in docs]
    shared = set.intersection(*numbers[:2])
    assert sum(map(len, numbers)) > 1000 and len(shared) < 5, shared
    # each section kind's formats (a kind's first section is its own)
    text = "\n".join(t for _, t in corpus(7, 120))
    for mark in ("asset ", '{"order": ', "Record ", "latency_ms=", "HTTP/1.1", "]: ", ",unit_price,",
                 "| total |", "Report ", "[upstream]", "services:", "[", "_PORT=", "CRC_POLY",
                 "#define", "INSERT INTO", "Incident summary."):
        assert mark in text, mark


def literals(path):
    """The string literals of a module (f-strings and .format templates too), each as the pieces
    between its placeholders."""
    pieces = []
    for node in ast.walk(ast.parse((REPO / path).read_text("utf-8"))):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        pieces.append(re.sub(r"\{[^{}]*\}", "\0", text).split("\0"))
    return pieces


def shingles(text, n=6):
    words = WORD.findall(text.lower())
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_no_sentence_name_or_word_list_of_the_benchmark():
    """No 6-word run of any string literal of the benchmark's modules is in a generated corpus
    (both seeds the documentation names); no template with its placeholders filled in matches
    (its fixed pieces, four words or more in all, in order on one line); no name of its
    owners, places, nouns or code words appears, nor its needle phrases."""
    from harness import decode, quality
    text = "\n".join(t for s in (1, 2) for _, t in corpus(s, 60))
    ours = shingles(text)
    for path in BENCHMARK:
        for pieces in literals(path):
            theirs = set().union(*(shingles(p) for p in pieces))
            assert not theirs & ours, (path, sorted(theirs & ours)[:3])
            for p in pieces:  # a short sentence of its own, word for word
                if len(WORD.findall(p.lower())) >= 4:
                    assert p.strip().lower() not in text.lower(), (path, p)
            words = [p for p in pieces if WORD.search(p.lower())]
            n_words = sum(len(WORD.findall(p.lower())) for p in words)
            if len(pieces) > 1 and len(words) >= 2 and n_words >= 4:  # a template's fixed parts
                pattern = r"[^\n]{0,80}?".join(re.escape(p.strip()) for p in words)
                hit = re.search(pattern, text, re.IGNORECASE)
                assert hit is None, (path, pieces, hit.group(0) if hit else None)
    lowered = set(WORD.findall(text.lower()))
    names = {w for owner in quality.OWNERS for w in WORD.findall(owner.lower()) if len(w) > 3}
    for group in (names, decode.NUMBER_NOUNS, decode.WORDS,
                  {w for p in decode.PLACES for w in p.split()} - {"north", "east", "old"}):
        assert not lowered & set(group), sorted(lowered & set(group))
    for phrase in ("pass key", "special magic", "code word", "remember it", "json data", "var "):
        assert phrase not in text.lower(), phrase


def run_generator(argv, capsys):
    with pytest.raises(SystemExit) as e:
        NT.main([str(a) for a in argv])
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_writes_atomically_resumes_and_never_overwrites(tmp_path, monkeypatch, capsys):
    """A run writes NNNNN-<kind>.txt files equal to document(seed, i); a larger --docs keeps the
    files already there (untouched) and adds the rest; a run killed mid-write leaves no partial
    file and its rerun ends as an uninterrupted one; a file or folder that is not this seed's own
    is refused in one line (exit 2) and left as it was."""
    out = tmp_path / "corpus"
    NT.main(["--out", str(out), "--docs", "3", "--seed", "5", "--quiet"])
    files = sorted(out.glob("*.txt"))
    assert [p.name for p in files] == [NT.file_name(i, NT.document(5, i)[0]) for i in range(3)]
    assert all(p.read_text("utf-8") == NT.document(5, i)[1] for i, p in enumerate(files))
    before = [p.stat().st_mtime_ns for p in files]
    assert "3 documents (3 written, 0 kept)" in capsys.readouterr().out

    # killed in the middle of the fifth document's write: the text is half on disk
    real = Path.write_text

    def dies_half_way(self, text, **kw):
        if self.name.startswith(".00004-"):
            real(self, text[:len(text) // 2], **kw)
            raise KeyboardInterrupt
        return real(self, text, **kw)

    monkeypatch.setattr(Path, "write_text", dies_half_way)
    code, err = run_generator(["--out", out, "--docs", 6, "--seed", 5, "--quiet"], capsys)
    assert code == 130 and "rerun the same command" in err[-1], err
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([NT.file_name(i, NT.document(5, i)[0]) for i in range(4)]
                           + [NT.RECORD]), names
    monkeypatch.setattr(Path, "write_text", real)
    NT.main(["--out", str(out), "--docs", "6", "--seed", "5", "--quiet"])
    assert "6 documents (2 written, 4 kept)" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in files] == before
    fresh = tmp_path / "fresh"
    NT.main(["--out", str(fresh), "--docs", "6", "--seed", "5", "--quiet"])
    assert ({p.name: p.read_bytes() for p in out.iterdir()}
            == {p.name: p.read_bytes() for p in fresh.iterdir()})

    # a user's edit is never overwritten
    files[1].write_text("my notes")
    code, err = run_generator(["--out", out, "--docs", 6, "--seed", 5, "--quiet"], capsys)
    assert code == 2 and len(err) == 1 and f"{files[1]} is not document 1 of --seed 5" in err[0]
    assert files[1].read_text() == "my notes"
    # another seed into the same folder
    code, err = run_generator(["--out", fresh, "--docs", 6, "--seed", 6, "--quiet"], capsys)
    assert code == 2 and len(err) == 1 and "--seed 5, version" in err[0], err
    # a folder of other files
    other = tmp_path / "other"
    other.mkdir()
    (other / "draft.txt").write_text("mine")
    code, err = run_generator(["--out", other, "--docs", 2, "--quiet"], capsys)
    assert code == 2 and len(err) == 1 and "not a numeric_text corpus" in err[0], err
    assert [p.name for p in other.iterdir()] == ["draft.txt"]
    code, err = run_generator(["--out", tmp_path / "x", "--docs", 0], capsys)
    assert code == 2 and "--docs must be >= 1" in err[-1]


def test_help_works(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["offline.numeric_text", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("offline.numeric_text", run_name="__main__")
    assert e.value.code == 0 and "--seed" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------
# train_gate.py --mix-features

@pytest.fixture(scope="module")
def mix_runs(tmp_path_factory):
    """A tiny model; the features of a word corpus (A) and of numeric text (B: the generator's
    documents cut to 500-800 characters: the tiny tokenizer has one token per byte), each with
    held-out documents."""
    root = tmp_path_factory.mktemp("mix")
    model = tiny_model_folder(root / "models", "qwen3", seed=1)
    sharpen(model)
    data_b = root / "numeric"
    data_b.mkdir()
    for i in range(6):
        kind, text = NT.document(3, i)
        (data_b / NT.file_name(i, kind)).write_text(text[:500 + 50 * i])
    base = ["--model", model, "--tokens", 3000, "--long-doc-tokens", 0, "--val-docs", 0.2,
            *SMALL]
    run_main([*base, "--data", write_docs(root / "words", 6, seed=2), "--steps", 0, "--out",
              root / "A"])
    run_main([*base, "--data", data_b, "--steps", 0, "--out", root / "B"])
    return root, [str(a) for a in base]


def manifest(folder):
    return json.loads((Path(folder) / "manifest.json").read_text())


def test_mixed_training_set_is_the_union_of_the_training_documents(mix_runs, monkeypatch,
                                                                     capsys):
    """--mix-features B: the tokens trained on are exactly A's training documents then B's (their
    hidden states and scores, shard by shard), the validation tokens exactly A's held-out
    documents; B's held-out documents are reported on their own (with their digits), and the gate
    file records the mix."""
    root, base = mix_runs
    seen = {}
    real = TG.train

    def spy(store, *a, **kw):
        seen["store"] = store
        return real(store, *a, **kw)

    monkeypatch.setattr(TG, "train", spy)
    run_main([*base, "--data", root / "words", "--out", root / "A", "--mix-features", root / "B",
              "--steps", 20, "--batch-tokens", 100])
    out = capsys.readouterr()
    store = seen["store"]
    train_idx, val_idx = TG.split(store)
    docs = lambda folder, split: [load_file(str(Path(folder) / d["shard"]))
                                  for d in manifest(folder)["documents"] if d["split"] == split]
    expect_train = docs(root / "A", "train") + docs(root / "B", "train")
    expect_val = docs(root / "A", "val")
    assert expect_val and docs(root / "B", "val")  # both folders hold held-out documents
    hidden = store.load_layers(slice(None))
    for idx, expect in ((train_idx, expect_train), (val_idx, expect_val)):
        assert torch.equal(store.scores[:, :, idx], torch.cat([s["scores"] for s in expect], -1))
        assert torch.equal(hidden[:, idx], torch.cat([s["hidden"] for s in expect], 1))

    m = json.loads((root / "A" / "metrics.json").read_text())
    n_b = [d for d in manifest(root / "B")["documents"] if d["split"] == "train"]
    assert m["n_train"] == len(train_idx) and m["mix_features"]["train_documents"] == len(n_b)
    assert m["mix_features"]["train_tokens"] == sum(d["tokens"] for d in n_b)
    a = m["mix_agreement"]
    assert a and len(a["spearman"]) == len(m["layers"])
    assert all(x is not None for x in a["digits_teacher@0.5"])  # numeric text: digits counted
    assert "--mix-features held-out documents" in out.out and "--mix-features: " in out.err
    from formats.gate_file import gate_metadata
    meta = gate_metadata(root / "A" / "gate.safetensors")["training"]
    assert meta["mix_features"] == m["mix_features"]


@pytest.mark.parametrize("case", ["other teacher", "no manifest", "itself", "missing shard",
                                  "steps 0"])
def test_mix_features_of_another_kind_are_refused_in_one_line(mix_runs, tmp_path, capsys, case):
    """A --mix-features folder made with other model or teacher settings (here --teacher-chunk), one
    that is no features folder, --out itself, or one with a shard missing: refused in one line,
    exit 2, before any training; so is the flag without training (--steps 0)."""
    import shutil
    root, base = mix_runs
    mix, steps = tmp_path / "mix", 10
    expect = {"other teacher": "holds features of other settings than this run's (teacher "
                               "differ)",
              "no manifest": "no manifest.json there", "itself": "is --out itself",
              "missing shard": "doc00001.safetensors: missing",
              "steps 0": "--mix-features joins features at training: it needs --steps > 0"}[case]
    if case == "other teacher":
        chunk = base.index("--teacher-chunk") + 1
        argv = [*base[:chunk], "100", *base[chunk + 1:]]
        run_main([*argv, "--data", root / "numeric", "--steps", 0, "--out", mix])
        capsys.readouterr()
    elif case == "no manifest":
        mix.mkdir()
    elif case == "itself":
        mix = root / "A"
    elif case == "missing shard":
        shutil.copytree(root / "B", mix)
        (mix / "features" / "doc00001.safetensors").unlink()
    else:
        mix, steps = root / "B", 0
    listing = lambda: sorted((p.name, p.stat().st_mtime_ns) for p in (root / "A").rglob("*"))
    before = listing()
    with pytest.raises(SystemExit) as e:
        run_main([*base, "--data", root / "words", "--out", root / "A", "--mix-features", mix,
                  "--steps", steps, "--batch-tokens", 100])
    err = capsys.readouterr().err.strip().splitlines()
    # argparse's refusal (steps 0) comes after its usage lines
    assert e.value.code == 2 and (len(err) == 1 or case == "steps 0") and expect in err[-1], err
    assert listing() == before  # nothing trained, nothing written
