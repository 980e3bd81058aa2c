"""
The prepared GPU check: what the first session lent a GPU should measure, in one command that writes
its results under --out as it goes (7 files, no folders):

  env.json      versions, the GPU, nvidia-smi, and its ceilings measured (copy GB/s, matmul TFLOP/s)
  tests.json    `pytest -m gpu` on the kernel and batch tests: the compiled kernel against the
                reference
  pytest.txt    pytest's output
  kernel.json   the Triton kernel: decode over ragged caches, a 16K prefill chunk against a 64K-key
                cache; PyTorch SDPA and FlashAttention-2 beside it; GB/s and TFLOP/s
  decode.json   batched decode (serving.batch.Batch, generate.decode_batch), tokens/s at B = 1, 8, 32
  prefill.json  prefill of 32K and 128K tokens: full cache, Fast KVzip and KVzip at budget 0.3:
                seconds, peak GPU memory, KV bytes held, the gate's (teacher's) share of the time
  summary.md    a line per part, and the goals beside the numbers

Each part runs under a time budget (SIGALRM) in its own try/except: a part that fails or runs out
of time is recorded with its error and the next part runs. A part's JSON is rewritten after each
step, so a run cut short keeps what it measured; a step cut by its budget records how long it had
run (for KVzip at 128K, the longest step, a lower bound on its cost). Cheapest and surest first.

The model has random weights in Qwen3-8B's shapes (bf16): speed and memory only. The KVzip
teacher's repeat prompts are written by a byte tokenizer (no tokenizer file travels): ~125 prompt
tokens per 2,000-token chunk instead of ~30, ~5% more scoring work than with Qwen3's tokenizer.

    python -m harness.gpu_check --out results/gpu       # CUDA: under 8 minutes on one H200
    python -m harness.gpu_check --out /tmp/gpu --dry-run  # CPU: tiny shapes, the Triton interpreter

On the project's device machine (one H200; its image has Python 3.12, torch 2.11, triton 3.6,
numpy, pytest and pytest-xdist) every import is already there: nothing is carried, installed or
downloaded. flash-attn is not in the image and PyPI has only its source (a CUDA build of hours), so
FlashAttention-2 here is PyTorch's own flash kernel. The device tool's `run` call, pasted as is:
    command:   PYTHONUNBUFFERED=1 timeout 540 python3 -m harness.gpu_check --out "$OUT"
    timeout_s: 600
    carry:     none
Its 7 files come back from $OUT. To rerun some parts in the time left: --parts kernel,decode.
"""
import argparse
import copy
import gc
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch  # kernels, and all that imports it, only after --dry-run set TRITON_INTERPRET

import cli

ROOT = Path(__file__).resolve().parent.parent
PEAK_BW = 4.8e12      # bytes/s: the H200's HBM3e, by the vendor's datasheet
BUDGET = 0.3          # the kept fraction of every compressed run
DEADLINE_S = 470      # seconds: the last part ends by then (the device command's timeout: 540)
FILES = ("env.json", "tests.json", "pytest.txt", "kernel.json", "decode.json", "prefill.json",
         "summary.md")

# The dry run's model: a Qwen3 of 2 small layers (the GPU run's is harness.speed.QWEN3_8B)
TINY = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=4096, tie_word_embeddings=False)

# What each run measures. Kernel shapes: H KV heads, G query heads each, head_dim d (Qwen3-8B: 8, 4,
# 128). decode_keys: kept keys per layer, all heads together (314,573: 30% of 128K tokens x 8).
GPU = dict(model="qwen3-8b", dtype="bfloat16", H=8, G=4, d=128,
           decode_keys=(32768, 65536, 131072, 314573), chunk=(16384, 65536),
           prefill=((32768, ("full", "fastkvzip", "kvzip")),
                    (131072, ("fastkvzip", "full", "kvzip"))),
           chunk_size=16000, window=4096, score_chunk=2000, warmup=(4096, 2048, 512),
           decode_context=16384, batch=(1, 8, 32), steps=32,
           budgets=dict(env=30, tests=150, kernel=60, decode=90, prefill=math.inf))
