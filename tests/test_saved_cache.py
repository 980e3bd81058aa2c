"""A compressed cache saved to a file and answered from later (formats/cache_file.py).

The oracle is the cache that was saved: with greedy decoding a question answered from the loaded
cache gets the same tokens (and bit-equal logits) as from the saved one, in this process and in
another, for every method, budgets 1.0 and 0.3, decode-time eviction on and off, on tiny random
models of each family. Every file that must be refused is refused in one line; nothing is written
half. The command line: --save-cache, --load-cache and "cache_file" in --batch, the same way."""
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cache as C
import cli
import gate
import model as M
from cache import Budget, decode_protected
from commands.generate import build_inputs
from formats import tensor_file
from formats.cache_file import CacheFileError, load_cache, read_header, save_cache
from formats.gate_file import gate_sha256, resolve_gate, save_gate
from gate import Gates
from generate import METHODS, begin_answer, decode_one, make_cache, prefill, prefill_kvzip, sample
from prompts import prompt_format
from serving.batch import Batch
from teacher import KVzipTeacher
from tests.helpers import edit_config, run_main, tiny_checkpoint, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# two chunks of context; decode-time eviction back to 16 tokens per head beyond the system prompt and
# the local window it always keeps (decode_budget)
CHUNK, WINDOW, DECODE = 32, 8, 16
N_CONTEXT, QUESTION = 70, [40, 41, 42, 43]


def random_gates(cfg):
    torch.manual_seed(0)
    gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                  cfg.group_size)
    with torch.no_grad():  # spread the scores out (the init's zeros give ties)
        gates.b.normal_()
        gates.k_base.normal_()
    return gates


def tiny_setup(arch, folder):
    tiny_checkpoint(arch, folder, max_position_embeddings=1024)
    tiny_tokenizer(folder)
    model = M.load_model(folder, "cpu", torch.float32)
    gates = random_gates(model.config)
    # beside the folder: every *.safetensors in it is a weight file
    gate_file = folder.with_name(folder.name + "-gate.safetensors")
    save_gate(gate_file, gates)
    return dict(folder=folder, gate_file=gate_file, model=model, tok=M.load_tokenizer(folder),
                gates=gates, fmt=prompt_format(model.config, str(folder), chat=True))


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    """Qwen3 (every layer compressed), Gemma3 (sliding-window rings beside one compressed layer)."""
    return tiny_setup(request.param, tmp_path_factory.mktemp(request.param))


def prompt(t):
    system = t["tok"].encode(t["fmt"].system, add_special_tokens=False).ids
    g = torch.Generator().manual_seed(1)
    return system + torch.randint(40, 200, (N_CONTEXT,), generator=g).tolist(), len(system)


def decode_budget(method, n_protected, decode, cfg, window=None):
    """DECODE as a decode_tokens_per_head: that many rows per head beyond the protected ones (the
    window: make_cache's default on cfg's model, unless given)."""
    if decode is None:
        return None
    if window is None:
        window = (gate.GateScorer if method == "fastkvzip" else gate.Scorer).window_at_decode(cfg)
    return decode_protected(n_protected, window) + decode


def prefilled(t, method, name, ids, n_protected, budget, decode, window=None, buffer=None):
    """make_cache, then the method's prefill (KVzip's with its teacher) -> (cache, the last logits).
    window, buffer: decode-time eviction's window and buffer (default: the method's, 128 each)."""
    model, plan = t["model"], Budget(budget, CHUNK, WINDOW)
    cache = make_cache(method, model, n_protected,
                       decode_tokens_per_head=decode_budget(method, n_protected, decode,
                                                           model.config, window),
                       gates=t["gates"], decode_window=window)
    if buffer is not None:
        cache.decode_buffer = buffer  # tokens decoded between two decode-time evictions
    with torch.no_grad():
        if method == "kvzip":
            teacher = KVzipTeacher(model, t["tok"], t["fmt"])
            last = prefill_kvzip(model, teacher, cache, ids, n_protected, plan)
        else:
            last = prefill(model, cache, ids, n_protected, plan)
    return cache, last


