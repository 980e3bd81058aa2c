"""generate.py end to end: the command line, its JSON, its errors, and budget 1.0 on the real
model."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cli
import model as M
from cache import Budget, EvictingCache, KVCache
from cli import OFFLINE_DEFAULT, OFFLINE_MODELS, resolve_model
from formats.gate_file import save_gate
from gate import Gates, GateScorer, RandomScorer
from generate import answer, prefill
from prompts import PromptFormat, encode_text, prompt_format, uses_chat
from tests.helpers import tiny_checkpoint, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def assert_usage_error(res, *words):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Gemma3 with a byte-level tokenizer that fits its 384-token vocabulary."""
    folder = tiny_checkpoint("gemma3", tmp_path_factory.mktemp("tiny"), max_position_embeddings=512)
    tiny_tokenizer(folder)
    return folder


@pytest.mark.parametrize("budget", ["0", "-0.5", "1.5"])
def test_budget_outside_unit_interval(budget):
    assert_usage_error(run_cli("--prompt", "hi", "--budget", budget), "--budget", budget)


def test_context_longer_than_model(tiny_folder, tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("word " * 200)
    assert_usage_error(run_cli("--model", str(tiny_folder), "--context-file", str(ctx),
                               "--question", "q", "--method", "full"), "maximum")


def test_gate_for_another_model(tiny_folder, tmp_path):
    path = tmp_path / "other.safetensors"
    save_gate(path, Gates(5, 32, 2, 2), {"model": "another"})  # 5 layers, hidden 32: not this model
    assert_usage_error(run_cli("--model", str(tiny_folder), "--prompt", "hi", "--gate", str(path),
                               "--budget", "0.5"), "model")


def test_missing_model_and_missing_context_file(tmp_path):
    assert_usage_error(run_cli("--model", str(tmp_path / "nope"), "--prompt", "hi"), "not found")
    assert_usage_error(run_cli("--context-file", str(tmp_path / "nope.txt"), "--question", "q"),
                       "nope.txt")


def main_error(capsys, *argv):
    """generate.py's main in this process (no interpreter start per case): exit 2 and one line, no
    traceback."""
    from generate import main
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def no_weights(tiny_folder, tmp_path_factory):
    """The tiny model without its weights: any check that runs before the weights load reports its
    own error; one that runs after would report the missing weights instead."""
    folder = tmp_path_factory.mktemp("noweights")
    for f in tiny_folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize("flags,words", [
    (["--window", "-5"], ["--window", "-5"]),
    (["--decode-tokens-per-head", "-5"], ["--decode-tokens-per-head", "-5"]),
    (["--decode-tokens-per-head", "0"], ["--decode-tokens-per-head", "positive"]),
    (["--decode-tokens-per-head", "200", "--decode-window", "0"], ["--decode-window", "positive"]),
    (["--chunk-size", "0"], ["--chunk-size", "positive"]),
    (["--decode-redundancy", "1"], ["--decode-redundancy", "give --method fastkvzip"]),
    (["--method", "snapkv", "--decode-tokens-per-head", "200", "--decode-redundancy", "1"],
     ["--decode-redundancy", "give --method fastkvzip"]),
    (["--decode-tokens-per-head", "200", "--decode-redundancy", "-1"], ["--decode-redundancy", ">= 0"]),
    (["--decode-tokens-per-head", "200", "--decode-redundancy", "nan"], ["--decode-redundancy", "nan"]),
    (["--max-new-tokens", "-1"], ["--max-new-tokens", "-1"]),
    (["--temperature", "-1"], ["--temperature", "-1"]),
    (["--temperature", "nan"], ["--temperature"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--top-p", "2"], ["--top-p", "2"]),
    (["--budget", "nan"], ["--budget"]),
    (["--method", "kvzip", "--decode-tokens-per-head", "100"],
     ["kvzip", "--decode-tokens-per-head"]),
    (["--method", "full", "--decode-tokens-per-head", "100"], ["full", "--decode-tokens-per-head"]),
    # the system prompt (or the first 4 tokens) and the local window are always kept
    (["--decode-tokens-per-head", "64"], ["--decode-tokens-per-head 64", "use at least"]),
    (["--method", "streaming", "--decode-tokens-per-head", "8"], ["use at least"]),
    (["--method", "streaming", "--decode-tokens-per-head", "20", "--decode-window", "16"],
     ["use at least"]),  # 20 fits the method's own window of 8
    (["--decode-tokens-per-head", str(10**9)], ["above the model's maximum"]),
    (["--method", "rkv"], ["rkv", "--decode-tokens-per-head"]),
    (["--method", "rkv", "--decode-tokens-per-head", "300", "--budget", "0.5"], ["--budget 1"]),
    (["--method", "snapkv", "--gate", "g.safetensors"], ["--gate", "snapkv"]),
    (["--device", "foo"], ["--device 'foo'"]),
    (["--context-file", "ctx.txt"], ["--prompt", "--context-file", "not both"]),
    (["--prompt", "  "], ["--prompt is empty"]),
    (["--thinking"], ["--thinking", "drop it"]),
    (["--question", ""], ["--question is empty"]),  # it continued the context instead
])
def test_bad_flags_fail_before_the_weights_load(capsys, no_weights, flags, words):
    argv = ["--model", str(no_weights), *flags]
    if "--prompt" not in flags:
        argv += ["--prompt", "hi"]
    line = main_error(capsys, *argv)
    assert "safetensors" not in line or "--gate" in line, line
    for w in words:
        assert w in line, line


def test_a_seed_past_64_bits_is_refused_by_its_flag(capsys, no_weights):
    """--seed is cli.add_seed's, as in every program: argparse refuses it (exit 2, its usage and
    one error line), before the weights load."""
    from generate import main
    with pytest.raises(SystemExit) as e:
        main(["--model", str(no_weights), "--prompt", "hi", "--seed", str(2**70)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith(
        f"--seed: {2**70} is not a seed: use an integer from 0 to 2**63 - 1"), err


def test_device_without_cuda(capsys, no_weights):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert "CUDA is not available" in main_error(capsys, "--model", str(no_weights), "--prompt",
                                                 "hi", "--device", "cuda")


def test_bad_context_files_and_gates_fail_before_the_weights_load(capsys, no_weights, tmp_path):
    files = {"binary.txt": b"\x7fELF\x02\x01\x01\x00\x00\x00",
             "latin1.txt": "Émile à Paris".encode("latin-1"), "empty.txt": b"",
             "blank.txt": b" \n\n\t", "missing.txt": None}
    expect = {"binary.txt": "NUL bytes", "latin1.txt": "not UTF-8 text (byte 0xc9 at offset 0)",
              "empty.txt": "is empty", "blank.txt": "is empty", "missing.txt": "No such file"}
    for name, data in files.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
        line = main_error(capsys, "--model", str(no_weights), "--context-file",
                          str(tmp_path / name), "--question", "q")
        assert expect[name] in line and name in line, line
    line = main_error(capsys, "--model", str(no_weights), "--context-file", str(tmp_path),
                      "--question", "q")
    assert "not a regular file" in line, line
    # valid UTF-8 with a BOM: read, then too long
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + b"word " * 400)
    assert "exceeds the model's maximum" in main_error(capsys, "--model", str(no_weights),
                                                       "--context-file", str(tmp_path / "bom.txt"),
                                                       "--method", "full")
    (tmp_path / "junk.safetensors").write_bytes(b"not a gate")
    for gate_file, words in ((tmp_path / "junk.safetensors", "neither"),
                             (tmp_path / "nope.safetensors", "not found")):
        line = main_error(capsys, "--model", str(no_weights), "--prompt", "hi", "--gate",
                          str(gate_file), "--max-new-tokens", "4")
        assert words in line, line
    # with a valid gate, the next error is indeed the missing weights: the checks above ran first
    cfg = M.ModelConfig.from_json(no_weights)
    save_gate(tmp_path / "g.safetensors", Gates(len(cfg.compressed_layers), cfg.hidden_size,
                                                cfg.num_key_value_heads, cfg.group_size))
    assert "no *.safetensors" in main_error(capsys, "--model", str(no_weights), "--prompt", "hi",
                                            "--gate", str(tmp_path / "g.safetensors"),
                                            "--max-new-tokens", "4")


@pytest.fixture(scope="module", params=OFFLINE_MODELS)
def real(request):
    folder = resolve_model(request.param)
    return M.load_model(folder, "cpu", torch.float32), M.load_tokenizer(folder)


def test_budget_one_equals_full_cache_on_real_model(real):
    """Budget 1.0 through the evicting path (real gate-shaped scorer, chunked prefill) generates
    token for token what the full cache does: on Gemma 3 270M (3 of 18 layers compressed) and on
    SmolLM2-135M (all 30 layers x 3 KV heads under one threshold)."""
    model, tok = real
    cfg = model.config
    text = "The quick brown fox jumps over the lazy dog. " * 40
    ids = [cfg.bos_token_id] + tok.encode(text, add_special_tokens=False).ids
    stop = set(cfg.eos_token_ids)
    outs = []
    with torch.no_grad():
        torch.manual_seed(0)
        gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                      cfg.group_size)
        for cache, chunk in [(KVCache(cfg), 4096),
                             (EvictingCache(cfg, GateScorer(gates), n_protected=1), 128),
                             (EvictingCache(cfg, RandomScorer(0, cfg.num_key_value_heads),
                                            n_protected=1, level="head"), 100)]:
            last = prefill(model, cache, ids, 1, Budget(1.0, chunk_size=chunk, window=32))
            outs.append(answer(model, cache, [], 12, stop, last_logits=last))
    assert outs[0] == outs[1] == outs[2]


def test_json_output_and_questions_share_the_context(tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("Emma lives in Highbury with her father. The secret code is 4721. " * 30)
    res = run_cli("--context-file", str(ctx), "--question", "What is the secret code?",
                  "--question", "Where does Emma live?", "--method", "streaming", "--budget", "0.5",
                  "--max-new-tokens", "4", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["answers"]) == 2 and all(len(a["output_ids"]) <= 4 for a in out["answers"])
    s = out["stats"]
    for key in ("kept_fraction", "kept_fraction_per_layer", "kv_bytes", "kv_bytes_full",
                "peak_kv_bytes", "prefill_seconds", "gate_seconds", "decode_tokens_per_s", "method",
                "budget"):
        assert key in s, key
    assert abs(s["kept_fraction"] - 0.5) < 0.02 and len(s["kept_fraction_per_layer"]) == 3
    assert s["kv_bytes"] < s["kv_bytes_full"] and s["prompt_tokens"] == len(out["prompt_ids"])


# -------------------------------------------------------------------------------------------------
# bad input, second round

def test_float16_gemma3_is_refused_and_nan_logits_never_answer(capsys, no_weights, tmp_path):
    """--dtype float16 on a Gemma 3 stops before the weights load (its activations overflow float16:
    see tests/test_model.py); and should any model's logits turn non-finite, answer() raises instead
    of returning argmax(NaN) = token 0 over and over, naming the dtype; which --dtype to try is the
    command line's advice (test_nan_logits_at_the_command_line_advise_a_wider_dtype)."""
    line = main_error(capsys, "--model", str(no_weights), "--prompt", "Water boils at", "--dtype",
                      "float16")
    assert "float16" in line and "bfloat16 or float32" in line, line
    from tests.test_model import overflowing_gemma3
    half = overflowing_gemma3(tmp_path / "g").half()
    cache = KVCache(half.config, torch.float16)
    with torch.no_grad(), pytest.raises(M.ModelError, match=r"inf/NaN .*torch.float16$"):
        last = prefill(half, cache, [2, 10, 11, 12], 1)
        answer(half, cache, [], 3, set(), last_logits=last)


@pytest.mark.parametrize("dtype, advice", [("bfloat16", "; try --dtype float32"),
                                           ("float32", "")])
def test_nan_logits_at_the_command_line_advise_a_wider_dtype(capsys, tiny_folder, monkeypatch,
                                                             dtype, advice):
    """Logits that turn inf/NaN while answering: one line, exit 2, naming the dtype, with the
    --dtype to try where a wider one exists (the method's error holds no flag)."""
    import generate
    real = generate.begin_answer
    monkeypatch.setattr(generate, "begin_answer", lambda *a, **kw: real(*a, **kw) * float("nan"))
    line = main_error(capsys, "--model", str(tiny_folder), "--prompt", "hi", "--question", "q?",
                      "--method", "full", "--max-new-tokens", "3", "--dtype", dtype)
    assert line == (f"error: the model's logits are inf/NaN after 0 generated tokens, computed in "
                    f"torch.{dtype}{advice}"), line


def test_foreign_tokenizer_and_invalid_utf8_prompt_are_one_line(capsys, no_weights, tmp_path):
    """A tokenizer larger than the model's vocabulary (Gemma's in a 384-token model): refused at
    load, not an IndexError in the embedding. Bytes that are not UTF-8 in --prompt / --question (the
    shell passes them, Python keeps them as lone surrogates): the same rule as --context-file, not a
    TypeError from tokenizers."""
    foreign = tmp_path / "foreign"
    shutil.copytree(no_weights, foreign)
    shutil.copy(resolve_model(OFFLINE_DEFAULT) / "tokenizer.json", foreign / "tokenizer.json")
    line = main_error(capsys, "--model", str(foreign), "--prompt", "hi")
    assert "262144 token ids, more than the model's vocab_size 384" in line, line
    bad = os.fsdecode(b"a \xff b")  # what argv holds for $'a \xff b'
    line = main_error(capsys, "--model", str(no_weights), "--prompt", bad)
    assert (line == "error: --prompt is not UTF-8 text (byte 0xff at offset 2); convert it, e.g. "
            "iconv -f latin1 -t utf-8")
    (tmp_path / "ctx.txt").write_text("some context")
    line = main_error(capsys, "--model", str(no_weights), "--context-file",
                      str(tmp_path / "ctx.txt"), "--question", "fine?", "--question", bad)
    assert "--question is not UTF-8 text (byte 0xff" in line, line


def test_not_utf8_context_names_the_encoding_its_bytes_suggest(capsys, no_weights, tmp_path):
    """A Windows-1252 file (curly quotes, a dash, the euro sign in bytes 0x80-0x9F): the suggested
    iconv gives back its text; Latin-1 would turn those bytes into invisible C1 control characters.
    A file without such bytes is still told Latin-1."""
    import re
    for text in ("\u201cEmma,\u201d she said \u2014 it cost 20 \u20ac.",
                 "\xc9mile \xe0 Paris, \xa9 1815"):
        data = text.encode("cp1252")
        (tmp_path / "ctx.txt").write_bytes(data)
        line = main_error(capsys, "--model", str(no_weights), "--context-file",
                          str(tmp_path / "ctx.txt"), "--question", "q")
        encoding = re.search(r"iconv -f (\S+) -t utf-8", line)[1]
        assert data.decode(encoding) == text, line


def test_a_reader_that_leaves_early_stops_the_program_quietly(tiny_folder, tmp_path):
    """`generate.py ... | head -c 1` and `generate.py --batch F | head -n 1`: stdout's reader leaves
    before the answers are written; the program stops as a Unix tool does (exit 141, 128 + SIGPIPE),
    without a BrokenPipeError traceback."""
    (tmp_path / "req.jsonl").write_text('{"context": "one"}\n{"context": "two"}\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "generate.py"), "--model", str(tiny_folder), "--method",
               "full", "--max-new-tokens", "3"]
    for args in (["--prompt", "Water boils at"], ["--batch", str(tmp_path / "req.jsonl")]):
        read, write = os.pipe()
        os.close(read)  # the reader has left: every write to stdout fails with EPIPE
        try:
            res = subprocess.run(command + args, stdout=write, stderr=subprocess.PIPE, text=True,
                                 env=env, timeout=300, cwd=ROOT)
        finally:
            os.close(write)
        assert res.returncode == 141 and "Error" not in res.stderr, (args, res.returncode,
                                                                     res.stderr)


def test_a_window_that_takes_the_whole_budget_is_refused(capsys, no_weights, tmp_path):
    """--chunk-size 64 --budget 0.3 on a 300-token context with the default --window 4096: the
    window (capped at the context) holds the whole budget, so the gate would never be asked and
    fastkvzip would keep what streaming keeps. Refused before the weights load, saying what to
    change; streaming, or a window below the budget, go on (to the missing gate or weights)."""
    (tmp_path / "ctx.txt").write_text("w" * 300)  # one token per byte
    base = ["--model", str(no_weights), "--context-file", str(tmp_path / "ctx.txt"),
            "--question", "q", "--no-chat", "--max-new-tokens", "4"]
    refused = ((["--chunk-size", "64"], ["--window 4096", "a --window below 90",
                                         "--method fastkvzip would choose nothing"]),
               (["--budget", "0.01"], ["keeps 3 of the 300", "last 2%", "above 0.02"]),
               (["--chunk-size", "64", "--method", "kvzip"], ["kvzip would choose nothing"]))
    for flags, words in refused:
        line = main_error(capsys, *base, *flags)
        assert all(w in line for w in words), line
    for flags in (["--chunk-size", "64", "--method", "streaming"],
                  ["--chunk-size", "64", "--window", "32"], ["--budget", "0.05"]):
        line = main_error(capsys, *base, *flags)  # the next check's error: no gate, no weights
        assert "no gate for model" in line or "no *.safetensors" in line, line


def test_sampling_at_a_tiny_temperature_is_greedy():
    """--temperature 1e-40 passed the checks, then float32 overflowed (logits / T = inf,
    inf - inf = NaN) and torch.multinomial raised. A temperature that small is greedy; a tie
    splits the mass."""
    from generate import logits_to_probs, sample
    logits = torch.tensor([0.5, 3.0, 1.0, -float("inf")])
    g = torch.Generator().manual_seed(0)
    for t in (1e-40, 1e-320):
        probs = logits_to_probs(logits, t)
        assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=probs.dtype)), probs
        assert sample(logits, t, generator=g) == 1
    assert logits_to_probs(torch.tensor([3.0, 3.0, 1.0]), 1e-40).tolist() == [0.5, 0.5, 0.0]
    as_before = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(logits_to_probs(logits, 0.7).float(), as_before)


def test_streamed_answer_prints_characters_whole(capsys, tiny_folder, monkeypatch):
    """The streamed answer printed each token decoded alone: a character split over tokens (an
    emoji is four byte tokens here, as in SmolLM2's byte-level BPE) came out as replacement
    characters. It prints what decodes whole, and the whole answer in the end."""
    import generate
    tok = M.load_tokenizer(tiny_folder)
    text = "caf\u00e9 \U0001F600 ok \u2014 done"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text  # one token per byte

    def answers(model, reqs, *a, **kw):  # the decode loop's events for this answer
        r = next(iter(reqs))  # prefilled, as decode admits it
        r.question_index, r.out = 0, []
        yield "question", r
        for t in ids:
            r.out.append(t)
            yield "token", r
        r.answers.append({"question": "q?", "output_ids": r.out})
        yield "answer", r

    monkeypatch.setattr(generate, "decode", answers)
    generate.main(["--model", str(tiny_folder), "--prompt", "hi", "--question", "q?",
                  "--method", "full"])
    assert capsys.readouterr().out == f"\nQ: q?\nA:{text}\n"


def test_an_answer_without_decode_steps_has_no_decode_speed(capsys, tiny_folder):
    """--max-new-tokens 1: the token comes from the question's forward, no decode step runs; the
    stats said "decode 1247.8 tok/s" (one token over the time of one sampling). Now no decode
    speed; with 3 tokens, the 2 decode forwards' rate."""
    import generate
    for n, has_speed in ((1, False), (3, True)):
        generate.main(["--model", str(tiny_folder), "--prompt", "hi", "--question", "q?",
                       "--method", "full", "--max-new-tokens", str(n), "--json"])
        stats = json.loads(capsys.readouterr().out)["stats"]
        assert (stats["decode_tokens_per_s"] is not None) == has_speed, stats
        assert ("decode" in cli.summary_line(stats)) == has_speed


def test_token_clock_times_each_answer_from_its_first_token(monkeypatch):
    """Decode speed measured from outside the method (harness.timing.TokenClock): per answer, the
    seconds from its first token to its last, over its tokens after the first; the time before an
    answer's first token (its question's forward) is not counted."""
    import types

    from harness import timing
    now = iter([10.0, 10.5, 11.5, 20.0, 20.25])  # the clock at each token: 3, then 2 tokens
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(now)))
    clock = timing.TokenClock()
    assert clock.tokens_per_s is None
    for token in (7, 8, 9):
        clock.token(token)
    clock.new_answer()
    clock.token(), clock.token()
    assert clock.steps == 3 and clock.seconds == 1.75 and clock.tokens_per_s == 3 / 1.75