DRY = dict(model="tiny", dtype="float32", H=2, G=2, d=64,
           decode_keys=(256, 512), chunk=(32, 128),
           prefill=((192, ("full", "fastkvzip", "kvzip")), (384, ("fastkvzip", "full", "kvzip"))),
           chunk_size=128, window=32, score_chunk=64, warmup=(96, 64, 16),
           decode_context=160, batch=(1, 2, 4), steps=3,
           budgets=dict(env=30, tests=120, kernel=60, decode=30, prefill=math.inf))


class PartTimeout(BaseException):
    """A part's budget ran out (SIGALRM). Not an Exception: a step's own `except Exception` (a
    baseline that fails) must not swallow it."""


def _alarm(signum, frame):
    raise PartTimeout()


# ---- running parts: each under a budget, recorded whatever happens -----------------------------

class Run:
    """The output folder (made by output_folder): one JSON per part, rewritten as it grows, and
    summary.md. `wrote`: the files this run wrote (the folder may hold others, from earlier
    runs)."""

    def __init__(self, out, dry):
        self.out, self.dry, self.t0 = Path(out), dry, time.monotonic()
        self.results = {}  # part -> its result dict, in run order
        self.wrote = set()

    def save(self, part):
        cli.write_json(self.out / f"{part}.json", self.results[part])
        self.wrote.add(f"{part}.json")
        try:  # the JSON files are the record: a bug in the summary must not stop the run
            text = summary(self.results, self.dry)
        except Exception as e:
            text = f"# GPU check\n\nno summary: {type(e).__name__}: {e}; read the JSON files\n"
        cli.write_text(self.out / "summary.md", text)
        self.wrote.add("summary.md")

    def left(self):
        return DEADLINE_S - (time.monotonic() - self.t0)


def run_part(run, name, fn, S, budget):
    """fn(S, run, res) fills res (saving as it goes); any error or a spent budget is recorded in res
    (ok false, error, and the step that was running: how long it had run), and the run goes on."""
    res = run.results[name] = dict(part=name, ok=None, budget_s=round(budget, 1))
    t0 = time.monotonic()
    run.part_deadline = t0 + budget
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        with torch.no_grad():
            fn(S, run, res)
        res["ok"] = True
    except (Exception, PartTimeout) as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        timed_out = isinstance(e, PartTimeout)
        res.update(ok=False, error=f"time budget of {budget:.0f} s spent" if timed_out
                   else f"{type(e).__name__}: {e}"[:2000],
                   traceback=None if timed_out else traceback.format_exc()[-4000:])
        if "running" in res:  # the step that was cut: how long it had run
            res["running"]["cut_after_s"] = round(time.monotonic() - res["running"].pop("t0"), 2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    res["seconds"] = round(time.monotonic() - t0, 2)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    run.save(name)
    print(f"[gpu_check] {name}: {'ok' if res['ok'] else res['error']} ({res['seconds']:.1f} s)",
          flush=True)


def step(run, name, res, what):
    """Mark `what` (a dict) as the step now running, and save the part so far."""
    res["running"] = dict(what, t0=time.monotonic())
    run.results[name] = res
    run.save(name)


def done(run, name, res, row, key="rows"):
    res.pop("running", None)
    res.setdefault(key, []).append(row)
    run.save(name)


# ---- timing helpers ------------------------------------------------------------------------------

def device_and_dtype(S):
    return ("cuda" if torch.cuda.is_available() else "cpu"), getattr(torch, S["dtype"])


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, rep_ms=100, graph=True):
    """-> (seconds per call, how timed). CUDA: fn captured in a CUDA graph (no host time between its
    launches: a decode call is ~10 us of GPU work), replayed under triton's do_bench, which flushes
    the L2 cache between calls; eager if fn cannot be captured. CPU: a short loop."""
    if dev != "cuda":
        fn()
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < 0.05:
            fn()
            n += 1
        return (time.perf_counter() - t0) / n, "cpu loop"
    import triton
    call, how = fn, "eager"
    if graph:
        try:
            side = torch.cuda.Stream()  # warm-up off the default stream, as capture wants
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            call, how = g.replay, "CUDA graph"
        except Exception:
            torch.cuda.synchronize()
    return triton.testing.do_bench(call, warmup=5, rep=rep_ms) / 1e3, how


