"""
Measure every method side by side: how much quality it loses, how much time and memory it saves.

Quality (harness/quality.py): contexts cut from Jane Austen's novels with needles at many depths,
compressed before any question is seen, then asked pass keys, key-value pairs, and scored by
teacher-forced NLL, each method relative to the full cache. Speed and memory (harness/speed.py): the
real path, generate.prefill / prefill_kvzip then decode, on fresh caches, beside transformers on the
same checkpoint (the peer column, when transformers is installed); on a GPU also random weights in
Qwen3-8B's shape. What each run costs on 2 CPU cores: benchmarks/*/README.md.

CPU examples (1 thread):
    python bench.py --quick             # smoke run: 2 contexts, budgets 0.5/0.2, every method
    python bench.py --plot              # 18 contexts of 2K/4K/8K x 7 budgets x 7 configs + speed
Each finished context is saved in --out at once: rerunning the same command resumes. A run split
over both cores (benchmarks/gemma3-270m-cpu/README.md):
    python bench.py --contexts 4 --speed-lengths 0 --shard 0/2 --out results/full-s0 &
    python bench.py --contexts 4 --speed-lengths 0 --shard 1/2 --out results/full-s1; wait
    python bench.py --contexts 4 --no-quality --out results/full-speed
    python bench.py --merge results/full-s0,results/full-s1,results/full-speed --out results/full --plot
Held-out corpus prose instead of Austen (--text prose), SmolLM2 reading it as plain text
(benchmarks/smollm2-135m-cpu-prose/README.md):
    python bench.py --model smollm2-135m-gguf --text prose --no-chat --methods fastkvzip,kvzip,streaming \
        --budgets 1.0,0.5,0.3,0.2 --lengths 2048 --contexts 12 --speed-lengths 0
RULER-4K, 11 tasks (kvpress's leaderboard yardstick, generated offline and sized as RULER sized
kvpress's file: harness/ruler.py; --ruler-sizing model fills the model's own tokens instead), or the
samples of a file in kvpress's dataset layout (e.g. kvpress's own RULER-4K parquet), scored by
string_match, each row fed as kvpress's pipeline feeds it (--ruler-prompt harness: the authors'
system prompt instead); benchmarks/ruler-4k-cpu/README.md has the runs and the Qwen3-8B GPU command:
    python bench.py --suite ruler --ruler-samples 2 --budgets 0.75,0.5,0.3,0.25,0.125 \
        --extra-levels ''
    python bench.py --dataset ruler-4096.parquet --model qwen3-8b --device cuda
Decode-time eviction (--decode-tokens-per-head): long-text NLL, recall of the stream's own facts,
free generations, and ms/token and KV bytes over a generation up to 8K positions
(harness/decode.py; benchmarks/decode-cpu/README.md has the runs and the Qwen3-8B GPU command):
    python bench.py --suite decode --model smollm2-135m-gguf --contexts 5 --lengths 4600 \
        --decode-gaps 1024,2048,3072,4000 --decode-generations 2 --decode-gen-budgets 256,1024
GPU (random weights in Qwen3-8B's shape, speed and memory only, contexts up to 128K):
    python bench.py --no-quality --speed-lengths 0 --gpu-lengths 8192,32768,131072
Outputs in --out (default results/<timestamp>/): config.json, results.json, results.md,
relative.png. --out is a new or empty folder, or one bench.py wrote: a run of the same suite
(resumed), or a merge (merged into again); it holds one run at a time (a second run on it is
refused while the first runs).
"""
import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

import torch

import cli
from cache import LEVELS
from cli import UsageError, resolve_model, write_text
from formats.checkpoint import check_folder, load_checked
from formats.gate_file import GateError, resolve_gate
from gate import METHODS as SCORERS
from harness import decode_suite, quality, quality_report, ruler, ruler_tasks
from harness.kvpress_prompt import kvpress_format
from harness.quality import label, load_docs, load_records, log, quality_key, quality_results, write_record
from harness.report import (
    check_kind,
    check_merged_configs,
    differing,
    is_run,
    markdown,
    not_a_run,
    read_json,
    read_results,
    run_config,
    speed_keys,
)
from harness.speed import QWEN3_8B, SpeedSettings, batch_speed, gpu_section, load_peer, speed
from kernels import ArgumentError
from model import ModelError, chat_template
from offline.fetch_assets import AssetsMissing
from prompts import encode_prompt, prompt_format
from teacher import KVzipTeacher

ROOT = Path(__file__).resolve().parent
# reported in one line (exit 2): bad --model / --gate, the offline assets RULER's generator
# reads (Austen, Llama-3.1's tokenizer) not built, a library call refused (kernels.ArgumentError)
ERRORS = (ModelError, GateError, AssetsMissing, ArgumentError)
# the needle and RULER suites: every method of gate.METHODS (full first) but R-KV, which evicts at
# decode time only (the decode suite's, harness/decode.py)
METHODS = tuple(m for m in SCORERS if m != "rkv")
BUDGETS = (1.0, 0.75, 0.5, 0.4, 0.3, 0.2, 0.1)
# --suite: harness/quality.py's needle contexts, harness/ruler.py, or decode-time eviction
# (harness/decode.py)
SUITES = ("needle", "ruler", "decode")
RULER_PROMPTS = ("kvpress", "harness")  # --ruler-prompt: harness/kvpress_prompt.py, or teacher's