def test_a_base_model_is_prompted_as_one_whatever_its_name(capsys):
    """The offline Gemma 3 270M is a base model (its tokenizer has no chat template): named by its
    folder, it got the chat template and answered "Water boils at" with "The temperature of". By
    folder or by name, the same prompt and answer now."""
    import generate
    folder = resolve_model(OFFLINE_DEFAULT)
    cfg = M.ModelConfig.from_json(folder)
    assert cfg.chat_template is False and not uses_chat(cfg)
    plain = PromptFormat("<bos>", "")
    assert prompt_format(cfg, str(folder)) == prompt_format(cfg, OFFLINE_DEFAULT) == plain
    runs = []
    for name in (str(folder), OFFLINE_DEFAULT):
        generate.main(["--model", name, "--prompt", "Water boils at", "--budget", "1.0",
                      "--max-new-tokens", "3", "--json"])
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["prompt_ids"] == runs[1]["prompt_ids"]
    assert runs[0]["answers"][0]["output_ids"] == runs[1]["answers"][0]["output_ids"]


def test_gate_dev_null_is_empty_not_missing(capsys, no_weights):
    line = main_error(capsys, "--model", str(no_weights), "--prompt", "hi", "--gate", "/dev/null",
                      "--max-new-tokens", "4")
    assert "gate /dev/null is empty" in line and "not found" not in line, line