def compressed(t, method, budget, decode):
    """A prefilled cache as generate.run makes it -> (cache, prompt ids, the last logits)."""
    ids, n_protected = prompt(t)
    m = "full" if budget == 1.0 and decode is None else method
    cache, last = prefilled(t, m, "tiny", ids, n_protected, budget, decode)
    return cache, ids, last


def greedy(model, cache, logits, n, question=None):
    """n greedy tokens (the question first, when given) -> (tokens, the logits after the last)."""
    out = []
    with torch.no_grad():
        if question is not None:
            logits = begin_answer(model, cache, question, logits)
        for _ in range(n):
            out.append(sample(logits))
            logits = decode_one(model, cache, out[-1])
    return out, logits


def kept(cache):
    return [[sorted(kv.head_pos(h).tolist()) for h in range(kv.n_heads)] for kv in cache.layers]


def scorer_for(t, method, decode):
    """The scorer generate.py would give load_cache: the one make_cache builds for the method."""
    cfg = t["model"].config
    cache = make_cache(method, t["model"], 0,
                       decode_tokens_per_head=decode_budget(method, 0, decode, cfg), gates=t["gates"])
    return getattr(cache, "scorer", None)  # a full cache has none


CASES = [(m, b, d) for m in METHODS for b in (1.0, 0.3) for d in (None, DECODE)
         if (d is None and m != "rkv") or (d is not None and m not in ("kvzip", "full"))]
N_NEW = 140  # past 128 decoded tokens: decode-time eviction runs once


@pytest.mark.parametrize("method, budget, decode", CASES)
def test_loaded_cache_answers_as_the_saved_one(tiny, tmp_path, method, budget, decode):
    """Save right after prefill, answer from both; then save again mid-answer (decode-time
    eviction's buffer holds the question and 60 tokens, unscored) and go on from both, past the
    128th token where it evicts."""
    model, path = tiny["model"], tmp_path / "doc.kv"
    cache, ids, last = compressed(tiny, method, budget, decode)
    # what the cache is (as generate.prefill_request names it): a full KVCache is "full" and keeps
    # it all, 1.0
    full = budget == 1.0 and decode is None or method == "full"
    name, kept_budget = ("full", 1.0) if full else (method, budget)
    save_cache(path, cache, model, ids, last, method=name, budget=budget, chunk_size=CHUNK,
               window=WINDOW)
    saved_bytes = path.read_bytes()
    loaded, info = load_cache(path, model, scorer_for(tiny, method, decode))
    assert info["ids"] == ids and info["budget"] == kept_budget and info["method"] == name
    assert torch.equal(info["last_logits"], last)
    assert kept(loaded) == kept(cache)
    assert getattr(loaded, "decode_level", None) == getattr(cache, "decode_level", None)
    want, want_logits = greedy(model, cache, last, N_NEW, QUESTION)
    got, got_logits = greedy(model, loaded, info["last_logits"], N_NEW, QUESTION)
    assert got == want
    assert torch.equal(got_logits, want_logits)
    assert kept(loaded) == kept(cache)
    assert path.read_bytes() == saved_bytes, "answering from a loaded cache wrote into its file"

    # mid-answer: decoding on, 60 tokens buffered (with decode-time eviction) and not yet scored
    cache, ids, last = compressed(tiny, method, budget, decode)
    head, logits = greedy(model, cache, last, 60, QUESTION)
    if decode is not None:
        assert sum(h.shape[0] for h in cache.buffer[cache.compressed[0]]) == 60 + len(QUESTION)
    save_cache(path, cache, model, ids, logits, method=name, budget=budget)
    loaded, info = load_cache(path, model, scorer_for(tiny, method, decode))
    want, want_logits = greedy(model, cache, logits, N_NEW - 60)
    got, got_logits = greedy(model, loaded, info["last_logits"], N_NEW - 60)
    assert got == want and torch.equal(got_logits, want_logits)
    assert kept(loaded) == kept(cache)