def sig(x, digits=4):
    """x to `digits` significant digits (a CPU dry run's rates are tiny, a GPU's large)."""
    return float(f"{x:.{digits}g}")


def peak_above(dev, base):
    """Peak GPU bytes since the last reset, above `base` (the weights and what else was held)."""
    return None if base is None else gpu_memory(dev)[1] - base


def gpu_memory(dev):
    """(allocated now, peak since the last reset) in bytes, or (None, None) on a CPU."""
    if dev != "cuda":
        return None, None
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


# ---- 1. env: versions, the GPU, and its ceilings -------------------------------------------------

def part_env(S, run, res):
    import numpy
    dev, _ = device_and_dtype(S)
    versions = dict(python=platform.python_version(), torch=torch.__version__,
                    numpy=numpy.__version__, cuda=torch.version.cuda)
    for name in ("triton", "flash_attn", "transformers", "xdist"):
        try:
            versions[name] = getattr(__import__(name), "__version__", "present")
        except Exception:  # missing, or present and broken (a flash-attn built for another torch)
            versions[name] = None
    try:  # the device gets a copy of the working tree, perhaps without git or .git
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    res.update(versions=versions, commit=commit, dry_run=run.dry,
               platform=platform.platform(), cpus=os.cpu_count(),
               env={k: os.environ.get(k) for k in ("TRITON_INTERPRET", "FASTKVZIP_ATTN_BACKEND",
                                                   "CUDA_VISIBLE_DEVICES")})
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        res["gpu"] = dict(name=p.name, capability=f"{p.major}.{p.minor}",
                          sms=p.multi_processor_count, memory_bytes=p.total_memory)
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        res["nvidia_smi"] = smi.stdout or smi.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        res["nvidia_smi"] = f"not run: {e}"
    run.save("env")
    # the ceilings the kernel's numbers are read against (a device copy; a bf16 matrix product)
    n = (1 << 30) if dev == "cuda" else (1 << 24)
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy_s = timeit(lambda: y.copy_(x), dev)[0]
    m = 8192 if dev == "cuda" else 256
    a = torch.randn(m, m, device=dev).to(torch.bfloat16 if dev == "cuda" else torch.float32)
    mm_s = timeit(lambda: a @ a, dev)[0]
    res["ceilings"] = dict(copy_GBps=sig(2 * n / copy_s / 1e9),  # bytes read + written
                           matmul_TFLOPs=sig(2 * m ** 3 / mm_s / 1e12), matmul_n=m)


# ---- 2. tests: the gpu-marked tests, compiled kernel against the reference -----------------------

def part_tests(S, run, res):
    import importlib.util
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rfEs", "-p", "no:cacheprovider",
           "tests/test_kernels.py", "tests/test_batch.py"]
    if torch.cuda.is_available() and importlib.util.find_spec("xdist"):
        cmd += ["-n", "8"]  # the test cases' Triton compilations side by side (16 CPU cores)
    res["command"] = " ".join(cmd[1:])
    run.save("tests")
    log = run.out / "pytest.txt"  # written as pytest prints: a run cut short keeps its output
    with open(log, "w") as f:
        run.wrote.add(log.name)
        try:
            p = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                               timeout=max(1.0, run.part_deadline - time.monotonic() - 3))
            res["returncode"] = p.returncode
        finally:
            f.flush()
            out = log.read_text(errors="replace")
            bad = [x for x in out.splitlines() if x.startswith(("FAILED", "ERROR"))]
            res["failures"] = bad[:40]
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    counts = re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)
    res["counts"] = {k: int(n) for n, k in counts}
    res["last_line"] = tail
    if res["returncode"] != 0:
        raise RuntimeError(f"pytest exited {res['returncode']}: {tail}")