# ---- Command line --------------------------------------------------------------------------------

# --quick's settings; flags given explicitly win over them
QUICK = dict(lengths=[512], contexts=2, budgets=[0.5, 0.2], speed_lengths=[256], passkeys=1,
             kv_questions=1, probe_tokens=32, continue_tokens=0, speed_decode=4, speed_repeats=1,
             bootstrap=200, extra_levels=[], gpu_lengths=[8192])


def common_flags(p):
    """What every run sets: the model, the methods and budgets compared, the run's folder."""
    p.add_argument("--quick", action="store_true",
                   help="smoke run (< 3 min on 2 CPU cores): 2 contexts of 512 tokens, 2 questions "
                   "each, budgets 0.5 and 0.2, every method at its own level; speed at 256 tokens "
                   "(flags given explicitly win over these)")
    cli.add_model(p)
    p.add_argument("--gate", help="gate file (default: the bundled gate for the model)")
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS),
                   help="comma list of " + ",".join(METHODS) + " (--suite decode: also "
                   "METHOD@LEVEL/wN configurations and the static split of heads, "
                   "harness/decode_config.py)")
    p.add_argument("--budgets", type=cli.floats, default=list(BUDGETS),
                   help="fractions of the context kept")
    p.add_argument("--extra-levels", type=cli.names,
                   default=["calibrated"], help="eviction levels run beside the paper's for "
                   "fastkvzip and kvzip (cache.LEVELS; '' = none)")
    cli.add_seed(p, "contexts, needles, random scores, bootstrap")
    cli.add_threads(p, zero=True, note="1: on the 2-core CPU, 2 threads made the whole run 5x "
                    "slower (small decode ops, other load)")
    p.add_argument("--out", help="output folder (default results/<timestamp>/)")
    p.add_argument("--plot", action="store_true", help="also draw relative.png (needs matplotlib)")
    p.add_argument("--shard", default="0/1",
                   help="k/n: run only the quality contexts c with c %% n == k, to split one "
                   "experiment over processes or machines (each with its own --out; then --merge)")
    p.add_argument("--merge", type=lambda s: [x for x in s.split(",") if x],
                   help="comma list of --out folders of one experiment's shards: merge them into "
                   "--out, run nothing")


def quality_flags(p):
    """The quality suites' contexts, how they are prefilled and evicted, and their intervals."""
    g = p.add_argument_group("quality (every --suite)")
    g.add_argument("--suite", choices=SUITES, default="needle",
                   help="the quality suite: needle (pass keys, JSON pairs and NLL probes in "
                   "Austen, harness/quality.py) or ruler (RULER's 11 offline tasks, scored as "
                   "kvpress scores them, harness/ruler.py; --lengths defaults to 4096, "
                   "--speed-lengths to none) or decode (decode-time eviction over long streams: "
                   "long-text NLL, recall of the stream's own facts, free generation, and decode "
                   "speed and memory over a long generation, harness/decode.py; --methods, "
                   "--lengths and --speed-lengths get its defaults)")
    g.add_argument("--lengths", type=cli.ints, default=[2048, 4096, 8192],
                   help="context lengths in tokens (quality)")
    g.add_argument("--contexts", type=int, default=6,
                   help="contexts per length (each from another document)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="contexts and questions in the model's chat template, as generate.py "
                   "--chat (default: on, except for a base model, whose tokenizer has no "
                   "template); --no-chat: plain text, as a base model reads it")
    g.add_argument("--chunk-size", type=int, default=16384, help="prefill chunk; a longer quality "
                   "context runs the real chunked prefill (KVzip: not chunked)")
    g.add_argument("--window", type=int, default=4096,
                   help="recent tokens always kept (short contexts: 2%%)")
    g.add_argument("--device", default="cpu", help="where the quality suite runs: cpu (fp32) or "
                   "cuda (bf16), e.g. --suite ruler --model qwen3-8b --device cuda")
    g.add_argument("--bootstrap", type=int, default=2000,
                   help="bootstrap resamples for the intervals")
    g.add_argument("--no-quality", action="store_true", help="skip the quality section")


def needle_flags(p):
    """--suite needle: what each context hides and asks."""
    g = p.add_argument_group("--suite needle (harness/quality.py)")
    g.add_argument("--text", choices=quality.TEXTS, default="austen",
                   help="the documents the quality contexts (and --suite decode's streams) are "
                   "cut from: austen (the novels, by chapters) or prose (held-out documents of the "
                   "gates' training corpus: Wikipedia, State of the Union addresses, the Python "
                   "library reference)")
    g.add_argument("--passkeys", type=int, default=quality.NEEDLES["passkeys"],
                   help="pass keys hidden per context, at stratified depths")
    g.add_argument("--kv-pairs", type=int, default=quality.NEEDLES["kv_pairs"],
                   help="key-value pairs in each context's JSON block")
    g.add_argument("--kv-questions", type=int, default=quality.NEEDLES["kv_questions"],
                   help="of those, how many are asked")
    g.add_argument("--probe-tokens", type=int, default=quality.NEEDLES["probe_tokens"],
                   help="tokens scored by each NLL probe")
    g.add_argument("--continue-tokens", type=int, default=quality.NEEDLES["continue_tokens"],
                   help="greedy tokens of free continuation (agreement only)")
    g.add_argument("--average", type=lambda s: s.split(","), default=list(quality.AVERAGED),
                   help="tasks in the relative-performance average (default: all four, as the "
                   "paper's Figure 10); a summary choice: --merge can recompute it from "
                   "finished runs")