def test_the_file_holds_the_kept_rows_and_what_made_them(tiny, tmp_path):
    """At budget 0.3 the file's K/V bytes are what the compressed layers kept (and the sliding
    windows): no slack, no evicted row; its metadata names model, method, budget, plan, context."""
    model, path = tiny["model"], tmp_path / "doc.kv"
    cache, ids, last = compressed(tiny, "fastkvzip", 0.3, None)
    save_cache(path, cache, model, ids, last, method="fastkvzip", budget=0.3, chunk_size=CHUNK,
               window=WINDOW)
    header, state = read_header(path)
    rows = sum(int(kv.lens.sum()) for kv in cache.layers)
    kv_bytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                   if k.endswith((".k", ".v")))
    assert kv_bytes == rows * 2 * model.config.head_dim * 4
    n_protected = len(ids) - N_CONTEXT  # the system prompt, kept whole
    context = sum(int((cache.layers[i].pos >= n_protected).sum()) for i in cache.compressed)
    full = N_CONTEXT * model.config.num_key_value_heads * len(cache.compressed)
    assert 0.25 * full <= context <= 0.3 * full
    assert state["model"] == model.identity and state["dtype"] == "float32"
    assert (state["method"], state["budget"], state["level"]) == ("fastkvzip", 0.3, "global")
    assert state["n_context"] == N_CONTEXT and state["n_protected"] == len(ids) - N_CONTEXT
    assert state["plan"] == vars(C.plan_prefill(N_CONTEXT, 0.3, CHUNK, WINDOW))
    assert state["gate_sha256"] == gate_sha256(tiny["gates"])


def test_decode_level_is_saved_and_a_file_without_it_decodes_at_its_level(tiny, tmp_path,
                                                                          monkeypatch):
    """The file keeps decode-time eviction's level; one saved before the field existed (its caches
    decoded at their level) loads with decode_level = level."""
    from formats import cache_file
    model = tiny["model"]
    cache, ids, last = compressed(tiny, "fastkvzip", 0.3, DECODE)
    cache.decode_level = "head"
    save_cache(tmp_path / "new.kv", cache, model, ids, last, method="fastkvzip", budget=0.3)
    assert read_header(tmp_path / "new.kv")[1]["decode_level"] == "head"
    scorer = scorer_for(tiny, "fastkvzip", DECODE)
    loaded, _ = load_cache(tmp_path / "new.kv", model, scorer)
    assert (loaded.level, loaded.decode_level) == ("global", "head")
    saved = cache_file._saved

    def before(cache):  # the state as it was written before decode_level
        tensors, state = saved(cache)
        del state["decode_level"]
        return tensors, state
    monkeypatch.setattr(cache_file, "_saved", before)
    save_cache(tmp_path / "old.kv", cache, model, ids, last, method="fastkvzip", budget=0.3)
    assert b"decode_level" not in (tmp_path / "old.kv").read_bytes()
    loaded, _ = load_cache(tmp_path / "old.kv", model, scorer)
    assert (loaded.level, loaded.decode_level) == ("global", "global")


SUBPROCESS = """
import json, sys, torch
import model as M
from formats.cache_file import load_cache
from formats.gate_file import load_gate
from generate import make_cache
from tests.test_saved_cache import greedy
spec = json.load(open(sys.argv[1]))
model = M.load_model(spec["folder"], "cpu", torch.float32)
gates = load_gate(spec["gate"], model.config)
out = []
for case in spec["cases"]:
    made = make_cache(case["method"], model, 0, decode_tokens_per_head=case["decode"],
                      gates=gates)
    scorer = getattr(made, "scorer", None)
    cache, info = load_cache(case["file"], model, scorer)
    out.append(greedy(model, cache, info["last_logits"], case["n"], case["question"])[0])
print(json.dumps(out))
"""


