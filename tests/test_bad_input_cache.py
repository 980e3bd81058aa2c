"""Bad input to a saved cache and to the library's cache API: every
file that is not what save_cache wrote, or was crafted with a valid checksum, is refused in one line
(CacheFileError; the command line: exit 2, nothing printed on stdout) before anything reads it;
library misuse fails at once with a message that says what to give instead."""
import copy
import json
import os
import struct
import threading

import pytest
import torch
from safetensors.torch import load_file

from cache import Budget, EvictingCache
from formats.cache_file import CacheFileError, load_cache, read_header, save_cache
from formats.tensor_file import write_safetensors
from generate import Compression, answer, load_request, make_cache, prefill
from kernels import ArgumentError
from tests.helpers import run_main
from tests.test_saved_cache import (
    CHUNK,
    DECODE,
    WINDOW,
    compressed,
    damaged,
    decode_budget,
    kept,
    prompt,
    refused,
    scorer_for,
    tiny_setup,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Gemma3's fastkvzip cache at 0.3 with decode-time eviction, saved as the README does
    (no method, no budget given); tests craft copies of it."""
    folder = tmp_path_factory.mktemp("saved")
    t = tiny_setup("gemma3", folder / "model")
    cache, ids, last = compressed(t, "fastkvzip", 0.3, DECODE)
    save_cache(folder / "doc.kv", cache, t["model"], ids, last)
    return t, folder / "doc.kv"


def craft(src, dst, state_fn=None, tensors_fn=None):
    """A copy of cache file src with its state and tensors edited, written with a valid checksum
    (what a tester crafts by hand)."""
    header, state = read_header(src)
    tensors = load_file(str(src))
    tensors.pop("checksum")
    state = copy.deepcopy(state)
    if state_fn:
        state = state_fn(state) or state
    if tensors_fn:
        tensors_fn(tensors)
    meta = dict(header["__metadata__"], fastkvzip=json.dumps(state))
    write_safetensors(dst, tensors, meta)
    return dst


def load(t, path):
    return load_cache(path, t["model"], scorer_for(t, "fastkvzip", DECODE))


def refuse(t, path, *words):
    """Refused by read_header (before a model loads) and by load_cache, one line naming path."""
    with pytest.raises(CacheFileError) as e:
        read_header(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    refused(path, t["model"], scorer_for(t, "fastkvzip", DECODE), *words)
    return msg


def cli_load(capsys, t, path):
    return run_main(capsys, "--model", str(t["folder"]), "--gate", str(t["gate_file"]),
                    "--load-cache", str(path), "--question", "What?", "--max-new-tokens", "3")


def one_line(code, out, err, *words):
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]


# -- one open file ---------------------------------------------------------------------------------

def test_a_file_replaced_while_it_loads_is_read_from_the_one_opened(saved, tmp_path, monkeypatch):
    """The path is replaced by another cache of the same prompt (full, budget 1.0) just after the
    load opened it: the load answers with the opened file's state AND its rows, never a mix."""
    t, path = saved
    want, want_info = load(t, path)
    full, ids, last = compressed(t, "fastkvzip", 1.0, None)
    other = tmp_path / "full.kv"
    save_cache(other, full, t["model"], ids, last, method="full", budget=1.0)
    target = tmp_path / "doc.kv"
    target.write_bytes(path.read_bytes())
    real_fstat, replaced = os.fstat, []

    def fstat(fd):  # the first fstat comes right after the file is opened
        if not replaced:
            replaced.append(os.replace(other, target))
        return real_fstat(fd)
    monkeypatch.setattr(os, "fstat", fstat)
    got, info = load(t, target)
    monkeypatch.undo()
    assert replaced and target.read_bytes() != path.read_bytes()  # the path now holds the full one
    assert (info["method"], info["budget"]) == (want_info["method"], want_info["budget"])
    assert kept(got) == kept(want) and got.nbytes == want.nbytes


# -- crafted states with a valid checksum; the library's values -----------------------------------

@pytest.mark.parametrize("edit, words", [
    (lambda s: s.update(n_seen=-100), ["corrupt", "'n_seen'"]),
    (lambda s: s.update(n_seen=s["n_prompt"] - 1), ["corrupt", "n_seen"]),
    (lambda s: s.update(budget=7.5), ["corrupt", "'budget'"]),
    (lambda s: s.update(budget=0), ["corrupt", "'budget'"]),
    (lambda s: s.update(decode_window=-5), ["corrupt", "'decode_window'"]),
    (lambda s: s.update(decode_redundancy=-1.0), ["corrupt", "'decode_redundancy'"]),
    (lambda s: s.update(decode_redundancy="4"), ["corrupt", "'decode_redundancy'"]),
    (lambda s: s.update(decode_redundancy=2.0, scorer="RandomScorer", gate_sha256=None,
                        method="random"), ["corrupt", "redundancy factor without a gate"]),
    (lambda s: s.update(n_context=3), ["corrupt", "n_context"]),
])
def test_crafted_state_values_are_refused(saved, tmp_path, edit, words):
    t, path = saved
    refuse(t, craft(path, tmp_path / "x.kv", edit), *words)


def test_the_redundancy_factor_is_the_files(saved, tmp_path):
    """The gate's decode-time factor λ (generate.py --decode-redundancy) is saved with the cache;
    generate.load_request gives it back to the scorer, and a scorer with another λ is refused (it
    would evict other rows than the saved cache's own decoding); a file saved before the field
    existed loads with the gate's default."""
    t, path = saved
    assert read_header(path)[1]["decode_redundancy"] == 4.0  # a hybrid model: the gate's default
    model, cfg = t["model"], t["model"].config
    ids, n_protected = prompt(t)
    n = decode_budget("fastkvzip", n_protected, DECODE, cfg)
    cache = make_cache("fastkvzip", model, n_protected, decode_tokens_per_head=n, gates=t["gates"],
                       decode_redundancy=0)
    with torch.no_grad():
        last = prefill(model, cache, ids, n_protected, Budget(0.3, CHUNK, WINDOW))
    save_cache(tmp_path / "authors.kv", cache, model, ids, last)
    assert read_header(tmp_path / "authors.kv")[1]["decode_redundancy"] == 0.0
    refused(tmp_path / "authors.kv", model, scorer_for(t, "fastkvzip", DECODE), "λ = 0")
    req = dict(cache_state=read_header(tmp_path / "authors.kv")[1], questions=[],
               max_new_tokens=1)
    got = load_request(model, req, Compression(gates=t["gates"]), 0,
                       lambda scorer: load_cache(tmp_path / "authors.kv", model, scorer))
    assert got.cache.scorer.redundancy == 0.0 and kept(got.cache) == kept(cache)
    older = craft(path, tmp_path / "older.kv", lambda s: {k: v for k, v in s.items()
                                                        if k != "decode_redundancy"})
    load_cache(older, model, scorer_for(t, "fastkvzip", DECODE))


def test_positions_past_n_seen_are_refused(saved, tmp_path):
    """n_seen must exceed every row's position: a position at n_seen (or beyond), or rows out of
    order, is a corrupt file."""
    t, path = saved
    n_seen = read_header(path)[1]["n_seen"]

    def late(tensors):
        tensors["layer.0.pos"][-1] = n_seen + 5
    refused(craft(path, tmp_path / "x.kv", tensors_fn=late), t["model"],
            scorer_for(t, "fastkvzip", DECODE), "corrupt", "positions")


def test_budget_values_are_checked():
    for kw in (dict(window=-5), dict(chunk_size=0), dict(ratio=0.0), dict(ratio=7.5),
               dict(ratio=float("nan")), dict(window=2.5)):
        with pytest.raises(ValueError, match="Budget: "):
            Budget(**kw)


def test_the_teachers_kept_sets_check_the_ratio_as_budget_does():
    """teacher.kept_by_rule plans with Budget, so that a ratio outside (0, 1] is refused in the
    one place that checks it (plan_prefill itself does not)."""
    from teacher import kept_by_rule
    for ratio in (0.0, 1.5):
        with pytest.raises(ArgumentError, match="Budget: ratio must be a number in"):
            kept_by_rule(torch.rand(2, 2, 50), ratio, chunk_size=64, window=8)


def test_prefill_checks_n_protected_and_save_checks_the_ids(saved, tmp_path):
    t, _ = saved
    model, ids = t["model"], list(range(40, 80))
    cache = make_cache("fastkvzip", model, 50, gates=t["gates"])
    with pytest.raises(ArgumentError, match="n_protected 50 must be an integer in"):
        prefill(model, cache, ids, 50, Budget(0.3, 16, 4))
    cache = make_cache("fastkvzip", model, 5, gates=t["gates"])
    with torch.no_grad():
        last = prefill(model, cache, ids, 5, Budget(0.3, 16, 4))
    for other in (ids[:-1], ids[:-1] + [41], [7] * len(ids)):
        with pytest.raises(ValueError, match="not the 40 ids this cache prefilled"):
            save_cache(tmp_path / "x.kv", cache, model, other, last)
    assert not (tmp_path / "x.kv").exists()
    save_cache(tmp_path / "x.kv", cache, model, ids, last)
    assert load_cache(tmp_path / "x.kv", model)[1]["ids"] == ids


# -- crafted files that ended in a traceback ------------------------------------------------------

def _first_ring(tensors):
    return next(n for n in sorted(tensors) if n.endswith(".first"))


CRAFTED = {
    "dtype": (lambda s: s.update(dtype="bfloat16"), None, ["corrupt", "state's dtype"]),
    "level": (lambda s: s.update(level="bogus"), None, ["corrupt", "'level'"]),
    "method": (lambda s: s.update(method="bogus"), None, ["corrupt", "'method'"]),
    "no key": (lambda s: [s.pop("decode_buffer"), s][1], None,
               ["corrupt", "lacks 'decode_buffer'"]),
    "a list": (lambda s: [s], None, ["corrupt", "not a JSON object"]),
    "layers": (lambda s: s.update(layers="x"), None, ["corrupt", "'layers'"]),
    "a layer": (lambda s: s["layers"].__setitem__(0, 5), None, ["corrupt", "layer 0"]),
    "n_seen text": (lambda s: s.update(n_seen="80"), None, ["corrupt", "'n_seen'"]),
    "no logits": (None, lambda d: d.pop("last_logits"), ["corrupt", "'last_logits'"]),
    "no ids": (None, lambda d: d.pop("ids"), ["corrupt", "'ids'"]),
    "unknown": (None, lambda d: d.update(extra=torch.zeros(3)), ["corrupt", "unknown tensor"]),
    "k dtype": (None, lambda d: d.update({"layer.0.k": d["layer.0.k"].half()}), ["corrupt"]),
}


@pytest.mark.parametrize("what", CRAFTED)
def test_crafted_files_are_refused_in_one_line(saved, tmp_path, what):
    t, path = saved
    state_fn, tensors_fn, words = CRAFTED[what]
    refuse(t, craft(path, tmp_path / "x.kv", state_fn, tensors_fn), *words)


@pytest.mark.parametrize("what", ["logits", "ring", "ring past", "ids"])
def test_crafted_tensors_are_refused_on_load(saved, tmp_path, what):
    t, path = saved
    vocab = t["model"].config.vocab_size

    def edit(d):
        if what == "logits":
            d["last_logits"] = torch.cat([d["last_logits"], torch.zeros(5)])
        elif what == "ids":
            d["ids"][3] = vocab + 7
        else:
            d[_first_ring(d)][0] = 1 if what == "ring" else -3
    bad = craft(path, tmp_path / "x.kv", None, edit)
    if what == "ids":  # the hash was made of the ids: a crafter makes it again
        def rehash(s):
            from formats.cache_file import _ids_sha256
            s["ids_sha256"] = _ids_sha256(load_file(str(bad))["ids"])
        bad = craft(bad, tmp_path / "y.kv", rehash)
    words = {"logits": ["last logits", "vocabulary"], "ids": ["vocabulary"]}.get(what, ["layer 0"])
    refused(bad, t["model"], scorer_for(t, "fastkvzip", DECODE), "corrupt", *words)


def test_the_command_line_refuses_a_crafted_file_before_printing(capsys, saved, tmp_path):
    """The dtype of the state is not the tensors' (it printed "A:", then a traceback), and a ring
    edited: exit 2, one line, nothing on stdout."""
    t, path = saved
    bad = craft(path, tmp_path / "x.kv", CRAFTED["dtype"][0])
    one_line(*cli_load(capsys, t, bad), str(bad), "corrupt")
    ring = craft(path, tmp_path / "r.kv", None, lambda d: d[_first_ring(d)].__setitem__(0, 1))
    one_line(*cli_load(capsys, t, ring), str(ring), "corrupt", "layer 0")


# -- the library's misuse, one clear message -------------------------------------------------------

def test_library_misuse_says_what_to_give(saved):
    t, _ = saved
    model = t["model"]
    cache = make_cache("full", model, 0)
    with pytest.raises(ArgumentError, match="ids is empty"):
        prefill(model, cache, [], 0)
    with pytest.raises(ArgumentError, match="'bogus' is not one of"):
        make_cache("bogus", model, 0)
    with torch.no_grad():
        last = prefill(model, cache, [40, 41, 42], 0)
        with pytest.raises(ArgumentError, match="already holds a prompt"):
            prefill(model, cache, [43, 44], 0)
        with pytest.raises(ArgumentError, match="give question_ids, or the prefill's last_logits"):
            answer(model, cache, [], 3, set())
        assert len(answer(model, cache, [], 3, set(), last_logits=last)) == 3


# -- items 11, 12, 14: what is not a cache file ---------------------------------------------------

def test_a_fifo_is_refused_not_waited_on(saved, tmp_path):
    t, _ = saved
    fifo = tmp_path / "pipe.kv"
    os.mkfifo(fifo)
    errors = []

    def read():
        try:
            read_header(fifo)
        except CacheFileError as e:
            errors.append(str(e))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # the old open() blocks until a writer comes: be that writer, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("read_header waited on a FIFO")
    assert errors and "FIFO" in errors[0] and "not a regular file" in errors[0], errors
    refused(fifo, t["model"], None, "FIFO", "not a regular file")


def test_dev_zero_and_a_folder_are_not_regular_files(saved, tmp_path):
    t, _ = saved
    for path, kind in (("/dev/zero", "character device"), (tmp_path, "folder")):
        msg = refused(path, t["model"], None, kind, "not a regular file")
        assert "truncated" not in msg, msg


def test_an_error_never_echoes_the_files_bytes(saved, tmp_path):
    """A text file's first 8 bytes read as a number (root:x:0 is 3475222254926655346): never
    shown; the file is "not a saved KV cache (not safetensors)"."""
    t, _ = saved
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n" * 4)
    number = str(struct.unpack("<Q", b"root:x:0")[0])
    for path in (passwd, damaged(passwd, tmp_path, lambda d: d[:8] + b"{" + d[9:], "brace")):
        msg = refused(path, t["model"], None, "not a saved KV cache (not safetensors)")
        assert number not in msg and "root" not in msg.replace(str(tmp_path), ""), msg


def test_trailing_bytes_are_corrupt_not_truncated(saved, tmp_path):
    t, path = saved
    bad = damaged(path, tmp_path, lambda d: d + b"\0" * 10)
    msg = refuse(t, bad, "corrupt", "10 bytes after its end")
    assert "truncated" not in msg


def test_non_finite_keys_are_a_corrupt_file(capsys, saved, tmp_path):
    """NaN keys in a float32 cache (a valid checksum): the file is corrupt, not the dtype."""
    t, path = saved

    def nan(d):
        d["layer.0.k"][0, 0] = float("nan")
    bad = craft(path, tmp_path / "x.kv", None, nan)
    refused(bad, t["model"], scorer_for(t, "fastkvzip", DECODE), "corrupt", "inf/NaN keys")
    code, out, err = cli_load(capsys, t, bad)
    one_line(code, out, err, "corrupt", "inf/NaN keys")
    assert "--dtype" not in err


def test_n_protected_past_the_prompt_is_a_corrupt_file(capsys, saved, tmp_path):
    t, path = saved
    bad = craft(path, tmp_path / "x.kv",
                lambda s: s.update(n_protected=s["n_prompt"] + 10, n_context=-10))
    refuse(t, bad, "corrupt")
    bad = craft(path, tmp_path / "y.kv",
                lambda s: s.update(n_protected=s["n_prompt"] + 10, n_context=0))
    refuse(t, bad, "corrupt", "n_protected exceeds its prompt")
    code, out, err = cli_load(capsys, t, bad)
    one_line(code, out, err, "corrupt", "n_protected exceeds its prompt")
    assert "prompt format" not in err


# -- what the cache is, recorded without being told ------------------------------------------------

def test_a_cache_saved_without_method_or_budget_says_what_it_is(capsys, saved, tmp_path):
    """The saved fixture is a fastkvzip cache at 0.3 saved as the README does, with no method or
    budget: the file and the load say fastkvzip and the fraction its rows keep; the command line's
    summary is not "[full] ... nothing evicted"."""
    t, path = saved
    assert read_header(path)[1]["method"] == "fastkvzip"
    cache, info = load(t, path)
    assert isinstance(cache, EvictingCache) and info["method"] == "fastkvzip"
    assert 0.25 <= info["budget"] <= 0.3, info["budget"]
    code, out, err = cli_load(capsys, t, path)
    assert code == 0, err
    assert "[fastkvzip]" in err and "nothing evicted" not in err, err
    full, ids, last = compressed(t, "fastkvzip", 1.0, None)
    save_cache(tmp_path / "full.kv", full, t["model"], ids, last)
    info = load_cache(tmp_path / "full.kv", t["model"])[1]
    assert (info["method"], info["budget"]) == ("full", 1.0)
    with pytest.raises(ValueError, match="method 'full', but the cache is scored by GateScorer"):
        save_cache(tmp_path / "x.kv", cache, t["model"], info["ids"], info["last_logits"],
                   method="full")
    assert not (tmp_path / "x.kv").exists()
    save_cache(tmp_path / "x.kv", full, t["model"], ids, last, budget=0.3)  # --method full
    assert load_cache(tmp_path / "x.kv", t["model"])[1]["budget"] == 1.0  # it keeps all