def ruler_flags(p):
    """--suite ruler: RULER's samples, generated or a --dataset's rows, and how they are fed."""
    g = p.add_argument_group("--suite ruler (harness/ruler.py)")
    g.add_argument("--dataset", help="a JSONL or parquet file in kvpress's dataset layout "
                   "(context, question, answer_prefix, answer(s), max_new_tokens, task), e.g. "
                   "kvpress's RULER-4K file: its rows are the samples, scored by string_match "
                   "(implies --suite ruler)")
    g.add_argument("--ruler-samples", type=int, default=5,
                   help="--suite ruler: samples generated per task")
    g.add_argument("--ruler-sizing", choices=ruler_tasks.SIZINGS, default="ruler",
                   help="--suite ruler: how samples fill --lengths: ruler (as RULER sized kvpress's "
                   "RULER-4K file: Llama-3.1-8B tokens for every model, RULER's fixed haystack "
                   "steps; labelled RULER-4K) or model (the largest haystack that fits in the "
                   "model's own tokens; labelled 'RULER-4K (model-token sizing)')")
    g.add_argument("--ruler-tasks", type=cli.names,
                   default=list(ruler_tasks.TASKS), help="--suite ruler: comma list of the tasks "
                   "generated (default all 11: " + ",".join(ruler_tasks.TASKS) + ")")
    g.add_argument("--ruler-only", type=cli.names,
                   help="--suite ruler: comma list of tasks of --ruler-tasks whose contexts this run "
                   "runs; the experiment (its --out, its results) stays that of all --ruler-tasks, "
                   "the other tasks' contexts left to a later run, as --shard leaves its peers' "
                   "(e.g. the tasks a full cache does at all, when CPU hours are short)")
    g.add_argument("--ruler-prompt", choices=RULER_PROMPTS, default="kvpress",
                   help="how RULER rows (generated or --dataset) are fed: kvpress (the default: "
                   "as kvpress's pipeline, one user turn of the model's chat template holding the "
                   "context, template tokens compressed with it, the first 4 tokens kept) or "
                   "harness (the authors' system prompt and task sentence before the context, "
                   "never evicted, as --suite needle)")
    g.add_argument("--answer-batch", action=argparse.BooleanOptionalAction, default=True,
                   help="--suite ruler: answer all the caches of a context in one batched decode "
                   "(default); --no-answer-batch: one cache after another, as answered alone "
                   "(the same greedy answers, one method cache alive at a time)")


def speed_flags(p):
    """The speed section: CPU prefill and decode, batched decoding, the GPU."""
    g = p.add_argument_group("speed (harness/speed.py)")
    g.add_argument("--speed-lengths", type=cli.ints, default=[2048, 8192, 16384],
                   help="CPU speed contexts ('0' = none)")
    g.add_argument("--speed-budget", type=float, default=0.3,
                   help="budget of the speed runs (paper Fig. 1b: 30%%)")
    g.add_argument("--speed-chunk", type=int, default=2048, help="prefill chunk of the CPU speed "
                   "runs: the " "paper's 16K chunk over 170K contexts, scaled to 16K contexts")
    g.add_argument("--speed-window", type=int, default=512,
                   help="local window of the CPU speed runs (scaled 4096)")
    g.add_argument("--speed-decode", type=int, default=32, help="tokens decoded per speed run")
    g.add_argument("--speed-repeats", type=int, default=2,
                   help="runs of full, transformers and fastkvzip at --speed-budget per length, "
                   "taken in turn; their rows hold medians")
    g.add_argument("--no-peer", action="store_true", help="CPU speed: skip transformers (the peer "
                   "column; it " "runs whenever transformers is installed)")
    g.add_argument("--batch-sizes", type=cli.ints, default=[], help="CPU batched decoding: "
                   "requests decoded at " "once, e.g. 1,4,8 ('0' = none, the default)")
    g.add_argument("--batch-length", type=int, default=1024,
                   help="batched decoding: the longest context (the others 75-100%% of it)")
    g.add_argument("--batch-repeats", type=int, default=1, help="batched decoding: rounds of every "
                   "configuration, taken in turn; the tables show medians")
    g.add_argument("--gpu-lengths", type=cli.ints, default=[8192, 32768, 131072],
                   help="GPU speed contexts")
    g.add_argument("--no-gpu", action="store_true",
                   help="skip the GPU section even when CUDA is available")