# ---- 3. kernel: decode over ragged caches, a prefill chunk; SDPA and FlashAttention-2 beside ----

def ragged_cache(lens, d, dtype, dev, seed=0):
    """A compacted kernels.RaggedKV, head h holding lens[h] random keys (what eviction leaves)."""
    from kernels import RaggedKV
    g = torch.Generator(device=dev).manual_seed(seed)
    H, n = len(lens), max(lens)
    kv = RaggedKV(H, d, dtype, dev)
    kv.append(torch.randn(n, H, d, generator=g, device=dev).to(dtype),
              torch.randn(n, H, d, generator=g, device=dev).to(dtype), torch.arange(n))
    kv.keep_rows(torch.cat([torch.arange(n) >= n - m for m in lens]))
    return kv


def attend_case(kv, t, G, dev):
    """Time the Triton kernel on t new queries per head of kv (as RaggedKV.attend calls it; that
    call itself, host work included, beside it) against dense SDPA or FlashAttention-2 on the same
    keys -> a row. GB/s and TFLOP/s count the work needed (kept K/V read, visible query-key
    pairs), the same for every column; max_diff: each output against ours."""
    import torch.nn.functional as F

    import kernels
    H, d, dtype = kv.n_heads, kv.head_dim, kv.dtype
    lens, scale = kv.lens.tolist(), d ** -0.5
    q = torch.randn(t, H * G, d, device=dev).to(dtype)
    nbytes = (sum(lens) * 2 + 2 * t * H * G) * d * q.element_size()
    pairs = sum(G * sum(min(max(i + n - t + 1, 0), n) for i in range(t)) for n in lens)
    row = dict(t=t, heads=H, group=G, d=d, keys=sum(lens), keys_per_head=[min(lens), max(lens)],
               bytes=nbytes, flops=4 * d * pairs, results={})
    L = max(lens)
    kd = torch.zeros(1, H, L, d, dtype=dtype, device=dev)  # the dense padded layout, for SDPA
    vd = torch.zeros_like(kd)
    for h, n in enumerate(lens):
        s = int(kv.starts[h])
        kd[0, h, :n], vd[0, h, :n] = kv.k[s:s + n], kv.v[s:s + n]
    qd = q.view(t, H * G, d).transpose(0, 1)[None]  # (1, H*G, t, d)
    k, v, cu_k, used, max_len = kv.keys_values()  # what RaggedKV.attend passes, made once
    qv = q.view(t, H, G, d).transpose(0, 1).reshape(H * t, G, d)  # KV head h: a sequence of t rows
    cu_q = torch.arange(H + 1, dtype=torch.int32, device=dev) * t
    flat = lambda o: o.view(H, t, G, d).transpose(0, 1).reshape(t, H * G, d)
    ours = lambda: flat(kernels.varlen_attention(qv, k, v, cu_q, cu_k, t, max_len, scale,
                                                  causal=True, seqused_k=used, backend="triton",
                                                  check=False))  # timed as RaggedKV calls it
    cands = {"ours (triton)": (ours, True),
             "RaggedKV.attend, eager": (lambda: kv.attend(q, scale, backend="triton"), False)}
    if min(lens) == L:  # equal heads: the chunk case, causal, aligned bottom-right
        kf, vf = kd, vd
        # PyTorch's FlashAttention-2 kernel; with is_causal this op aligns the diagonal bottom-right
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        try:  # it takes GQA as it is; else each KV head is repeated for its G query heads
            flash(qd, kf, vf, 0.0, True, False, scale=scale)
        except Exception:
            kf, vf = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
        cands["FlashAttention-2 (torch)"] = (
            lambda: flash(qd, kf, vf, 0.0, True, False, scale=scale)[0][0].transpose(0, 1), True)
    else:  # ragged heads: padding masked, each head's own bottom-right diagonal
        n_h = torch.tensor(lens, device=dev)[:, None, None]
        mask = torch.arange(L, device=dev) <= torch.arange(t, device=dev)[:, None] + n_h - t
        mask = mask.repeat_interleave(G, 0)[None]
        cands["sdpa dense padded"] = (lambda: F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1), True)
    try:
        import flash_attn
        cands[f"flash-attn {flash_attn.__version__} varlen"] = (lambda: flat(
            flash_attn.flash_attn_varlen_func(qv, k, v, cu_q, cu_k, t, max_len, softmax_scale=scale,
                                              causal=True)), True)
    except Exception:  # not installed (the usual case), or broken
        pass
    ours = None
    for label, (fn, graph) in cands.items():
        try:
            out = fn().float()
            ours = out if ours is None else ours
            s, how = timeit(fn, dev, rep_ms=200 if t > 1 else 100, graph=graph)
            row["results"][label] = dict(ms=sig(s * 1e3), GBps=sig(nbytes / s / 1e9),
                                         TFLOPs=sig(row["flops"] / s / 1e12), timed=how,
                                         max_diff=float((out - ours).abs().max()))
        except Exception as e:  # a baseline that does not run here must not stop the others
            row["results"][label] = dict(error=f"{type(e).__name__}: {e}"[:300])
    return row


