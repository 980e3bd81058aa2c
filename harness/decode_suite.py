"""
bench.py --suite decode: its flags and checks, the run (harness/decode.py's documents, then the
speed section), and --merge of its runs; the report (tables, intervals, plots) is
harness/decode_report.py's.

Speed: a short prompt, then one greedy generation up to the longest of --speed-lengths positions
through generate.prefill / begin_answer / decode_one, for the full cache and the gate at each of
--decode-speed-budgets, beside transformers' generate (DynamicCache) on the same checkpoint. At
each length: ms per decoded token (the mean over the WINDOW steps before it: two eviction cycles),
the KV bytes allocated (cache.nbytes) and kept (cache.kept_nbytes), and the scorer's share of
those steps, timed here by wrapping the cache's scorer methods.
"""
import json
import time
from pathlib import Path

import numpy as np
import torch

import cli
import generate
from cache import decode_protected
from cli import UsageError, write_text
from formats.checkpoint import load_checked
from harness import closed_loop, decode, decode_config
from harness.decode import decode_cache
from harness.decode_report import header, markdown, plot, results
from harness.quality import load_docs, load_records, log, model_info, write_record
from harness.report import run_config
from harness.speed import load_peer
from harness.timing import time_scorer
from prompts import encode_prompt, prompt_format

WINDOW = 256  # decode steps averaged at each length: two 128-token eviction cycles


# ---- 1. Speed and memory over a long generation --------------------------------------------------

@torch.no_grad()
def timed_generation(model, method, budget, prompt, n_protected, lengths, gates, seed):
    """One greedy generation up to max(lengths) positions -> a row per length: ms/token over the
    WINDOW steps before it, KV bytes allocated and kept, the scorer's share of those steps."""
    _, _, device = model_info(model)
    cache = decode_cache(model, method, n_protected, budget, gates, seed)
    scorer = getattr(cache, "scorer", None)
    clock = time_scorer(scorer, device) if scorer is not None else None
    logits = generate.prefill(model, cache, prompt, n_protected)
    # the answer's tokens: all those fed until max(lengths) positions, and the one sampled last
    logits = generate.begin_answer(model, cache, [], logits,
                                   max_new_tokens=max(lengths) - len(prompt) + 1)
    steps, scored, rows = [], [], []
    while cache.n_seen < max(lengths):
        token = int(logits.argmax())
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, s0 = time.perf_counter(), clock.seconds if clock else 0.0
        logits = generate.decode_one(model, cache, token)
        if device.type == "cuda":
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
        scored.append((clock.seconds if clock else 0.0) - s0)
        if cache.n_seen in lengths:
            w = slice(-min(WINDOW, len(steps)), None)
            rows.append(dict(method=method, budget=budget, length=cache.n_seen,
                             ms_per_token=1000 * float(np.mean(steps[w])),
                             score_share=(float(np.sum(scored[w]) / np.sum(steps[w]))
                                          if clock else None),  # the full cache scores nothing
                             kv_bytes=cache.nbytes, kv_kept_bytes=cache.kept_nbytes))
            log(f"decode speed {method}@{budget}: {cache.n_seen} positions, "
                f"{rows[-1]['ms_per_token']:.1f} ms/token, KV {cache.nbytes / 2**20:.1f} MiB "
                f"allocated, {cache.kept_nbytes / 2**20:.1f} kept")
    return rows


