"""generate.py end to end: the command line, its JSON, its errors, and budget 1.0 on the real model."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model as M
from cache import EvictingCache, KVCache
from gate import Gates, GateScorer, RandomScorer, save_gate
from generate import answer, prefill
from tests.helpers import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def assert_usage_error(res, *words):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Gemma3 with a (large) real tokenizer beside it: enough to reach the checks."""
    folder = tiny_checkpoint("gemma3", tmp_path_factory.mktemp("tiny"), max_position_embeddings=64)
    shutil.copy(M.resolve_model(M.OFFLINE_DEFAULT) / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("budget", ["0", "-0.5", "1.5"])
def test_budget_outside_unit_interval(budget):
    assert_usage_error(run_cli("--prompt", "hi", "--budget", budget), "--budget", budget)


def test_context_longer_than_model(tiny_folder, tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("word " * 200)
    assert_usage_error(run_cli("--model", str(tiny_folder), "--context-file", str(ctx), "--question", "q",
                               "--method", "full"), "maximum")


def test_gate_for_another_model(tiny_folder, tmp_path):
    path = tmp_path / "other.safetensors"
    save_gate(path, Gates(5, 32, 2, 2), {"model": "another"})  # 5 layers, hidden 32: not this model
    assert_usage_error(run_cli("--model", str(tiny_folder), "--prompt", "hi", "--gate", str(path),
                               "--budget", "0.5"), "model")


def test_missing_model_and_missing_context_file(tmp_path):
    assert_usage_error(run_cli("--model", str(tmp_path / "nope"), "--prompt", "hi"), "not found")
    assert_usage_error(run_cli("--context-file", str(tmp_path / "nope.txt"), "--question", "q"), "nope.txt")


@pytest.fixture(scope="module", params=M.OFFLINE_MODELS)
def real(request):
    folder = M.resolve_model(request.param)
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
        gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads, cfg.group_size)
        for cache, chunk in [(KVCache(cfg), 4096),
                             (EvictingCache(cfg, GateScorer(gates), n_protected=1), 128),
                             (EvictingCache(cfg, RandomScorer(0, cfg.num_key_value_heads), n_protected=1,
                                            level="head"), 100)]:
            last = prefill(model, cache, ids, 1, 1.0, chunk_size=chunk, window=32)
            outs.append(answer(model, cache, [], 12, stop, last_logits=last)[0])
    assert outs[0] == outs[1] == outs[2]


def test_json_output_and_questions_share_the_context(tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("Emma lives in Highbury with her father. The secret code is 4721. " * 30)
    res = run_cli("--context-file", str(ctx), "--question", "What is the secret code?", "--question",
                  "Where does Emma live?", "--method", "streaming", "--budget", "0.5", "--max-new-tokens", "4",
                  "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["answers"]) == 2 and all(len(a["output_ids"]) <= 4 for a in out["answers"])
    s = out["stats"]
    for key in ("kept_fraction", "kept_fraction_per_layer", "kv_bytes", "kv_bytes_full", "peak_kv_bytes",
                "prefill_seconds", "gate_seconds", "decode_tokens_per_s", "method", "budget"):
        assert key in s, key
    assert abs(s["kept_fraction"] - 0.5) < 0.02 and len(s["kept_fraction_per_layer"]) == 3
    assert s["kv_bytes"] < s["kv_bytes_full"] and s["prompt_tokens"] == len(out["prompt_ids"])