def part_kernel(S, run, res):
    dev, dtype = device_and_dtype(S)
    H, G, d = S["H"], S["G"], S["d"]
    g = torch.Generator().manual_seed(0)
    res.update(peak_GBps=PEAK_BW / 1e9, dtype=S["dtype"])
    for total in S["decode_keys"]:
        step(run, "kernel", res, dict(case="decode", keys=total))
        share = torch.rand(H, generator=g) + 0.5  # per-head retention varies 3x
        lens = (share / share.sum() * total).long().clamp(min=1).tolist()
        row = attend_case(ragged_cache(lens, d, dtype, dev), 1, G, dev)
        done(run, "kernel", res, dict(row, case="decode"), "decode")
    t, cached = S["chunk"]
    step(run, "kernel", res, dict(case="prefill chunk", t=t, cached=cached))
    row = attend_case(ragged_cache([cached + t] * H, d, dtype, dev), t, G, dev)
    done(run, "kernel", res, dict(row, case="prefill chunk", cached=cached), "chunk")


# ---- 4, 5. the model: batched decode, then prefill end to end ----------------------------------

_MODEL = {}


def random_model(S):
    """(model, gates): random weights in S's shape and dtype (harness.speed.random_model) on the
    GPU (the CPU in a dry run), and a random gate. Built once, for both parts."""
    from gate import Gates
    from harness import speed
    if "model" not in _MODEL:
        dev, dtype = device_and_dtype(S)
        shape = speed.QWEN3_8B if S["model"] == "qwen3-8b" else TINY
        model = speed.random_model(shape, dev, dtype)
        cfg = model.config
        gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                      cfg.group_size, dtype=dtype, device=dev)
        _MODEL["model"] = (model, gates.requires_grad_(False))
    return _MODEL["model"]


def context(model, n, seed):
    """n random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()


def part_decode(S, run, res):
    """One context prefilled with Fast KVzip at 0.3, copied into B members of a serving.batch.Batch
    that decode together (one forward per step, one attention call per layer); tokens/s over all B."""
    import generate
    from cache import Budget
    from serving.batch import Batch
    model, gates = random_model(S)
    dev, dtype = device_and_dtype(S)
    n = S["decode_context"]
    step(run, "decode", res, dict(case="prefill", context=n))
    cache = generate.make_cache("fastkvzip", model, 0, gates=gates)
    generate.prefill(model, cache, context(model, n, 1), 0,
                     Budget(BUDGET, S["chunk_size"], S["window"]))
    cache.start_decoding()
    res.update(context=n, budget=BUDGET, member_kv_bytes=cache.nbytes, steps=S["steps"])
    for B in S["batch"]:
        step(run, "decode", res, dict(batch=B))
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = gpu_memory(dev)[0]
        batch = Batch(model.config, dtype, dev)
        for _ in range(B):
            batch.join(copy.deepcopy(cache))
        tokens = context(model, B, B)
        for _ in range(2):  # warm-up: the decode kernels compile
            tokens = generate.decode_batch(model, batch, tokens).argmax(-1).tolist()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(S["steps"]):
            tokens = generate.decode_batch(model, batch, tokens).argmax(-1).tolist()
        sync(dev)
        s = time.perf_counter() - t0
        done(run, "decode", res, dict(batch=B, seconds=sig(s), tok_s=sig(B * S["steps"] / s),
                                      ms_per_step=sig(s / S["steps"] * 1e3),
                                      kv_bytes=batch.nbytes, gpu_peak_bytes=peak_above(dev, base)))
        del batch


def byte_tokenizer():
    """One token per byte, and one per control token of the Qwen prompt: the KVzip teacher's repeat
    prompts, where only their length matters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    return tok


