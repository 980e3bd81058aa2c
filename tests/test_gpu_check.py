"""harness/gpu_check.py's dry run (CPU, tiny shapes, the Triton interpreter): every part writes its
file, the files fit what the device tool brings back, and a part that fails or runs out of time is
recorded while the next part still runs. What it measures on a GPU is checked there, not here."""
import json
import os
import re
import time

import pytest

from harness import gpu_check

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the dry run times the kernel in the Triton interpreter")


def files_of(out):
    """The files under out, each entry checked against what the device tool brings back: at most
    2 folders down, named in letters, digits, '.', '_' and '-' (at most 8 files: the caller)."""
    found = [(p.relative_to(out), p.is_file()) for p in out.rglob("*")]
    for rel, _ in found:
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        assert len(rel.parts) <= 3, rel
    return sorted(str(rel) for rel, is_file in found if is_file)


def test_dry_run_writes_every_part(tmp_path):
    gpu_check.main(["--out", str(tmp_path), "--dry-run"])
    assert files_of(tmp_path) == sorted(gpu_check.FILES) and len(gpu_check.FILES) <= 8
    parts = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in gpu_check.PARTS}
    for name, res in parts.items():
        assert res["part"] == name and res["ok"] is True, (name, res.get("traceback"))
        assert "running" not in res and res["seconds"] >= 0
    assert parts["env"]["versions"]["torch"] and parts["env"]["ceilings"]["copy_GBps"] > 0
    # no CUDA here: every gpu test is collected and skipped, none fails
    assert parts["tests"]["returncode"] == 0 and parts["tests"]["counts"].get("skipped", 0) >= 5
    assert "skipped" in (tmp_path / "pytest.txt").read_text()
    # the kernel (interpreted) agrees with SDPA on the ragged decode layout
    S = gpu_check.DRY
    decode = parts["kernel"]["decode"]
    assert len(decode) == len(S["decode_keys"]) and len(parts["kernel"]["chunk"]) == 1
    for r in decode:
        ours, sdpa = r["results"]["ours (triton)"], r["results"]["sdpa dense padded"]
        assert ours["GBps"] > 0 and ours["TFLOPs"] > 0 and sdpa["max_diff"] < 1e-4
        assert abs(r["keys"] - S["decode_keys"][decode.index(r)]) <= S["H"]  # rounding per head
    # decode: one row per batch size; the batch holds B members' rows
    rows = parts["decode"]["rows"]
    assert [r["batch"] for r in rows] == list(S["batch"]) and all(r["tok_s"] > 0 for r in rows)
    assert all(r["kv_bytes"] >= r["batch"] * parts["decode"]["member_kv_bytes"] for r in rows)
    # prefill: every (length, method); the compressed caches hold 30% of the full one's KV
    rows = {(r["context"], r["method"]): r for r in parts["prefill"]["rows"]}
    assert set(rows) == {(n, m) for n, methods in S["prefill"] for m in methods}
    for n, _ in S["prefill"]:
        for m in ("fastkvzip", "kvzip"):
            ratio = rows[(n, m)]["kv_bytes"] / rows[(n, "full")]["kv_bytes"]
            assert abs(ratio - gpu_check.BUDGET) < 0.02, (n, m, ratio)
        assert 0 < rows[(n, "fastkvzip")]["score_share"] < 1 and rows[(n, "full")]["score_s"] == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "Dry run" in summary and summary.count("| goal |") == 1
    for name in gpu_check.PARTS:
        assert f"- **{name}**" in summary
    assert "Fast KVzip prefill >= 4x faster than KVzip" in summary and "FAILED" not in summary