def parse_args(argv=None):
    """The flags, one group per suite (as --help lists them); then the defaults of --quick and of
    the suite for the flags not typed; each flag checked."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (common_flags, quality_flags, needle_flags, ruler_flags, decode_suite.add_arguments,
                speed_flags):
        add(p)
    args, unset = p.parse_args(argv), object()
    # parsed again onto a namespace that already holds every flag, argparse sets only the flags
    # typed: those keep their value under --quick
    typed = {k for k, v in vars(p.parse_args(argv,
                                             argparse.Namespace(
                                                 **dict.fromkeys(vars(args), unset)))).items()
             if v is not unset}
    try:
        shard = tuple(int(x) for x in args.shard.split("/"))
        assert len(shard) == 2 and 0 <= shard[0] < shard[1]
    except (ValueError, AssertionError):
        p.error(f"--shard {args.shard}: expected k/n with 0 <= k < n, e.g. 0/2")
    args.shard = shard
    if args.dataset and "suite" in typed and args.suite != "ruler":
        p.error("--dataset reads kvpress's layout, scored by string_match: it runs as --suite "
                "ruler")
    # what makes generated samples; a --dataset's rows are its samples (as --ruler-only, refused)
    ignored = [f for f in ("lengths", "ruler_tasks", "ruler_samples", "ruler_sizing") if f in typed]
    if args.dataset and ignored:
        p.error(f"--dataset {args.dataset}: its rows are the samples, run whole; leave out "
                f"--{ignored[0].replace('_', '-')} (it sets generated RULER samples)")
    if args.dataset:
        args.suite = "ruler"
    if args.suite == "ruler":  # RULER-4K, as kvpress's leaderboard; no speed rows unless asked for
        for k, v in (("lengths", [4096]), ("speed_lengths", [])):
            if k not in typed:
                setattr(args, k, v)
    if args.suite == "decode":  # its own methods, one stream length, speed up to 8K positions
        for k, v in decode_suite.DEFAULTS.items():
            if k not in typed:
                setattr(args, k, v)
    if args.quick:
        for k, v in QUICK.items():
            if k not in typed:
                setattr(args, k, v)
    if args.out is not None and not args.out.strip():
        p.error("--out '' names no folder: give a folder, or leave --out out (the default "
                "results/<timestamp>/)")
    if not args.merge:
        check_suite_flags(p, args.suite, typed)
    check_args(p, args)
    if "full" not in args.methods:
        args.methods = ["full"] + args.methods  # every relative score needs the full cache
    return args


def check_suite_flags(p, suite, typed):
    """A flag typed that the suite does not read is refused, not ignored: the needle and RULER
    suites' flags under --suite decode, the decode suite's under the others."""
    if suite == "decode":
        unread = sorted(k for k in typed if k not in decode_suite.READS)
        instead = {"budgets": " (its budgets are --decode-budgets, tokens per KV head)",
                   "speed_budget": " (its speed budgets are --decode-speed-budgets)"}
        if unread:
            p.error(f"--{unread[0].replace('_', '-')}: --suite decode does not read it"
                    f"{instead.get(unread[0], '')}; leave it out")
    decode_only = sorted(k for k in typed if k.startswith(("decode_", "loop_")))
    if suite != "decode" and decode_only:
        p.error(f"--{decode_only[0].replace('_', '-')} is a flag of --suite decode; add --suite "
                "decode, or leave it out")


def check_args(p, args):
    """Every flag on its own, before anything loads (p.error: exit 2)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):  # whether it is there: run()
        p.error(f"--device {args.device}: cpu, cuda or cuda:N")
    if args.suite == "decode":
        return decode_suite.check_args(p, args)
    bad = [m for m in args.methods if m not in METHODS] + [lv for lv in args.extra_levels
                                                           if lv not in LEVELS]
    if bad:
        p.error(f"unknown method/level {bad}: methods are {','.join(METHODS)}, levels "
                f"{','.join(LEVELS)}")
    if not args.budgets or not all(0 < b <= 1 for b in args.budgets):
        p.error(f"--budgets {','.join(map(str, args.budgets)) or '(none)'}: each must be in (0, 1]")
    if not 0 < args.speed_budget <= 1:
        p.error(f"--speed-budget {args.speed_budget}: must be in (0, 1]")
    if not args.average or any(t not in quality.AVERAGED for t in args.average):
        p.error(f"--average {','.join(args.average) or '(none)'}: tasks are "
                f"{','.join(quality.AVERAGED)}")
    # a repeated value would run (and count) twice
    for name in ("methods", "budgets", "extra_levels", "average"):
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    shown = {}  # results name a budget as printed ({:g}): two that print alike would be one
    for b in args.budgets:
        shown.setdefault(f"{b:g}", []).append(b)
    alike = next((bs for bs in shown.values() if len(bs) > 1), None)
    if alike:
        p.error(f"--budgets {','.join(map(str, alike))}: they print alike ({alike[0]:g}), and the "
                "results name a budget as printed; give budgets that differ in 6 significant "
                "digits")
    for flag, low in (("contexts", 1), ("chunk_size", 1), ("speed_chunk", 1), ("speed_decode", 1),
                      ("bootstrap", 1), ("speed_repeats", 1), ("batch_repeats", 1),
                      ("batch_length", 1), ("window", 0), ("speed_window", 0), ("passkeys", 0),
                      ("kv_pairs", 0), ("kv_questions", 0), ("continue_tokens", 0),
                      ("probe_tokens", quality.CUE_TOKENS + 1)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}"
                    + (f" (the repeat probe's first {quality.CUE_TOKENS} tokens are its cue)"
                       if flag == "probe_tokens" else ""))
    if args.passkeys > len(quality.OWNERS):
        p.error(f"--passkeys {args.passkeys}: at most {len(quality.OWNERS)} (one per named owner)")
    if args.kv_questions > args.kv_pairs:
        p.error(f"--kv-questions {args.kv_questions} asks more pairs than --kv-pairs "
                f"{args.kv_pairs} holds")
    bad = [t for t in args.ruler_tasks if t not in ruler_tasks.TASKS]
    if bad or not args.ruler_tasks:
        p.error(f"--ruler-tasks {','.join(bad) or '(none)'}: tasks are {','.join(ruler_tasks.TASKS)} "
                f"(the QA tasks {', '.join(ruler_tasks.LEFT_OUT)} need SQuAD and HotpotQA, which are not "
                "offline)")
    args.ruler_tasks = list(dict.fromkeys(args.ruler_tasks))
    if args.ruler_only is not None:
        bad = [t for t in args.ruler_only if t not in args.ruler_tasks]
        if bad or not args.ruler_only or args.dataset or args.suite != "ruler":
            p.error(f"--ruler-only {','.join(args.ruler_only) or '(none)'}: " + (
                "a --dataset's rows are run whole; leave --ruler-only out" if args.dataset else
                "it picks RULER tasks; add --suite ruler" if args.suite != "ruler" else
                f"give tasks of --ruler-tasks ({','.join(args.ruler_tasks)})"))
    if args.ruler_samples < 1:
        p.error(f"--ruler-samples must be >= 1, got {args.ruler_samples}")
    if args.dataset and Path(args.dataset).is_dir():
        p.error(f"--dataset {args.dataset} is a folder; give a JSONL or parquet file")
    if args.dataset and not Path(args.dataset).exists():
        p.error(f"--dataset {args.dataset}: no such file")
    if args.dataset and not Path(args.dataset).is_file():  # a FIFO would block, a device be endless
        p.error(f"--dataset {args.dataset} is not a regular file; give a JSONL or parquet file")
    if not args.no_quality and not args.merge and not args.lengths:
        p.error("--lengths is empty: give context lengths, or --no-quality")
    n_contexts, made = len(args.lengths) * args.contexts, "--lengths x --contexts"
    if args.suite == "ruler":  # a --dataset's contexts are counted when it is read
        n_contexts = 10**9 if args.dataset else \
            len(args.lengths) * args.ruler_samples * len(args.ruler_tasks)
        made = "--lengths x --ruler-samples x --ruler-tasks"
    if not args.no_quality and not args.merge and args.shard[0] >= n_contexts:  # it would run none
        p.error(f"--shard {args.shard[0]}/{args.shard[1]}: the run has {n_contexts} contexts "
                f"({made}), shard {args.shard[0]} holds none; use at most {n_contexts} shards")
    if args.ruler_only and not args.no_quality and not ruler.n_runs(
            n_contexts, args.shard, args.ruler_tasks, set(args.ruler_only)):
        p.error(f"--shard {args.shard[0]}/{args.shard[1]} holds no context of --ruler-only "
                f"{','.join(args.ruler_only)} (of {n_contexts}: {made}, one task after another); "
                "use fewer shards, or other tasks")