def test_another_process_answers_the_same(tiny, tmp_path):
    """Every case of the test above, saved here, answered in a fresh Python process (its own model
    loaded from the folder, its own gate from the gate file): the same tokens."""
    cases, want = [], []
    for i, (method, budget, decode) in enumerate(CASES):
        cache, ids, last = compressed(tiny, method, budget, decode)
        save_cache(tmp_path / f"{i}.kv", cache, tiny["model"], ids, last)  # what it is: derived
        want.append(greedy(tiny["model"], cache, last, N_NEW, QUESTION)[0])
        cases.append(dict(file=str(tmp_path / f"{i}.kv"), method=method,
                          decode=decode_budget(method, 0, decode, tiny["model"].config), n=N_NEW,
                          question=QUESTION))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(dict(folder=str(tiny["folder"]), gate=str(tiny["gate_file"]),
                                    cases=cases)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", SUBPROCESS, str(spec)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for case, g, w in zip(CASES, got, want):
        assert g == w, f"{case}: another process answered differently"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_other_families(arch, tmp_path):
    """Llama and Qwen2 (no QK-norm; Qwen2's q/k/v biases): the gate at 0.3, decode-time eviction."""
    t = tiny_setup(arch, tmp_path / arch)
    cache, ids, last = compressed(t, "fastkvzip", 0.3, DECODE)
    save_cache(tmp_path / "doc.kv", cache, t["model"], ids, last)
    loaded, info = load_cache(tmp_path / "doc.kv", t["model"], scorer_for(t, "fastkvzip", DECODE))
    want, want_logits = greedy(t["model"], cache, last, N_NEW, QUESTION)
    got, got_logits = greedy(t["model"], loaded, info["last_logits"], N_NEW, QUESTION)
    assert got == want and torch.equal(got_logits, want_logits)


@pytest.fixture(scope="module", params=cli.OFFLINE_MODELS)
def offline(request):
    """An offline model (Gemma 3 270M, SmolLM2-135M) with its bundled gate and prompt format."""
    folder = cli.resolve_model(request.param)
    model, tok = M.load_model(folder, "cpu", torch.float32), M.load_tokenizer(folder)
    fmt = prompt_format(model.config, request.param)
    gates = resolve_gate(None, model.config, request.param)  # the bundled gate
    return dict(name=request.param, model=model, tok=tok, fmt=fmt, gates=gates)


@pytest.mark.parametrize("method, decode", [(m, None) for m in METHODS] + [("fastkvzip", DECODE)])
def test_offline_models_answer_the_same_from_a_file(offline, tmp_path, method, decode):
    """The offline models at budget 0.3 (full: 1.0), every method, the gate also with decode-time
    eviction: the file answers as the cache that was saved. The eviction's window and buffer are
    16 tokens, not 128, so that its evictions, which the file's settings must reproduce, come
    within the 36 tokens answered (each one drops context rows: 30% of ~130 kept, beyond 16 + 4)."""
    t = offline
    text = "Emma Woodhouse lives at Hartfield with her father. " * 12
    ids, n_protected, [(_, q)] = build_inputs(t["tok"], t["fmt"], text, ["Where?"])
    budget = 1.0 if method == "full" else 0.3
    window = buffer = DECODE if decode else None
    cache, last = prefilled(t, method, t["name"], ids, n_protected, budget, decode, window, buffer)
    save_cache(tmp_path / "doc.kv", cache, t["model"], ids, last, n_protected=n_protected)
    scorer = getattr(cache, "scorer", None) if decode else None
    loaded, info = load_cache(tmp_path / "doc.kv", t["model"], scorer)
    n = 2 * DECODE + 4 if decode else 8
    held = lambda c: sum(c.layers[layer].n_rows for layer in c.compressed)
    before = held(cache) if decode else None
    want = greedy(t["model"], cache, last, n, q)
    got = greedy(t["model"], loaded, info["last_logits"], n, q)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    if decode:  # the file kept the settings, and the answers crossed evictions that dropped rows
        assert (loaded.decode_window, loaded.decode_buffer) == (DECODE, DECODE)
        grown = (len(q) + n) * cache.cfg.num_key_value_heads * len(cache.compressed)
        assert held(loaded) == held(cache) < before + grown


# -- refusals: one line each, nothing loaded, nothing written half --------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Gemma3's cache at 0.3 with decode-time eviction, saved once; tests damage copies."""
    folder = tmp_path_factory.mktemp("saved")
    t = tiny_setup("gemma3", folder / "model")
    cache, ids, last = compressed(t, "fastkvzip", 0.3, DECODE)
    save_cache(folder / "doc.kv", cache, t["model"], ids, last)
    return t, folder / "doc.kv"


def refused(path, model, scorer, *words):
    with pytest.raises(CacheFileError) as e:
        load_cache(path, model, scorer)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_refuses_another_model_tokenizer_or_dtype(saved, tmp_path):
    t, path = saved
    scorer = scorer_for(t, "fastkvzip", DECODE)
    qwen = M.load_model(tiny_checkpoint("qwen3", tmp_path / "qwen3"), "cpu", torch.float32)
    refused(path, qwen, scorer, "another model", "config")
    other_weights = tiny_checkpoint("gemma3", tmp_path / "seed1", seed=1,
                                    max_position_embeddings=1024)
    tiny_tokenizer(other_weights)
    refused(path, M.load_model(other_weights, "cpu", torch.float32), scorer, "other weights")
    other_tok = tmp_path / "tok"
    shutil.copytree(t["folder"], other_tok)
    spec = json.loads((other_tok / "tokenizer.json").read_text())
    spec["added_tokens"][-1]["content"] = "<other>"
    (other_tok / "tokenizer.json").write_text(json.dumps(spec))
    refused(path, M.load_model(other_tok, "cpu", torch.float32), scorer, "another tokenizer")
    refused(path, M.load_model(t["folder"], "cpu", torch.bfloat16), scorer, "float32", "bfloat16")
    # the same model in another folder, its config.json written with other spacing: the same one
    same = tmp_path / "same"
    shutil.copytree(t["folder"], same)
    edit_config(same, lambda d: d)
    load_cache(path, M.load_model(same, "cpu", torch.float32), scorer)


def test_refuses_another_scorer_or_gate(saved):
    t, path = saved
    refused(path, t["model"], None, "evicts while decoding", "GateScorer")
    refused(path, t["model"], scorer_for(t, "random", DECODE), "GateScorer", "RandomScorer")
    other = Gates(1, t["model"].config.hidden_size, 2, 2)
    made = make_cache("fastkvzip", t["model"], 0,
                      decode_tokens_per_head=decode_budget("fastkvzip", 0, DECODE,
                                                           t["model"].config), gates=other)
    refused(path, t["model"], made.scorer, "another gate")


def damaged(path, tmp_path, fn, name="bad.kv"):
    data = bytearray(path.read_bytes())
    out = tmp_path / name
    out.write_bytes(bytes(fn(data)))
    return out


def test_refuses_another_format_version(saved, tmp_path):
    t, path = saved
    version = b'"format_version":"1"'
    bad = damaged(path, tmp_path, lambda d: d.replace(version, version.replace(b"1", b"2")))
    refused(bad, t["model"], None, "format version 2", "reads version 1")
    refused(t["gate_file"], t["model"], None, "not a saved KV cache")  # another kind of safetensors


@pytest.mark.parametrize("keep", [0, 5, 8, 100, 0.5, -1])
def test_refuses_a_truncated_file(saved, tmp_path, keep):
    t, path = saved
    n = path.stat().st_size
    cut = int(n * keep) if isinstance(keep, float) else n + keep if keep < 0 else keep
    bad = damaged(path, tmp_path, lambda d: d[:cut])
    refused(bad, t["model"], scorer_for(t, "fastkvzip", DECODE), "truncated")


@pytest.mark.parametrize("where", ["header", "keys", "checksum"])
def test_refuses_a_corrupt_file(saved, tmp_path, where):
    """A flipped bit: in the header's JSON (in a number: still JSON), in a key, in the checksum."""
    t, path = saved
    header, _ = read_header(path)
    n = int.from_bytes(path.read_bytes()[:8], "little")

    def flip(d):
        if where == "header":
            i = d.index(b'n_seen\\": ') + len(b'n_seen\\": ')  # a digit of the JSON inside the JSON
        elif where == "keys":
            i = 8 + n + header["layer.2.k"]["data_offsets"][0] + 3
        else:
            i = len(d) - 1
        d[i] ^= 0x01
        return d
    bad = damaged(path, tmp_path, flip)
    refused(bad, t["model"], scorer_for(t, "fastkvzip", DECODE), "corrupt")


def test_a_full_disk_writes_nothing(saved, tmp_path, monkeypatch):
    """A write that fails (ENOSPC) midway: one line naming the file, no file and no temporary left,
    and a cache saved there before is still whole."""
    t, path = saved
    cache, info = load_cache(path, t["model"], scorer_for(t, "fastkvzip", DECODE))
    target = tmp_path / "doc.kv"
    shutil.copy(path, target)
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(memoryview(data).cast("B"))
            if self.written > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(tensor_file, "open", lambda *a, **kw: FullDisk(real_open(*a, **kw)), raising=False)
    for dest in (target, tmp_path / "new.kv"):
        with pytest.raises(cli.WriteError) as e:
            save_cache(dest, cache, t["model"], info["ids"], info["last_logits"])
        assert str(e.value) == f"cannot write {dest}: No space left on device"
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.kv"]
    assert target.read_bytes() == path.read_bytes()
    load_cache(target, t["model"], scorer_for(t, "fastkvzip", DECODE))


def test_a_batch_member_is_not_saved(saved, tmp_path):
    t, path = saved
    cache, info = load_cache(path, t["model"], scorer_for(t, "fastkvzip", DECODE))
    begin_answer(t["model"], cache, [], info["last_logits"])  # a member decodes (Batch.join)
    batch = Batch(t["model"].config)
    batch.join(cache)
    with pytest.raises(ValueError, match="leave the batch"):
        save_cache(tmp_path / "x.kv", cache, t["model"], info["ids"], info["last_logits"])
    assert not (tmp_path / "x.kv").exists()


# -- the command line: generate.py --save-cache / --load-cache, "cache_file" in --batch ------------

@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    """A tiny Gemma3 folder with a byte tokenizer and a random gate file, and a document."""
    folder = tmp_path_factory.mktemp("cli")
    t = tiny_setup("gemma3", folder / "model")
    (folder / "doc.txt").write_text("Emma lives in Highbury. The code is 4721. " * 8)
    return t, folder


def one_line_error(code, err, *words):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]