def test_a_failing_or_slow_part_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    def slow(S, run, res):
        gpu_check.step(run, "tests", res, dict(case="sleeping"))
        time.sleep(30)

    def boom(S, run, res):
        res["before"] = "kept"
        raise RuntimeError("boom")
    monkeypatch.setitem(gpu_check.PARTS, "tests", slow)
    monkeypatch.setitem(gpu_check.PARTS, "kernel", boom)
    monkeypatch.setitem(gpu_check.DRY, "budgets", dict(gpu_check.DRY["budgets"], tests=3))
    t0 = time.monotonic()
    gpu_check.main(["--out", str(tmp_path), "--dry-run", "--parts", "tests,kernel,decode"])
    assert time.monotonic() - t0 < 25, "the slow part was not cut at its budget"
    assert files_of(tmp_path) == ["decode.json", "kernel.json", "summary.md", "tests.json"]
    tests, kernel, decode = (json.loads((tmp_path / f).read_text())
                             for f in ("tests.json", "kernel.json", "decode.json"))
    assert tests["ok"] is False and "time budget" in tests["error"]
    assert tests["running"]["case"] == "sleeping" and 2 < tests["running"]["cut_after_s"] < 10
    assert kernel["ok"] is False and kernel["error"] == "RuntimeError: boom"
    assert kernel["before"] == "kept"
    assert "boom" in kernel["traceback"]
    assert decode["ok"] is True and len(decode["rows"]) == len(gpu_check.DRY["batch"])
    summary = (tmp_path / "summary.md").read_text()
    assert "- **tests**" in summary and "FAILED: time budget" in summary
    assert "FAILED: RuntimeError: boom" in summary


def test_bad_parts_and_no_cuda_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path), "--dry-run", "--parts", "env,nope"])
    assert e.value.code == 2 and "unknown part(s) nope" in capsys.readouterr().err
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            gpu_check.main(["--out", str(tmp_path)])
        assert e.value.code == 2 and "--dry-run" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written before the arguments are checked"


def test_goals_read_the_largest_measured_size():
    """summary.md's goals: each from the largest size that has what it needs; a KVzip run cut by the
    time budget gives a lower bound on the speed-up."""
    row = lambda n, m, s, share=0.0, peak=0: dict(context=n, method=m, seconds=s, score_share=share,
                                                   gpu_peak_bytes=peak, kv_peak_bytes=1)
    ours = lambda gbps, tflops: {"ours (triton)": dict(GBps=gbps, TFLOPs=tflops)}
    fa2 = {"FlashAttention-2 (torch)": dict(TFLOPs=400.0)}
    results = dict(
        kernel=dict(decode=[dict(keys=1, results=ours(4500.0, 1)),
                            dict(keys=2, results=ours(3600.0, 1))],
                    chunk=[dict(results={**ours(1, 300.0), **fa2})]),
        prefill=dict(rows=[row(32, "full", 2.0, peak=100), row(32, "fastkvzip", 1.0, 0.05, 30),
                           row(32, "kvzip", 5.0), row(128, "fastkvzip", 4.0, 0.01, 50),
                           row(128, "full", 9.0, peak=200)],
                     running=dict(context=128, method="kvzip", cut_after_s=30.0)))
    got = {g.split(" >=")[0].split(" <=")[0]: (m, v) for g, m, v in gpu_check.goals(results)}
    assert got["kernel decode"] == ("75% (2 keys/layer)", "missed")          # the largest case
    assert got["prefill chunk"] == ("75% (300 vs 400 TFLOP/s)", "met")
    assert got["Fast KVzip prefill"] == ("> 7.5x at 128 tokens (KVzip cut after 30 s)", "met")
    assert got["gate"] == ("1.00% at 128 tokens", "met")
    assert got["peak prefill memory at 0.3"] == ("0.25x (gpu_peak_bytes, 128 tokens)", "met")
    del results["prefill"]["running"]  # not cut: the largest size where both ran
    got = {g.split(" >=")[0]: (m, v) for g, m, v in gpu_check.goals(results)}
    assert got["Fast KVzip prefill"] == ("5.00x at 32 tokens", "met")
    assert all(v == "not measured" for _, _, v in gpu_check.goals({}))