class TimedTeacher:
    """The KVzip teacher, with the seconds its scoring pass takes (the part the gate replaces)."""

    def __init__(self, teacher, dev):
        self.teacher, self.dev, self.seconds = teacher, dev, 0.0

    def __getattr__(self, name):
        return getattr(self.teacher, name)

    def score(self, *a, **kw):
        sync(self.dev)
        t0 = time.perf_counter()
        out = self.teacher.score(*a, **kw)
        sync(self.dev)
        self.seconds += time.perf_counter() - t0
        return out


def prefill_once(S, model, gates, teacher, method, ids, chunk_size, window):
    """One prefill of ids with `method` on a fresh cache, as generate.py runs it -> a row."""
    import generate
    from cache import Budget, KVCache
    from harness.timing import time_scorer
    dev, dtype = device_and_dtype(S)
    cache = KVCache(model.config, dtype, dev) if method == "full" else \
        generate.make_cache(method, model, 0, gates=gates)
    if getattr(cache, "scorer", None) is not None:  # the gate's share
        time_scorer(cache.scorer, dev)
    teacher.seconds = 0.0
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = gpu_memory(dev)[0]
    budget = 1.0 if method == "full" else BUDGET
    sync(dev)
    t0 = time.perf_counter()
    if method == "kvzip":  # full prefill, the teacher's scoring pass, one eviction (METHOD.md §6)
        generate.prefill_kvzip(model, teacher, cache, ids, 0, Budget(budget, chunk_size, window))
    else:
        generate.prefill(model, cache, ids, 0, Budget(budget, chunk_size, window))
    sync(dev)
    s = time.perf_counter() - t0
    scorer = teacher if method == "kvzip" else getattr(cache, "scorer", None)
    score_s = getattr(scorer, "seconds", 0.0)
    return dict(context=len(ids), method=method, budget=budget, seconds=sig(s),
                tok_s=sig(len(ids) / s), score_s=sig(score_s), score_share=sig(score_s / s),
                kv_bytes=cache.nbytes,
                kv_peak_bytes=cache.peak_nbytes,
                gpu_peak_bytes=peak_above(dev, base))


def part_prefill(S, run, res):
    """Full, Fast KVzip and KVzip at 0.3 on 32K then 128K tokens, chunks of 16,000 and a window of
    4,096 (the authors' settings, METHOD.md §6); gpu_peak_bytes: the prefill's peak above the
    weights."""
    from prompts import prompt_format
    from teacher import KVzipTeacher
    model, gates = random_model(S)
    dev, _ = device_and_dtype(S)
    fmt = prompt_format(model.config, "qwen3-8b")
    teacher = TimedTeacher(KVzipTeacher(model, byte_tokenizer(), fmt, chunk_size=S["score_chunk"],
                                        prefill_chunk=S["chunk_size"]), dev)
    res.update(chunk_size=S["chunk_size"], window=S["window"], budget=BUDGET)
    n, chunk, window = S["warmup"]  # compiles the kernel variants; not a measurement
    step(run, "prefill", res, dict(case="warm-up", context=n))
    t0 = time.perf_counter()
    for method in ("full", "fastkvzip", "kvzip"):
        prefill_once(S, model, gates, teacher, method, context(model, n, 0), chunk, window)
    res["warmup_s"] = round(time.perf_counter() - t0, 2)
    for n, methods in S["prefill"]:
        ids = context(model, n, n)
        for method in methods:
            step(run, "prefill", res, dict(context=n, method=method))
            done(run, "prefill", res, prefill_once(S, model, gates, teacher, method, ids,
                                                   S["chunk_size"], S["window"]))