QUESTIONS = ["What is the code?", "Where does Emma live?"]


@pytest.mark.parametrize("decode", [None, "270", "270 λ 0"])
def test_cli_answers_from_a_saved_cache_as_from_the_prefill(capsys, cli_model, tmp_path, decode):
    """--save-cache answers and saves in one run; --load-cache (no context, no prefill) answers the
    same questions with the same tokens; --json stats say where the cache came from and the time.
    --decode-redundancy is the file's too: the loaded cache decodes with the saved λ."""
    t, folder = cli_model
    kv = tmp_path / "doc.kv"
    decode, lam = (decode.split(" λ ") + [None])[:2] if decode else (None, None)
    flags = ["--model", str(t["folder"]), "--gate", str(t["gate_file"]), "--max-new-tokens",
             "140", "--json"] + (["--decode-tokens-per-head", decode] if decode else [])
    flags += ["--decode-redundancy", lam] if lam else []
    qs = [w for q in QUESTIONS for w in ("--question", q)]
    code, out, err = run_main(capsys, *flags, "--context-file", str(folder / "doc.txt"), "--budget",
                              "0.3", "--window", "8", "--save-cache", str(kv), *qs)
    assert code == 0, err
    made = json.loads(out)
    assert made["stats"]["cache_source"] == "prefill" and made["stats"]["cache_file"] == str(kv)
    assert made["stats"]["save_seconds"] > 0 and kv.is_file()
    assert read_header(kv)[1]["decode_redundancy"] == float(lam or 4)  # Gemma's default: 4
    load_flags = [f for f in flags if f not in ("--decode-tokens-per-head", decode,
                                                "--decode-redundancy", lam)]
    code, out, err = run_main(capsys, *load_flags, "--load-cache", str(kv), *qs)
    assert code == 0, err
    got = json.loads(out)
    assert got["prompt_ids"] == made["prompt_ids"]
    assert [a["output_ids"] for a in got["answers"]] == [a["output_ids"] for a in made["answers"]]
    assert len(made["answers"][0]["output_ids"]) == 140  # past 128: decode-time eviction ran
    s = got["stats"]
    assert s["cache_source"] == "file" and s["cache_file"] == str(kv) and s["load_seconds"] > 0
    assert s["prefill_seconds"] is None and (s["method"], s["budget"]) == ("fastkvzip", 0.3)
    for key in ("kept_fraction", "kept_fraction_per_layer", "kv_bytes", "context_tokens"):
        assert s[key] == made["stats"][key], key
    code, _, err = run_main(capsys, *load_flags[:-1], "--load-cache", str(kv), *qs)  # summary line
    assert code == 0 and f"loaded from {kv}" in err and "no prefill" in err, err