def test_fifo_context_file_says_it_waits(no_weights, tmp_path):
    """A --context-file that is a pipe blocks until its writer closes it: one line on stderr says so
    first."""
    fifo = tmp_path / "ctx.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), "--model", str(no_weights),
                          "--context-file", str(fifo), "--question", "q", "--method", "full",
                          "--max-new-tokens", "4"],
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        import select
        assert select.select([p.stderr], [], [],
                             120)[0], "nothing on stderr while it waits for the pipe"
        first = p.stderr.readline()  # written before the pipe is opened, while it still waits
        assert (first
                == f"reading --context-file {fifo}: a pipe, until its writer closes it\n"), first
        with open(fifo, "w") as w:
            w.write("Emma lives in Highbury.")
        rest = p.stderr.read()
        # read, then the missing weights
        assert p.wait(timeout=120) == 2 and "no *.safetensors" in rest, rest
    finally:
        p.kill()


def test_no_context_runs_the_shipped_example(capsys, tmp_path_factory):
    """`python generate.py --budget 0.3` (no --prompt, no --context-file) answers the README's first
    question about the shipped chapter at that budget, and says so in one line first."""
    import generate
    folder = tiny_checkpoint("gemma3", tmp_path_factory.mktemp("long"),
                             max_position_embeddings=32768)
    tiny_tokenizer(folder)
    capsys.readouterr()  # the checkpoint's own progress bars
    generate.main(["--model", str(folder), "--method", "streaming", "--budget", "0.3",
                  "--max-new-tokens", "2", "--chunk-size", "4096", "--json"])
    out = capsys.readouterr()
    said = out.err.strip().splitlines()
    assert len(said) == 1 and "shipped example" in said[0] and "--budget 0.3" in said[0], out.err
    res = json.loads(out.out)
    text = (ROOT / "examples" / "persuasion-chapter-1.txt").read_text()
    assert [a["question"] for a in res["answers"]] == ["How old is Elizabeth?"]
    assert (res["stats"]["budget"] == 0.3 and res["stats"]["context_tokens"]
            >= len(text.encode()) - 2)