@torch.no_grad()
def peer_generation(peer, prompt, lengths):
    """transformers' generate (greedy, DynamicCache, end of text not stopping it) up to
    max(lengths) positions -> rows as timed_generation's, the KV bytes its cache holds."""
    # transformers is a test/bench-only dependency: imported only when the peer runs
    import transformers
    from transformers import DynamicCache, LogitsProcessor

    cache, stamps, nbytes = DynamicCache(config=peer.config), [], {}

    class Clock(LogitsProcessor):  # called once per step, after the step's forward
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            if input_ids.shape[1] in lengths:
                nbytes[input_ids.shape[1]] = sum(t.nbytes for layer in cache.layers
                                                 for t in (layer.keys, layer.values))
            return scores

    n_new = max(lengths) - len(prompt) + 1  # the last token's forward ends at max(lengths)
    peer.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new,
                  do_sample=False, past_key_values=cache, logits_processor=[Clock()],
                  pad_token_id=peer.config.eos_token_id)
    steps = np.diff(stamps)  # step i: the forward of the token at position len(prompt) + i
    rows = []
    for n in sorted(lengths):
        i = n - len(prompt)  # steps ending with the cache at n positions
        if 0 < i <= len(steps):
            w = steps[max(0, i - WINDOW):i]
            rows.append(dict(method="transformers", budget=None, length=n,
                             ms_per_token=1000 * float(np.mean(w)), score_share=None,
                             kv_bytes=nbytes.get(n), kv_kept_bytes=nbytes.get(n),
                             version=transformers.__version__))
    return rows


def speed(model, peer, prompt, n_protected, lengths, budgets, gates, seed):
    """Rows for the full cache, the gate at each budget and (peer given) transformers."""
    lengths = sorted(n for n in lengths if n > len(prompt))
    rows = timed_generation(model, "full", None, prompt, n_protected, lengths, None, seed)
    for b in budgets:
        rows += timed_generation(model, "fastkvzip", b, prompt, n_protected, lengths, gates, seed)
    if peer is not None:
        rows += peer_generation(peer, prompt, lengths)
    return rows

# ---- 2. bench.py --suite decode: its flags, checks and run ---------------------------------------

# the flags bench.py shares with the other suites, and their defaults under --suite decode
DEFAULTS = dict(methods=list(decode.METHODS), lengths=[decode.LENGTH],
                speed_lengths=[1024, 2048, 4096, 8192])


def add_arguments(p):
    """The decode suite's own flags (bench.py's --methods, --contexts, --lengths, --speed-lengths,
    --no-peer, --seed, --shard, --out serve it too)."""
    g = p.add_argument_group("--suite decode (harness/decode.py)")
    g.add_argument("--decode-budgets", type=cli.ints, default=list(decode.BUDGETS),
                   help="decode budgets, tokens kept per KV head (generate.py "
                   "--decode-tokens-per-head)")
    g.add_argument("--decode-gaps", type=cli.ints, default=list(decode.GAPS),
                   help="recall: tokens between a fact and its question (one fact each)")
    g.add_argument("--decode-prompt", type=int, default=decode.PROMPT,
                   help="document tokens prefilled before decoding starts")
    g.add_argument("--decode-generations", type=int, default=None,
                   help="documents that also run a free greedy generation (default: all)")
    g.add_argument("--decode-gen-tokens", type=int, default=decode.GEN_TOKENS,
                   help="tokens of each free generation")
    g.add_argument("--decode-gen-budgets", type=cli.ints, default=None,
                   help="the budgets the free generations run at (default: every "
                   "--decode-budgets; each is --decode-gen-tokens decode steps per method)")
    g.add_argument("--decode-speed-budgets", type=cli.ints, default=[512, 1024],
                   help="the gate's budgets in the speed section ('0' = the full cache only)")
    g.add_argument("--loop-seeds", type=int, default=0,
                   help="closed-loop samples (harness/closed_loop.py: the model writes a list of "
                   "codes, a long story, then is asked for each code), spread over the documents; "
                   "0 = none")
    g.add_argument("--loop-items", type=int, default=closed_loop.N_ITEMS,
                   help=f"items (codes) in each closed-loop list, 2 to {closed_loop.MAX_ITEMS}")
    g.add_argument("--loop-tokens", type=int, default=closed_loop.TOKENS,
                   help="tokens of each closed-loop story (between the list and the questions)")
    g.add_argument("--loop-budgets", type=cli.ints, default=None,
                   help="the budgets the closed loop runs at (default: every --decode-budgets; "
                   "each is about --loop-tokens decode steps per method and seed)")