def test_batch_request_from_a_file_equals_the_same_request_prefilled(capsys, cli_model, tmp_path):
    t, folder = cli_model
    kv = tmp_path / "doc.kv"
    flags = ["--model", str(t["folder"]), "--gate", str(t["gate_file"]), "--max-new-tokens", "12",
             "--window", "8"]
    doc = ["--context-file", str(folder / "doc.txt")]
    code, _, err = run_main(capsys, *flags, *doc, "--save-cache", str(kv), "--max-new-tokens", "0")
    assert code == 0, err
    lines = [{"context_file": str(folder / "doc.txt"), "questions": QUESTIONS},
             {"cache_file": str(kv), "questions": QUESTIONS},
             {"context": "Water boils at 100 degrees.", "questions": ["At what?"], "budget": 1.0}]
    (tmp_path / "req.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code, out, err = run_main(capsys, *flags, "--batch", str(tmp_path / "req.jsonl"),
                              "--batch-size", "3")
    assert code == 0, err
    prefilled, loaded, _ = [json.loads(x) for x in out.strip().splitlines()]
    assert loaded["prompt_ids"] == prefilled["prompt_ids"]
    answers = lambda res: [a["output_ids"] for a in res["answers"]]
    assert answers(loaded) == answers(prefilled)
    sources = prefilled["stats"]["cache_source"], loaded["stats"]["cache_source"]
    assert sources == ("prefill", "file")