def test_build_inputs_takes_plain_values(tmp_path):
    """The prefill ids, the protected system prompt and one question turn per question string; a
    base model's turn (no chat postfix) ends with the start of its answer, a chat model's with its
    postfix."""
    from commands.generate import build_inputs
    from tests.helpers import tiny_tokenizer
    tiny_tokenizer(tmp_path)  # one id per byte, one per template token
    tok = M.load_tokenizer(tmp_path)
    text = lambda s: encode_text(tok, s)
    bos, end = tok.token_to_id("<bos>"), tok.token_to_id("<end_of_turn>")
    ids, n_protected, qs = build_inputs(tok, PromptFormat("<bos>", ""), "ctx", ["Who?", "Where?"])
    assert ids == [bos] + text("ctx") and len(text("ctx")) == 3
    assert n_protected == 1 and [q for q, _ in qs] == ["Who?", "Where?"]
    assert qs[0][1] == text("\n\nQ: Who?\nA:")
    _, _, qs = build_inputs(tok, PromptFormat("<bos>", "<end_of_turn>"), "ctx")
    assert qs == [("", [end])]  # no question: the prompt's turn just ends
    chat = PromptFormat("<bos>", "<end_of_turn>")
    assert build_inputs(tok, chat, "ctx", ["Who?"])[2][0][1] == text("\n\nQ: Who?") + [end]