PARTS = dict(env=part_env, tests=part_tests, kernel=part_kernel, decode=part_decode,
             prefill=part_prefill)


# ---- summary.md: a line per part, the goals beside the numbers -----------------------------------

def _rows(results, part, key="rows"):
    return (results.get(part) or {}).get(key) or []


def goals(results):
    """[(goal, measured, verdict)], each read at the largest size that has what it needs."""
    out = []

    def add(goal, value, target, text, verdict=None):  # value None: not measured
        verdict = verdict or ("not measured" if value is None else "met" if target(value) else
                              "missed")
        out.append((goal, text if value is not None else "–", verdict))

    dec = [r for r in _rows(results, "kernel", "decode") if "GBps" in r["results"]["ours (triton)"]]
    bw = dec[-1]["results"]["ours (triton)"]["GBps"] * 1e9 / PEAK_BW if dec else None
    add("kernel decode >= 80% of the H200's 4.8 TB/s", bw, lambda v: v >= 0.8,
        dec and f"{bw:.0%} ({dec[-1]['keys']} keys/layer)")
    r = (_rows(results, "kernel", "chunk") or [{"results": {}}])[-1]["results"]
    ours, fa2 = (r.get(k, {}).get("TFLOPs") for k in ("ours (triton)", "FlashAttention-2 (torch)"))
    frac = ours / fa2 if ours and fa2 else None
    add("prefill chunk >= 70% of FlashAttention-2", frac, lambda v: v >= 0.7,
        frac and f"{frac:.0%} ({ours:.4g} vs {fa2:.4g} TFLOP/s)")
    pre = {(r["context"], r["method"]): r for r in _rows(results, "prefill")}
    both = lambda a, b: max((n for n, m in pre if m == a and (n, b) in pre), default=None)
    n = both("fastkvzip", "kvzip")
    cut = (results.get("prefill") or {}).get("running") or {}
    goal = "Fast KVzip prefill >= 4x faster than KVzip at 128K (paper ~5x at 170K)"
    fast = pre.get((cut.get("context"), "fastkvzip"))
    if cut.get("method") == "kvzip" and "cut_after_s" in cut and fast:
        lower = cut["cut_after_s"] / fast["seconds"]  # KVzip took longer than this: a lower bound
        add(goal, lower, None, f"> {lower:.1f}x at {cut['context']} tokens (KVzip cut after "
            f"{cut['cut_after_s']:.0f} s)", "met" if lower >= 4 else "not measured (cut)")
    else:
        x = pre[(n, "kvzip")]["seconds"] / pre[(n, "fastkvzip")]["seconds"] if n else None
        add(goal, x, lambda v: v >= 4, n and f"{x:.2f}x at {n} tokens")
    n = max((n for n, m in pre if m == "fastkvzip"), default=None)
    share = pre[(n, "fastkvzip")]["score_share"] if n else None
    add("gate <= 2% of prefill time (paper ~1%)", share, lambda v: v <= 0.02,
        n and f"{share:.2%} at {n} tokens")
    n = both("fastkvzip", "full")
    fast, full = pre.get((n, "fastkvzip")), pre.get((n, "full"))
    key = "gpu_peak_bytes" if n and fast["gpu_peak_bytes"] is not None else "kv_peak_bytes"
    mem = fast[key] / full[key] if n and full[key] else None
    add("peak prefill memory at 0.3 <= 0.4x the full cache's", mem, lambda v: v <= 0.4,
        mem and f"{mem:.2f}x ({key}, {n} tokens)")
    return out