def check_args(p, args):
    """--suite decode's flags on their own, before anything loads (p.error: exit 2)."""
    try:  # methods and configurations (METHOD[@LEVEL][/wN]), each named as its rows will be
        args.methods = list(dict.fromkeys(decode_config.parse(m).name for m in args.methods))
    except ValueError as e:
        p.error(f"--suite decode: --methods {e}; a row is METHOD[@LEVEL][/wN] "
                "(harness/decode_config.py), e.g. fastkvzip@head/w8")
    if not args.decode_budgets:
        p.error("--decode-budgets is empty: give tokens per KV head, e.g. 256,512")
    if not args.decode_gaps and not args.no_quality:
        p.error("--decode-gaps 0 asks no fact again: recall needs at least one gap, e.g. "
                "1024,2048")
    if len(args.lengths) != 1:
        p.error(f"--suite decode: --lengths takes one stream length, got {args.lengths}")
    if args.decode_generations is None:
        args.decode_generations = args.contexts
    if args.decode_gen_budgets is None:
        args.decode_gen_budgets = list(args.decode_budgets)
    if not set(args.decode_gen_budgets) <= set(args.decode_budgets):
        p.error(f"--decode-gen-budgets {','.join(map(str, args.decode_gen_budgets))}: each must "
                f"be one of --decode-budgets ({','.join(map(str, args.decode_budgets))})")
    check_loop_args(p, args)
    for flag, low in (("contexts", 1), ("decode_prompt", 1), ("decode_generations", 0),
                      ("decode_gen_tokens", 1), ("bootstrap", 1)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    need = args.decode_prompt + decode.FACT_START + decode.FACT_STEP * len(args.decode_gaps) \
        + max(args.decode_gaps, default=0) + decode.SENTENCE_WAIT
    if args.decode_gaps and args.lengths[0] < need:
        p.error(f"--lengths {args.lengths[0]}: too short for --decode-gaps "
                f"{','.join(map(str, args.decode_gaps))} and --decode-prompt {args.decode_prompt} "
                f"(the prompt, the facts, the longest gap and room for sentence ends need {need}); "
                "lengthen it, or shorten the gaps or the prompt")
    if not args.no_quality and args.shard[0] >= args.contexts:
        p.error(f"--shard {args.shard[0]}/{args.shard[1]}: the run has {args.contexts} documents, "
                f"shard {args.shard[0]} holds none")


def check_loop_args(p, args):
    """--loop-*: counts, and budgets among --decode-budgets (their entries are the documents')."""
    if args.loop_budgets is None:
        args.loop_budgets = list(args.decode_budgets)
    if not set(args.loop_budgets) <= set(args.decode_budgets):
        p.error(f"--loop-budgets {','.join(map(str, args.loop_budgets))}: each must be one of "
                f"--decode-budgets ({','.join(map(str, args.decode_budgets))})")
    for flag, low in (("loop_seeds", 0), ("loop_tokens", 1), ("loop_items", 2)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    if args.loop_items > closed_loop.MAX_ITEMS:
        p.error(f"--loop-items {args.loop_items}: a list holds at most {closed_loop.MAX_ITEMS} "
                f"items (the names of a theme)")


def experiment(args):
    return decode.DecodeExperiment(
        methods=args.methods, budgets=args.decode_budgets, contexts=args.contexts,
        length=args.lengths[0], gaps=args.decode_gaps, prompt_tokens=args.decode_prompt,
        generations=args.decode_generations, gen_tokens=args.decode_gen_tokens,
        gen_budgets=args.decode_gen_budgets, seed=args.seed,
        chat=args.chat, device=args.device, text=args.text,
        loop=decode.loop_settings(args.loop_seeds, args.loop_tokens, args.loop_budgets,
                                  args.loop_items))


def decode_window(method):
    """The last tokens `method`'s cache always keeps while decoding: its configuration's window, by
    default its scorer's (harness/decode_config.py, gate.METHODS)."""
    return decode_config.parse(method).window


def check_fit(args, cfg, tok):
    """Every value against what it can measure, before anything heavy: each sequence within the
    model's positions, each speed length past the speed run's prompt, each budget above what a
    cache always keeps (else nothing is left to the scorer) and below the sequence it evicts from
    (else nothing is evicted)."""
    n = cfg.max_position_embeddings
    # the free generation's prompt: ~160 excerpt tokens and the fact, in its chat turn (< 400)
    for flag, need in (("--lengths", 0 if args.no_quality else args.lengths[0]),
                       ("--speed-lengths", max(args.speed_lengths, default=0)),
                       ("--decode-gen-tokens", args.decode_gen_tokens + 400 + decode.ANSWER_TOKENS
                        if args.decode_generations and not args.no_quality else 0),
                       ("--loop-tokens", closed_loop.positions(args.loop_tokens)
                        if args.loop_seeds and not args.no_quality else 0)):
        if need > n:
            raise UsageError(f"{flag}: {need} positions, more than the model's {n}; use shorter "
                             "sequences")
    system = len(encode_prompt(tok, prompt_format(cfg, args.model, chat=False).system))
    if args.speed_lengths:
        prompt = system + args.decode_prompt  # an Austen chapter's first tokens: far more
        inside = [x for x in args.speed_lengths if x <= prompt]
        if inside:
            raise UsageError(f"--speed-lengths {inside[0]}: not past the speed run's prompt "
                             f"({prompt} tokens: the system prompt and --decode-prompt "
                             f"{args.decode_prompt}); give lengths above {prompt}")
    scored = [m for m in args.methods if m not in ("full", "cut")]
    chat = len(encode_prompt(tok, prompt_format(cfg, args.model, chat=args.chat).system))
    gen = set(args.decode_gen_budgets) if args.decode_generations else set()
    gen |= set(args.loop_budgets) if args.loop_seeds else set()  # the loop's prompt: the chat's
    for flag, budgets, methods, longest, what in (
            ("--decode-budgets", [] if args.no_quality else args.decode_budgets, scored,
             args.lengths[0], f"--lengths {args.lengths[0]}"),
            ("--decode-speed-budgets", args.decode_speed_budgets if args.speed_lengths else [],
             ["fastkvzip"], max(args.speed_lengths, default=0),
             f"--speed-lengths {max(args.speed_lengths, default=0)}")):
        for m, b in ((m, b) for m in methods for b in sorted(budgets)):
            # a stream's cache protects its system prompt, a free generation's its chat's
            least = decode_protected(max(system, chat) if b in gen and flag == "--decode-budgets"
                                     else system, decode_window(m)) + 1
            if b < least:
                raise UsageError(
                    f"{flag} {b} leaves nothing to the scorer: {m} always keeps the system prompt "
                    f"(or the first tokens) and its last {decode_window(m)} tokens ({least - 1} "
                    f"per KV head); use at least {least}")
        if budgets and max(budgets) >= longest:
            raise UsageError(f"{flag} {max(budgets)}: not below {what}, so nothing is ever "
                             f"evicted (it measures the full cache); give budgets below {longest}")


def check_streams(args, tok, cfg):
    """The run's documents (decode.make_streams) made before anything is written; None for a
    speed-only run."""
    if args.no_quality:
        return None
    try:
        return decode.make_streams(tok, prompt_format(cfg, args.model, chat=False),
                                   experiment(args))
    except ValueError as e:  # too few chapters hold such a stream
        raise UsageError(f"--contexts {args.contexts}: {e}") from None


# what --suite decode reads of bench.py's flags, beside its own (--decode-*): bench.py refuses the
# others typed with it
READS = {"suite", "model", "gate", "methods", "lengths", "contexts", "chat", "device", "bootstrap",
         "no_quality", "speed_lengths", "no_peer", "seed", "threads", "shard", "out", "plot", "text",
         "merge", "decode_budgets", "decode_gaps", "decode_prompt", "decode_generations",
         "decode_gen_tokens", "decode_gen_budgets", "decode_speed_budgets", "loop_seeds",
         "loop_tokens", "loop_budgets", "loop_items"}


def bench_run(args, root, folder, cfg, tok, gates, claim):
    """bench.py --suite decode after its cheap checks: every input checked, the model loaded, then
    --out (default root/results/<timestamp>) made and held by claim(path) (bench.py's: a folder
    of other files is refused), and only then written: the quality documents (resumable: each
    finished document is kept in --out/contexts/ at once), then the speed section; results.json,
    results.md and (--plot) decode.png."""
    t_start = time.perf_counter()
    check_fit(args, cfg, tok)
    streams = check_streams(args, tok, cfg)
    exp = experiment(args)
    device = torch.device(args.device)
    model = load_checked(folder, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    # before any work; a speed-only run's caches are the gate's at --decode-speed-budgets
    fill = torch.zeros(len(cfg.compressed_layers), cfg.num_key_value_heads)  # a split's, any
    for m in (m for m in exp.methods if m not in ("full", "cut") and not args.no_quality):
        try:
            decode.decode_cache(model, m, 0, max(exp.budgets), gates, 0, fill)
        except (ValueError, AssertionError) as e:
            raise UsageError(f"--methods {m}: this version cannot evict it during decoding ({e}); "
                             "leave it out of --methods") from None
    out = Path(args.out or Path(root) / "results" / time.strftime("%Y%m%d-%H%M%S"))
    claim(out)
    config = run_config(vars(args), folder, gates)
    key = config["quality_key"] = decode.run_key(exp, config)
    config["speed_key"] = dict(lengths=args.speed_lengths, budgets=args.decode_speed_budgets,
                               model=config["model"]["sha256"], gate=config["gate"]["sha256"],
                               threads=args.threads, device=args.device)
    done = load_records(out, key, key["contexts"], bad=bad_entries)
    records, res = list(done.values()), dict(config=config, complete=False)
    old = out / "results.json"
    if old.exists() and not args.speed_lengths:  # an earlier run's speed rows stay
        kept_speed(previous(old, "delete it (its speed rows are lost)"), res, old)
    write_text(out / "config.json", json.dumps(config, indent=1))
    args.out_dir = str(out)  # what an interrupted run keeps (bench.kept)

    def save():
        res["seconds"] = time.perf_counter() - t_start + sum(r["seconds"] for r in done.values())
        if records:
            res.update(results(records, args.bootstrap, args.seed))
        write_text(out / "results.json", json.dumps(res, indent=1))
        write_text(out / "results.md", "\n".join(header(res) + markdown(res)) + "\n")

    def finished(record):
        # what ran it: the settings are its key (write_record), the code this commit; a resumed
        # run's documents may come from several commits, and results.md names each
        record["provenance"] = dict(git_commit=config["git_commit"], git_dirty=config["git_dirty"],
                                    started=config["started"])
        write_record(out, key, record)
        records.append(record)
        save()
    log(f"decode suite: model {folder}, gate {gates.meta.get('source')}; writing {out}"
        + (f"; resuming after {len(done)} finished documents" if done else ""))
    if not args.no_quality:
        decode.run(model, tok, exp, args.model, args.gate, args.shard, done, on_context=finished,
                   streams=streams)
    if args.speed_lengths:
        fmt = prompt_format(cfg, args.model, chat=False)
        start = encode_prompt(tok, fmt.system)
        doc = load_docs(tok, "austen")[0][1]
        prompt = start + doc[:args.decode_prompt]
        peer = None if args.no_peer else load_peer(folder)
        res["decode_speed"] = speed(model, peer, prompt, len(start), args.speed_lengths,
                                    args.decode_speed_budgets, gates, args.seed)
    res["complete"] = args.no_quality or len(records) == len(
        [c for c in range(args.contexts) if c % args.shard[1] == args.shard[0]])
    save()
    if args.plot:
        plot(res, out / "decode.png")
    log(f"decode suite done in {(time.perf_counter() - t_start) / 60:.1f} min -> {out}/results.md")


def kept_speed(prev, res, path):
    """A rerun that measures no speed (--speed-lengths 0) keeps the rows an earlier run of the
    folder measured, with the settings they were measured with (config's speed_key: each row
    names its own length and budget); rows of another model or gate are refused by name."""
    if not prev.get("decode_speed"):
        return
    theirs, ours = (prev.get("config") or {}).get("speed_key") or {}, res["config"]["speed_key"]
    differ = [k for k in ("model", "gate") if theirs.get(k) != ours.get(k)]
    if differ:
        raise UsageError(f"{path} holds speed rows measured on another {' and '.join(differ)}; "
                         "use a new --out, or the flags of the run that measured them")
    res["decode_speed"], res["config"]["speed_key"] = prev["decode_speed"], theirs


def bad_entries(rec):
    """Why a decode record's entries are not what decode.run writes (what results() reads), or
    None."""
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    for name, e in rec["entries"].items():
        probes, nll, gen = e.get("probes"), e.get("nll"), e.get("gen")
        if not (isinstance(probes, list) and all(
                isinstance(p, list) and len(p) == 5 and all(num(x) or x is None for x in p)
                for p in probes)
                and (nll is None or isinstance(nll, list) and len(nll) == 3
                     and all(map(num, nll)))
                and (gen is None or isinstance(gen, dict) and num(gen.get("first_diff")))
                and closed_loop.well_formed(e.get("loop"))):
            return f"its entry {name!r} is not a decode entry (probes, nll, gen, loop)"
    return None


def previous(path, fix):
    """A run folder's results.json, or one line saying it is damaged and what to do (fix)."""
    try:
        prev = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        raise UsageError(f"{path} is unreadable; {fix}") from None
    if not isinstance(prev, dict) or not isinstance(prev.get("config", {}), dict):
        raise UsageError(f"{path} is not a decode result; {fix}")
    rows = prev.get("decode_speed") or []
    if not (isinstance(rows, list) and all(isinstance(r, dict) and SPEED_ROW <= r.keys()
                                           for r in rows)):
        raise UsageError(f"{path}: its decode_speed rows are not speed rows (objects with "
                         f"{', '.join(sorted(SPEED_ROW))}); {fix}")
    if not isinstance(prev.get("seconds", 0), (int, float)):
        raise UsageError(f"{path}: its seconds are not a number; {fix}")
    return prev


SPEED_ROW = {"method", "budget", "length", "ms_per_token", "kv_bytes", "kv_kept_bytes",
             "score_share"}  # what results.md and decode.png read of a speed row


def merge(folders, configs, out, n_boot, seed, claim, draw=False):
    """bench.py --merge of decode runs (shards of one experiment, and runs with --no-quality whose
    speed rows join them) -> one result in `out`."""
    quality = [(f, c) for f, c in zip(folders, configs) if not c["flags"].get("no_quality")]
    keys = [c["quality_key"] for _, c in quality] or [configs[0]["quality_key"]]
    if any(c["quality_key"].get("suite") != "decode" for c in configs) or \
            any(k != keys[0] for k in keys):
        raise UsageError("--merge: these folders are not runs of one decode experiment (their "
                         "suites, flags, model or gate differ); merge each experiment alone")
    records, res = {}, dict(config=dict(quality[0][1] if quality else configs[0],
                                        merged_from=[str(f) for f in folders]))
    for f, _ in quality:
        for c, rec in load_records(f, keys[0], keys[0]["contexts"], f"leave {f} out of --merge",
                                   bad_entries).items():
            records.setdefault(c, rec)
    for f in folders:
        old = f / "results.json"
        prev = previous(old, f"leave {f} out of --merge") if old.exists() else {}
        if prev.get("decode_speed"):
            if res.get("decode_speed"):
                raise UsageError(f"--merge: {f} holds speed rows, and so does a folder before it; "
                                 "give one run's speed rows")
            res["decode_speed"] = prev["decode_speed"]
        res["seconds"] = max(res.get("seconds", 0), prev.get("seconds", 0))
    if records:
        res.update(results(list(records.values()), n_boot, seed))
    res["complete"] = not quality or len(records) == keys[0]["contexts"]
    out = Path(out)
    created = claim(out)
    try:  # all or none: a failed merge leaves what the folder held
        cli.write_texts({out / "results.json": json.dumps(res, indent=1),
                         out / "results.md": "\n".join(header(res) + markdown(res)) + "\n",
                         out / "config.json": json.dumps(res["config"], indent=1)})
    except cli.WriteError:  # a full disk: a folder made for this merge is not left empty
        cli.drop_folder(out, created)
        raise
    if draw:
        plot(res, out / "decode.png")
    log(f"merged {len(records)} documents from {len(folders)} runs -> {out}/results.md")