def test_cli_refusals(capsys, cli_model, tmp_path):
    """One line each, before the weights load where it can be: --load-cache with a context or a
    budget (the file decided them), a file of another model, dtype or prompt format, a corrupt file,
    a batch line with a cache_file and a budget; --save-cache with --batch; a failed write."""
    t, folder = cli_model
    kv = tmp_path / "doc.kv"
    base = ["--model", str(t["folder"]), "--gate", str(t["gate_file"])]
    doc = ["--context-file", str(folder / "doc.txt")]
    code, _, err = run_main(capsys, *base, *doc, "--save-cache", str(kv), "--max-new-tokens", "0",
                            "--window", "8")
    assert code == 0, err
    for flags, words in [(["--context-file", "x.txt"], ["--load-cache", "drop --context-file"]),
                         (["--prompt", "hi"], ["drop --prompt"]),
                         (["--budget", "0.3"], ["drop --budget"]),
                         (["--decode-tokens-per-head", "40"], ["drop --decode-tokens-per-head"]),
                         (["--batch", "r.jsonl"], ["drop --batch", "cache_file"]),
                         (["--dtype", "bfloat16"], ["float32", "bfloat16"]),
                         (["--no-chat"], ["another prompt format", "--chat"])]:
        res = run_main(capsys, *base, "--load-cache", str(kv), "--question", "q", *flags)
        one_line_error(*res[::2], *words)
    other = tiny_setup("qwen3", tmp_path / "qwen3")
    capsys.readouterr()  # transformers' progress bars
    res = run_main(capsys, "--model", str(other["folder"]), "--load-cache", str(kv), "--question",
                   "q")
    one_line_error(*res[::2], str(kv), "another model")
    bad = tmp_path / "bad.kv"
    bad.write_bytes(kv.read_bytes()[:-100])
    res = run_main(capsys, *base, "--load-cache", str(bad), "--question", "q")
    one_line_error(*res[::2], "truncated")
    res = run_main(capsys, *base, "--load-cache", str(tmp_path / "none.kv"), "--question", "q")
    one_line_error(*res[::2], "none.kv", "No such file")
    (tmp_path / "r.jsonl").write_text(json.dumps({"cache_file": str(kv), "budget": 0.5}) + "\n")
    res = run_main(capsys, *base, "--batch", str(tmp_path / "r.jsonl"))
    one_line_error(*res[::2], "line 1", "drop \"budget\"")
    res = run_main(capsys, *base, "--batch", str(tmp_path / "r.jsonl"), "--save-cache", str(kv))
    one_line_error(*res[::2], "--save-cache", "drop --batch")
    missing = tmp_path / "no-such-folder" / "x.kv"  # a write that fails: one line, no file
    res = run_main(capsys, *base, *doc, "--save-cache", str(missing), "--max-new-tokens", "0")
    one_line_error(*res[::2], "cannot write", str(missing))