def describe(name, res):
    """One line for a part: how it ended, and what it measured (a part that failed half way too)."""
    size = lambda b: "–" if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**30 else \
        f"{b / 2**20:.2f} MiB"
    cut = res.get("running")
    status = ("running" if res.get("ok") is None else "ok" if res["ok"] else
              f"FAILED: {res['error'].splitlines()[0][:200]}" + (f" (in {json.dumps(cut)})" if cut
                                                                  else ""))
    said = []
    if name == "env" and "versions" in res:
        v, c = res["versions"], res.get("ceilings", {})
        said = [f"{res.get('gpu', {}).get('name', 'no GPU')}, torch {v['torch']}, triton "
                f"{v['triton']}, flash-attn {v['flash_attn']}, copy {c.get('copy_GBps')} GB/s, "
                f"matmul {c.get('matmul_TFLOPs')} TFLOP/s"]
    elif name == "tests":
        said = [res.get("last_line", "")]
    elif name == "kernel":
        for r in res.get("decode", []) + res.get("chunk", []):
            cols = ", ".join(f"{k} {v['GBps']} GB/s {v['TFLOPs']} TFLOP/s (max|diff| "
                             f"{v['max_diff']:.0e})" if "GBps" in v else f"{k} failed"
                             for k, v in r["results"].items())
            what = "decode" if r["t"] == 1 else f"a {r['t']}-query chunk"
            said.append(f"{what}, {r['keys']} keys: {cols}")
    elif name == "decode":
        said = [f"a {res['context']}-token context at {res['budget']}"] if "context" in res else []
        said += [f"B={r['batch']} {r['tok_s']} tok/s" for r in res.get("rows", [])]
    elif name == "prefill":
        peak = lambda r: r["kv_peak_bytes"] if r["gpu_peak_bytes"] is None else r["gpu_peak_bytes"]
        said = [f"{r['context']} {r['method']} {r['seconds']} s, KV {size(r['kv_bytes'])}, peak "
                f"{size(peak(r))}, score {r['score_share']:.1%}" for r in res.get("rows", [])]
    return f"- **{name}** ({res.get('seconds', '…')} s): " + "; ".join([status] + said)


def summary(results, dry):
    out = ["# GPU check", ""]
    if dry:
        out += ["**Dry run on a CPU: tiny shapes, the Triton interpreter. The numbers mean "
                "nothing; the files and their fields are what a GPU run writes.**", ""]
    out += ["| goal | measured | verdict |", "|---|---|---|"]
    out += [f"| {g} | {m} | {v} |" for g, m, v in goals(results)]
    out += ["", "## Parts", ""] + [describe(n, r) for n, r in results.items()]
    return "\n".join(out) + "\n"


# ---- the command ---------------------------------------------------------------------------------

def output_folder(out):
    """--out as an absolute path, created, or a cli.UsageError (one line) before anything is
    written: an empty --out (it would be the current folder), a file where a folder must be, a
    folder that cannot be written (the folders this made are removed again)."""
    if not out.strip():
        raise cli.UsageError("--out is empty: give a folder for the results (it is created)")
    root = Path(os.path.abspath(Path(out).expanduser()))
    created = cli.no_file_in_the_way(root, f"--out {out}",
                                     "give --out a folder for the results (it is created)")
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".gpu_check-", dir=root))  # can files be made in it?
    except OSError as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise cli.UsageError(f"cannot write in {root} ({e.strerror or e}): give --out a folder "
                             "you can write to") from None
    return root


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the results (created)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, the Triton interpreter: checks the plumbing, not speed")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}: expected some of {', '.join(PARTS)}")
    if args.dry_run:  # Triton reads it when kernels.py decorates the kernel: before kernels loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: use --dry-run on a CPU")
    S = DRY if args.dry_run else GPU

    def check(args):
        run = Run(output_folder(args.out), args.dry_run)
        for name in parts:
            budget = min(S["budgets"][name], run.left())
            if budget < 3:
                run.results[name] = dict(part=name, ok=False,
                                         error="skipped: the run's time is spent")
                run.save(name)
                continue
            run_part(run, name, PARTS[name], S, budget)
        print(f"[gpu_check] wrote {', '.join(sorted(run.wrote))} in {run.out}")
    cli.main(check, args, kept=lambda args: f"the parts measured so far are in {args.out}")


if __name__ == "__main__":
    main()