def test_summary_line_says_what_was_kept_where():
    """Context tokens, the compressed layers' kept share (per layer when there are few), what the
    other layers keep, and the KV held against a full cache."""
    from cli import summary_line
    s = dict(method="fastkvzip", context_tokens=3296, compressed_layers=[5, 11, 17], n_layers=18,
             sliding_layers=[i for i in range(18) if i not in (5, 11, 17)], sliding_window=512,
             kept_fraction=0.3, kept_fraction_per_layer=[0.6, 0.28, 0.02], kv_bytes=20.8 * 2**20,
             kv_bytes_full=34.3 * 2**20, peak_kv_bytes=38.2 * 2**20, prefill_seconds=30.0,
             prefill_tokens_per_s=110.0, decode_tokens_per_s=1.1)
    line = summary_line(s)
    for words in ("3296 context tokens",
                  "compressed layers 5, 11, 17 kept 30.0% of it (60% / 28% / 2%)",
                  "the 15 sliding-window layers their last 512 tokens",
                  "KV held 20.8 of 34.3 MiB full (61%)"):
        assert words in line, (words, line)
    every = dict(s, compressed_layers=list(range(30)), n_layers=30, sliding_layers=[],
                 kept_fraction_per_layer=[0.3] * 30)
    line = summary_line(every)
    assert "compressed all layers 0-29 kept 30.0% of it;" in line and "sliding" not in line, line
    line = summary_line(dict(s, method="full", kv_bytes=34.3 * 2**20))
    assert "full cache, nothing evicted; KV held 34.3 MiB;" in line, line