def main(argv=None):
    try:
        return run(parse_args(argv))
    finally:
        cli.release_folders()  # as cli.main does after a run


def experiment(args):
    """The quality experiment the flags ask for, as plain values."""
    names = [f.name for f in dataclasses.fields(quality.Experiment)]
    return quality.Experiment(**{k: getattr(args, k) for k in names})


def speed_settings(args):
    """What the speed runs share, as plain values."""
    return SpeedSettings(model=args.model, gate=args.gate, seed=args.seed, budget=args.speed_budget,
                         budgets=tuple(args.budgets), chunk_size=args.speed_chunk,
                         window=args.speed_window, decode=args.speed_decode,
                         repeats=args.speed_repeats)


def run(args):
    if args.merge:
        if not args.out:
            raise UsageError("--merge needs --out: the folder that receives the merged results")
        return merge(args.merge, args.out, args.bootstrap, args.seed, args.average, args.plot)
    cli.parse_device(args.device)  # CUDA on this machine, the GPU there: before --out
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    out = Path(args.out or ROOT / "results" / time.strftime("%Y%m%d-%H%M%S"))
    cli.claim_folder(out, "--out", is_run, RUN)  # a user's folder, or one in use: refused now
    check_kind(out, args.suite, merged=False)  # another suite's run, or a merge's result
    # a --dataset's every row is checked before anything loads (its lengths once the tokenizer is)
    rows = ruler.read_rows(args.dataset) if args.dataset else None
    samples = None  # the needle suite's contexts, made before anything is written
    folder = resolve_model(args.model)
    # the cheap checks first (config, tokenizer, gate, lengths, --out): the weights load last
    cfg, tok = check_folder(folder)
    fmt = prompt_format(cfg, args.model, chat=args.chat)
    # RULER's rows: kvpress's one user turn (harness/kvpress_prompt.py), or the system prompt above
    suite_fmt = kvpress_format(cfg, args.model, args.chat, chat_template(folder)) \
        if args.suite == "ruler" and args.ruler_prompt == "kvpress" else fmt
    gates = resolve_gate(args.gate, cfg, args.model)
    if args.suite == "decode":
        return decode_suite.bench_run(args, ROOT, folder, cfg, tok, gates, claim)
    check_lengths(args, cfg, tok, len(encode_prompt(tok, fmt.system)))
    if rows:
        check_dataset(args, cfg, tok, suite_fmt, rows)
    elif args.suite == "ruler" and not args.no_quality:  # a length too short for a task
        ruler.check_generated(tok, suite_fmt, args.lengths, args.ruler_tasks, args.seed,
                              args.ruler_sizing, cfg.max_position_embeddings)
    elif not args.no_quality:  # a length too short for the needles, or longer than every document
        samples = quality.make_samples(tok, fmt, experiment(args))
    cli.claim_folder(out, "--out", is_run, RUN, create=True)
    args.out_dir = str(out)
    exp, s = experiment(args), speed_settings(args)
    config = run_config(vars(args), folder, gates)
    key = config["quality_key"] = ruler.run_key(exp, config) if exp.suite == "ruler" else \
        quality_key(exp, config)
    config.update({f"{k}_key": v for k, v in speed_keys(s, "kvzip" in args.methods, args.threads,
                                                          config).items()})
    # an interrupted run with the same --out resumes after its last context
    done = load_records(out, key, n_contexts(key), bad=entries_check(key))
    results = dict(config=config, compressed_layers=list(cfg.compressed_layers), rows=[],
                   complete=False)
    if args.ruler_only:  # left to a later run (or out on purpose): named in results.md
        results["tasks_left_out"] = [t for t in args.ruler_tasks if t not in args.ruler_only]
    gpu = torch.cuda.is_available() and not args.no_gpu
    previous = out / "results.json"
    # keep the speed rows of an earlier run of this folder if this one does not redo them
    if previous.exists():
        old = read_results(previous, "delete it: the finished contexts in contexts/ are kept, "
                           "only speed rows are lost")
        for k, redo in (("speed", bool(args.speed_lengths)), ("gpu", gpu)):
            if not old.get(k) or redo:
                continue  # nothing to keep, or replaced by this run
            if old["config"].get(f"{k}_key") != config[f"{k}_key"]:
                raise UsageError(f"{previous} holds {k} rows of another configuration ("
                                 f"{differing(old['config'].get(f'{k}_key') or {}, config[f'{k}_key'])} differ); "
                                 f"use a new --out, or the flags of the run that wrote them")
            results[k] = old[k]
            # the peer rows were measured in the same run
            if k == "speed" and old.get("speed_peer"):
                results["speed_peer"] = old["speed_peer"]
    write_text(out / "config.json", json.dumps(config, indent=1))
    # CPU: fp32 compute (bf16 is ~4x slower without bf16 units); CUDA: bf16, as the paper runs
    device = torch.device(args.device)
    model = load_checked(folder, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    records = list(done.values())

    def save():
        results["seconds"] = (time.perf_counter() - t_start
                              + sum(r["seconds"] for r in done.values()))
        if records:
            results.update(suite_results(records, key, args.bootstrap, args.seed, args.average))
        write_results(out, results)

    def finished(record):
        write_record(out, key, record)
        records.append(record)
        save()
    log(f"model {folder}, gate {gates.meta.get('source')}; writing {out}"
        + (f"; resuming after {len(done)} finished contexts" if done else ""))
    if not args.no_quality:
        if exp.suite == "ruler":
            ruler.run(model, tok, suite_fmt, exp, args.model, args.gate, args.shard, done,
                      on_context=finished, batched=args.answer_batch,
                      only=set(args.ruler_only) if args.ruler_only else None)
        else:
            quality.run(model, tok, fmt, exp, args.model, args.gate, args.shard, done,
                        on_context=finished, samples=samples)
    if args.speed_lengths:
        teacher = KVzipTeacher(model, tok, fmt) if "kvzip" in args.methods else None
        system = encode_prompt(tok, fmt.system)
        stream = [t for _, d in load_docs(tok) for t in d]
        peer = None if args.no_peer else load_peer(folder)
        results["speed"], results["speed_peer"] = speed(model, teacher, args.speed_lengths,
                                                        lambda n: (
                                                            system + stream[:n], len(system)), s,
                                                        peer=peer)
    if args.batch_sizes:
        system = encode_prompt(tok, fmt.system)
        stream, n = [t for _, d in load_docs(tok) for t in d], args.batch_length
        lengths = [n - (n // 4) * i // max(1, max(args.batch_sizes) - 1)
                   for i in range(max(args.batch_sizes))]
        docs = [system + stream[sum(lengths[:i]):sum(lengths[:i]) + m]
                for i, m in enumerate(lengths)]  # distinct text
        peer = None if args.no_peer else load_peer(folder)
        results["batch_speed"] = batch_speed(model, peer, docs, len(system), s, args.batch_sizes,
                                             args.batch_repeats)
        save()
    if gpu:
        results["gpu"] = gpu_section(s, args.gpu_lengths, out)
    elif not results.get("gpu"):
        results["gpu_note"] = ("GPU section (random-weight Qwen3-8B shape up to 128K "
                               "tokens) not run: " + ("--no-gpu." if args.no_gpu
                                                      else "no CUDA device on this machine."))
    results["complete"] = True
    save()
    finish(results, out, args.plot)
    log(f"done in {(time.perf_counter() - t_start) / 60:.1f} min -> {out}/results.md")


def check_lengths(args, cfg, tok, n_system):
    """Context lengths against the model, the prefill chunk and the corpus, before anything runs."""
    # a --dataset's contexts are its own (check_dataset): --lengths is not used
    quality_n = 0 if args.no_quality or args.dataset else max(args.lengths)
    # after the context: a question turn and its answer, or a probe with its ~20-token cue text; 4 +
    # decoded tokens after a speed context (generate.answer's prompt)
    for flag, n, after in (("--lengths", quality_n, args.probe_tokens + 64),
                           ("--speed-lengths", max(args.speed_lengths, default=0),
                            args.speed_decode + 4)):
        if n and n_system + n + after > cfg.max_position_embeddings:
            raise UsageError(f"{flag} {n}: with the system prompt and what follows the context, "
                             f"more than the model's {cfg.max_position_embeddings} positions; use "
                             "shorter contexts")
    if torch.cuda.is_available() and not args.no_gpu and args.gpu_lengths and \
            max(args.gpu_lengths) + args.speed_decode + 4 > QWEN3_8B["max_position_embeddings"]:
        raise UsageError(f"--gpu-lengths {max(args.gpu_lengths)}: more than the "
                         f"{QWEN3_8B['max_position_embeddings']} positions of Qwen3-8B's shape "
                         "with the decoded tokens")
    # speed contexts are cut from it
    corpus = sum(len(d) for _, d in load_docs(tok)) if args.speed_lengths else 0
    if args.speed_lengths and max(args.speed_lengths) > corpus:
        raise UsageError(f"--speed-lengths {max(args.speed_lengths)}: longer than the whole Austen "
                         f"corpus ({corpus} tokens)")


def check_dataset(args, cfg, tok, fmt, rows):
    """A --dataset's rows (ruler.read_rows) against the model's positions, and --shard against its
    contexts, before --out is written."""
    ruler.check_fit(tok, fmt, rows, cfg.max_position_embeddings)
    n = len({r["context"] for _, r in rows})
    if not args.no_quality and args.shard[0] >= n:
        raise UsageError(f"--shard {args.shard[0]}/{args.shard[1]}: --dataset {args.dataset} has "
                         f"{n} contexts, shard {args.shard[0]} holds none; use at most {n} shards")


RUN = "a bench.py run"  # what --out must hold if it holds anything (claim_folder)


def claim(out):
    """--out made and held for this run (cli.claim_folder) -> the folder it created, if any."""
    return cli.claim_folder(out, "--out", is_run, RUN, create=True)


def n_contexts(key, where="--out"):
    """How many contexts the experiment of a quality key has (`where`: whose config holds it)."""
    try:
        if key.get("suite") == "ruler":
            return ruler.n_contexts(key)
        return len(key.get("lengths", [])) * key.get("contexts", 0)
    except (KeyError, TypeError):  # a config.json edited by hand
        raise UsageError(f"{where}/config.json: its quality_key does not say how many contexts "
                         f"the run has; leave that folder out") from None


def entries_check(key):
    """The suite's own check of a record's entries (quality.load_records' `bad`): the needle
    suite's tallies, RULER's scores (what ruler.results reads)."""
    if key.get("suite", "needle") == "needle":
        return quality.bad_entries
    return lambda rec: next((f"its entry {k!r} has no scores" for k, e in rec["entries"].items()
                             if not isinstance(e.get("scores"), list)), None)


def kept(args):
    """What an interrupted run (Ctrl-C, SIGTERM, a full disk) keeps, and how to resume it: a clause
    for cli.main."""
    out = getattr(args, "out_dir", None)  # set once --out exists
    if args.merge or out is None:
        return None
    n = len(list((Path(out) / "contexts").glob("context-*.json")))
    # the default --out is a new folder
    again = "the same command" + ("" if args.out else f" with --out {out}")
    return f"{n} finished contexts are kept in {out}; rerun {again} to resume"


def write_results(out, results):
    write_text(out / "results.json", json.dumps(results, indent=1))
    write_text(out / "results.md", markdown(results))


def suite_results(records, key, n_boot, seed, averaged):
    """The quality part of results.json for the suite that wrote `key` (a run's, or the merged
    runs'): intervals from n_boot bootstrap resamples; the needle suite's average over
    `averaged`."""
    if key.get("suite") != "ruler":
        return quality_results(records, n_boot, seed, averaged)
    source = key.get("dataset_name") or max(key["lengths"])
    # a generated run's key without a sizing is older than RULER's sizing: the model's tokens
    return ruler.results(records, n_boot, seed, source, key.get("ruler_sizing", "model"))


def finish(results, out, plot):
    if plot and results["config"]["quality_key"].get("suite") == "ruler":
        ruler.plot(results, out / "ruler.png")
    elif plot:
        quality_report.plot(results, out / "relative.png")
    avg = {(label(r), r["budget"]): r["relative"] for r in results["rows"]
           if r["task"] == "average"}
    low = min((b for _, b in avg), default=None)
    if avg:  # a run without quality contexts has none
        log("relative at the lowest budget: " + ", ".join(f"{c}@{b:g} {v:.2f}"
                                                          for (c, b), v in avg.items()
                                                          if v is not None and b == low))


def merge(folders, out, n_boot, seed, averaged, plot=False):
    """Several runs of one experiment (shards: --shard k/n, each with its own --out) -> one result
    in `out`, its intervals from n_boot bootstrap resamples, the relative average over the tasks in
    `averaged`. A folder that cannot be part of it is refused by name, before `out` is touched."""
    cli.claim_folder(out, "--out", is_run, RUN)
    folders = [Path(f) for f in folders]
    real = [f.resolve() for f in folders]
    same = [str(f) for i, f in enumerate(folders) if real[i] in real[:i]]
    if same:  # its speed rows would count twice
        raise UsageError(f"--merge names {same[0]} twice: give each run once")
    missing = [str(f) for f in folders if not (f / "config.json").exists()]
    if missing:
        raise UsageError(f"no bench run in {', '.join(missing)} (config.json missing)")
    configs = [read_json(f / "config.json",
                         "rerun that folder's command to rewrite it, or leave it out of --merge")
               for f in folders]
    for f, c in zip(folders, configs):
        if not_a_run(c):
            raise UsageError(f"{f}/config.json is not a bench run's ({not_a_run(c)}); leave {f} "
                             f"out of --merge")
    # runs made with --no-quality (speed rows only) expect no context
    quality_runs = [i for i, c in enumerate(configs)
                    if not (isinstance(c.get("flags"), dict) and c["flags"].get("no_quality"))]
    first = quality_runs[0] if quality_runs else 0
    key = configs[first]["quality_key"]
    # a speed-only run's contexts are none: its suite, model and gate must still be the experiment's
    measured_on = lambda k: {n: k.get(n) for n in ("suite", "model", "gate")}
    for i, (f, c) in enumerate(zip(folders, configs)):
        other = c["quality_key"] if i in quality_runs else measured_on(c["quality_key"])
        theirs = key if i in quality_runs else measured_on(key)
        if other != theirs:
            raise UsageError(f"{f} is a run of another experiment than {folders[first]} "
                             f"({differing(theirs, other)} differ); leave {f} out of --merge")
    check_kind(out, key.get("suite", "needle"), merged=True)
    if key.get("suite") == "decode":  # its own records and tables (harness/decode_suite.py)
        check_merged_configs(folders, configs)
        return decode_suite.merge(folders, configs, out, n_boot, seed, claim, plot)
    expected = n_contexts(key, folders[first]) if quality_runs else 0
    records, results = {}, dict(config=dict(configs[first], merged_from=[str(f) for f in folders],
                                            commands=[c["command"] for c in configs]), rows=[])
    for f in folders:
        for c, rec in load_records(f, key, expected, f"leave {f} out of --merge",
                                   entries_check(key)).items():
            # a context run twice (same seed, same flags) is the same context
            records.setdefault(c, rec)
        old = (read_results(f / "results.json", f"delete it (the contexts are merged from "
                            f"contexts/, its speed rows are lost), or leave {f} out of --merge")
               if (f / "results.json").exists() else {})
        for k in ("speed", "gpu"):
            if not old.get(k):
                continue
            row_key = old["config"].get(f"{k}_key")
            if results.get(k) and results["config"].get(f"{k}_key") != row_key:
                raise UsageError(
                    f"{f} holds {k} rows of another configuration than the folders before it "
                    f"({differing(results['config'].get(f'{k}_key') or {}, row_key or {})} "
                    f"differ); leave {f} out of --merge")
            results[k] = merge_rows(results.get(k, []), old[k], f, k)
            results["config"][f"{k}_key"] = row_key
            if k == "speed" and old.get("speed_peer"):  # measured in the same run as these rows
                results["speed_peer"] = merge_rows(results.get("speed_peer", []),
                                                   old["speed_peer"], f, k)
        # none in a run killed before its first results.json
        results["compressed_layers"] = old.get("compressed_layers",
                                               results.get("compressed_layers", []))
        # shards run side by side
        results["seconds"] = max(results.get("seconds", 0), old.get("seconds", 0))
    # the contexts the runs meant: every one, or for RULER those of the tasks --ruler-only chose
    meant, n_done = expected, len(records)
    if key.get("suite") == "ruler" and quality_runs:
        meant, n_done, left = ruler.planned(key, [configs[i].get("flags") or {}
                                                  for i in quality_runs], records)
        if left:
            results["tasks_left_out"] = left
    if n_done < meant:
        log(f"merge: {n_done} of {meant} contexts finished; the result is partial")
    if records:
        results.update(suite_results(list(records.values()), key, n_boot, seed, averaged))
    results["complete"] = n_done == meant
    check_merged_configs(folders, configs)
    out = Path(out)
    created = cli.claim_folder(out, "--out", is_run, RUN, create=True)
    try:  # all or none: a failed merge leaves what the folder held
        cli.write_texts({out / "results.json": json.dumps(results, indent=1),
                         out / "results.md": markdown(results),
                         out / "config.json": json.dumps(results["config"], indent=1)})
    except cli.WriteError:  # a full disk: a folder made for this merge is not left empty
        cli.drop_folder(out, created)
        raise
    finish(results, out, plot)
    log(f"merged {len(records)} contexts from {len(folders)} runs -> {out}/results.md")


def merge_rows(rows, new, folder, kind):
    """Speed (or GPU) rows of one more run: a row measured in an earlier folder too (the same
    context, method, budget, device and batch: shards that each ran the speed section) is kept
    once, the first folder's."""
    ident = lambda r: tuple(r.get(k) for k in ("context", "method", "budget", "device", "batch"))
    seen = {ident(r) for r in rows}
    again = [r for r in new if ident(r) in seen]
    if again:
        log(f"merge: {len(again)} {kind} rows of {folder} were measured by an earlier folder too; "
            f"keeping those")
    return rows + [r for r in new if ident(r) not in seen]


if __name__ == "__main__":
    # bad --model / --gate / folders: one line
    cli.main(run, parse_args(), *ERRORS, kept=kept)
