"""
The decode suite's speed and memory over one long generation, and its report: results rows with
95% intervals over documents, results.md, decode.png (quality against budget, ms/token against
length). The quality runs are harness/decode.py's.

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
from cli import UsageError, pyplot, save_figure, write_text
from formats.checkpoint import load_checked
from harness import decode
from harness.decode import decode_cache
from harness.quality import ci, load_docs, load_records, log, model_info, write_record
from harness.quality_report import fmt_ci
from harness.report import run_config, shown
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


# ---- 2. Summary: rows with intervals over documents ----------------------------------------------

def boot(num, den, idx):
    """Ratio of sums, and its bootstrap values over documents (idx: (n_boot, n_docs))."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return num.sum() / den.sum(), num[idx].sum(-1) / den[idx].sum(-1)


def finite(x):
    x = float(x)
    return x if np.isfinite(x) else None


def results(records, n_boot, seed):
    """The decode part of results.json from the finished documents' records (any order): one row
    per (task, method, budget), a percentile-bootstrap 95% interval over documents (paired: the
    same resampled documents for every configuration)."""
    records = sorted(records, key=lambda r: r["context"])
    n = len(records)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    keys = list(dict.fromkeys(k for r in records for k in r["entries"]))
    rows = []
    for key in keys:
        method, _, budget = key.partition("@")
        budget = int(budget) if budget else None
        es = [r["entries"][key] for r in records]
        base = dict(method=method, budget=budget, n_docs=n)
        if all("kept_nbytes" in e for e in es):  # at the stream's end
            base["kv_kept_bytes_end"] = float(np.mean([e["kept_nbytes"] for e in es]))
        if all(e.get("nll") for e in es) and method != "full":
            s, b = boot([e["nll"][2] - e["nll"][0] for e in es], [e["nll"][1] for e in es], idx)
            rows.append(dict(base, task="nll", score=finite(np.exp(s)), ci=ci(np.exp(b)),
                             increase=finite(-s), n=int(sum(e["nll"][1] for e in es))))
        elif method == "cut":
            rows.append(dict(base, task="nll", score=None, ci=None, n=0))
        probes = [[p for p in e["probes"]] for e in es]
        gaps = sorted({p[0] for ps in probes for p in ps})
        for gap in [None] + gaps:
            sel = [[p for p in ps if gap is None or p[0] == gap] for ps in probes]
            tok_s, tok_b = boot([sum(p[2] for p in ps) for ps in sel],
                                [sum(p[1] for p in ps) for ps in sel], idx)
            ex_s, ex_b = boot([sum(p[2] == p[1] for p in ps) for ps in sel],
                              [len(ps) for ps in sel], idx)
            row = dict(base, task="recall", gap=gap, score=finite(tok_s), ci=ci(tok_b),
                       exact=finite(ex_s), exact_ci=ci(ex_b), n=sum(len(ps) for ps in sel))
            if all(p[3] is not None for ps in sel for p in ps):
                s, b = boot([sum(p[3] for p in ps) for ps in sel],
                            [sum(p[1] for p in ps) for ps in sel], idx)
                f, fb = boot([sum(p[4] for p in ps) for ps in sel],
                             [sum(p[1] for p in ps) for ps in sel], idx)
                row.update(nll=finite(s), nll_ci=ci(b), nll_full=finite(f),
                           nll_ratio=finite(np.exp(f - s)), nll_ratio_ci=ci(np.exp(fb - b)))
            rows.append(row)
        gens = [e["gen"] for e in es if e.get("gen")]
        if gens:
            g_idx = np.random.default_rng(seed).integers(0, len(gens), size=(n_boot, len(gens)))
            first = np.array([g["first_diff"] for g in gens], float)
            same = np.array([g["same"] for g in gens], float)
            correct = np.array([g["correct"] for g in gens], float)
            rows.append(dict(base, task="generation", n=len(gens),
                             first_diff=float(np.median(first)),
                             first_diff_mean=float(first.mean()),
                             first_diff_ci=ci(first[g_idx].mean(-1)), same=float(same.mean()),
                             same_ci=ci(same[g_idx].mean(-1)), correct=float(correct.mean()),
                             correct_ci=ci(correct[g_idx].mean(-1))))
    return dict(rows=rows, n_contexts=n,
                generations=[dict(doc=r["doc"], **r["generation"]) for r in records
                             if r.get("generation")])


# ---- 3. results.md and decode.png ----------------------------------------------------------------

def markdown(results):
    """The decode sections of results.md (lines)."""
    rows, out = results.get("rows", []), []
    get = lambda task, **kw: [r for r in rows if r["task"] == task
                              and all(r.get(k) == v for k, v in kw.items())]
    configs = list(dict.fromkeys((r["method"], r["budget"]) for r in rows))
    gaps = sorted({r["gap"] for r in get("recall") if r["gap"] is not None}) or [0]
    if rows:
        out += ["## Long-text modelling and recall (teacher-forced decode steps)", "",
                f"{results['n_contexts']} documents. nll: exp(NLL_full − NLL) over the document "
                "tokens at positions ≥ the budget (1 = lossless, higher is better). recall: "
                "accuracy of the answer tokens (argmax) of facts asked again "
                f"{min(gaps)}–{max(gaps)} tokens after they were stated; exact = every token of "
                "the answer right; recall NLL ratio as nll. [95% bootstrap interval over "
                "documents.] cut: the full cache stopped at the "
                "budget (it never reaches a token past it: n/a, or a wrong answer).", "",
                "| method | budget | nll ratio | recall tokens | recall exact | recall NLL ratio |",
                "|---|---|---|---|---|---|"]
        for m, b in configs:
            nll = get("nll", method=m, budget=b)
            rec = get("recall", method=m, budget=b, gap=None)[0]
            out.append(f"| {m} | {b or '–'} | "
                       f"{fmt_ci(nll[0]['score'], nll[0]['ci']) if nll else '1 (reference)'} | "
                       f"{fmt_ci(rec['score'], rec['ci'])} | "
                       f"{fmt_ci(rec['exact'], rec['exact_ci'])} | "
                       f"{fmt_ci(rec.get('nll_ratio'), rec.get('nll_ratio_ci'))} |")
        out += ["", "### Recall by distance (answer-token accuracy)", "",
                "| method | budget | " + " | ".join(f"gap {g}" for g in gaps) + " |",
                "|---|---|" + "---|" * len(gaps)]
        for m, b in configs:
            out.append(f"| {m} | {b or '–'} | " + " | ".join(
                fmt_ci(r["score"], r["ci"]) for g in gaps
                for r in get("recall", method=m, budget=b, gap=g)) + " |")
        gens = get("generation")
        if gens:
            out += ["", "### Free generation (greedy)", "",
                    f"{gens[0]['n']} generations. first difference: tokens generated before the "
                    "first token that differs from the full cache's (median; mean [95% CI]); same "
                    "answer: the final answer equals the full cache's token for token; correct: "
                    "it holds the fact stated in the prompt.", "",
                    "| method | budget | first difference (median) | mean | same answer | "
                    "correct |", "|---|---|---|---|---|---|"]
            for r in gens:
                out.append(f"| {r['method']} | {r['budget'] or '–'} | {r['first_diff']:.0f} | "
                           f"{fmt_ci(r['first_diff_mean'], r['first_diff_ci'], '{:.0f}')} | "
                           f"{fmt_ci(r['same'], r['same_ci'])} | "
                           f"{fmt_ci(r['correct'], r['correct_ci'])} |")
    speed = results.get("decode_speed") or []
    if speed:
        out += ["", "## Decode speed and KV memory over one long generation", "",
                "ms per decoded token: the mean of the 256 steps before the length; KV: bytes "
                "allocated (kept) by the cache at that length, every layer; scorer share: the "
                "scorer's part of those steps (timed by wrapping its methods). transformers: its "
                "generate with a DynamicCache, the same checkpoint, greedy.", "",
                "| method | budget | length | ms/token | KV allocated MiB | KV kept MiB | "
                "scorer share |", "|---|---|---|---|---|---|---|"]
        mib = lambda x: "–" if x is None else f"{x / 2**20:.1f}"
        for r in speed:
            share = "–" if r["score_share"] is None else f"{r['score_share']:.2%}"
            out.append(f"| {r['method']} | {r['budget'] or '–'} | {r['length']} | "
                       f"{r['ms_per_token']:.1f} | {mib(r['kv_bytes'])} | "
                       f"{mib(r['kv_kept_bytes'])} | {share} |")
    return out


def plot(results, path):
    """NLL ratio and recall against the budget, one line per method (when the quality section ran);
    with speed rows, ms/token and the KV bytes allocated (solid) and kept (dashed) against the
    generated length."""
    plt = pyplot()
    if plt is None:
        return
    rows, speed = results.get("rows", []), results.get("decode_speed") or []
    n = 2 * bool(rows) + 2 * bool(speed)
    if not n:
        return
    fig, axes = plt.subplots(1, n, figsize=(4.75 * n, 4), squeeze=False)
    axes = list(axes[0])
    if rows:
        quality_panels(rows, axes[:2])
    if speed:
        speed_panels(speed, axes[-2:])
    fig.tight_layout()
    save_figure(fig, path)


def quality_panels(rows, axes):
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for ax, task, title in ((axes[0], "nll", "NLL ratio past the budget (1 = full)"),
                            (axes[1], "recall", "recall: answer tokens right")):
        for m in dict.fromkeys(r["method"] for r in rows if r["budget"] is not None):
            rs = sorted((r for r in rows if r["task"] == task and r["method"] == m
                         and r.get("gap") is None and r["score"] is not None
                         and r["budget"] is not None), key=lambda r: r["budget"])
            if not rs:
                continue
            y = [r["score"] for r in rs]
            err = [[abs(v - r["ci"][i]) if r["ci"] else 0 for v, r in zip(y, rs)]
                   for i in (0, 1)]
            ax.errorbar([r["budget"] for r in rs], y, yerr=err, marker="o", capsize=2, label=m)
        full = [r for r in rows if r["task"] == task and r["method"] == "full"
                and r.get("gap") is None]
        ax.axhline(full[0]["score"] if full and task == "recall" else 1.0, color="grey", ls="--",
                   lw=1, label="full cache")
        ax.set(xscale="log", xlabel="decode budget (tokens per KV head)", title=title)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.legend(fontsize=7)


def speed_panels(speed, axes):
    for c in dict.fromkeys((r["method"], r["budget"]) for r in speed):
        rs = [r for r in speed if (r["method"], r["budget"]) == c]
        name, x = c[0] + (f"@{c[1]}" if c[1] else ""), [r["length"] for r in rs]
        line = axes[0].plot(x, [r["ms_per_token"] for r in rs], marker="o", label=name)[0]
        axes[1].plot(x, [(r["kv_bytes"] or 0) / 2**20 for r in rs], marker="o", label=name,
                     color=line.get_color())
        axes[1].plot(x, [(r["kv_kept_bytes"] or 0) / 2**20 for r in rs], ls="--",
                     color=line.get_color())
    lengths = sorted({r["length"] for r in speed})
    for ax, ylabel, title in ((axes[0], "ms per token", "decode speed"),
                              (axes[1], "KV MiB (dashed: kept)", "KV memory")):
        ax.set(xscale="log", xlabel="generated length (positions)", ylabel=ylabel, title=title)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.legend(fontsize=7)


# ---- 4. bench.py --suite decode: its flags, checks and run ---------------------------------------

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


def check_args(p, args):
    """--suite decode's flags on their own, before anything loads (p.error: exit 2)."""
    bad = [m for m in args.methods if m not in decode.METHODS]
    if bad:
        p.error(f"--suite decode: unknown method {bad}: methods are {','.join(decode.METHODS)}")
    args.methods = list(dict.fromkeys(args.methods))
    if not args.decode_budgets:
        p.error("--decode-budgets is empty: give tokens per KV head, e.g. 256,512")
    if len(args.lengths) != 1:
        p.error(f"--suite decode: --lengths takes one stream length, got {args.lengths}")
    if args.decode_generations is None:
        args.decode_generations = args.contexts
    if args.decode_gen_budgets is None:
        args.decode_gen_budgets = list(args.decode_budgets)
    if not set(args.decode_gen_budgets) <= set(args.decode_budgets):
        p.error(f"--decode-gen-budgets {','.join(map(str, args.decode_gen_budgets))}: each must "
                f"be one of --decode-budgets ({','.join(map(str, args.decode_budgets))})")
    for flag, low in (("contexts", 1), ("decode_prompt", 1), ("decode_generations", 0),
                      ("decode_gen_tokens", 1), ("bootstrap", 1)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    need = args.decode_prompt + decode.FACT_START + decode.FACT_STEP * len(args.decode_gaps) \
        + max(args.decode_gaps, default=0) + decode.SENTENCE_WAIT
    if args.decode_gaps and args.lengths[0] < need:
        p.error(f"--lengths {args.lengths[0]}: too short for --decode-gaps "
                f"{','.join(map(str, args.decode_gaps))} (the facts, the longest gap and room "
                f"for sentence ends need {need}); lengthen it or shorten the gaps")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device {args.device}: cpu, cuda or cuda:N")
    if not args.no_quality and args.shard[0] >= args.contexts:
        p.error(f"--shard {args.shard[0]}/{args.shard[1]}: the run has {args.contexts} documents, "
                f"shard {args.shard[0]} holds none")


def experiment(args):
    return decode.DecodeExperiment(
        methods=args.methods, budgets=args.decode_budgets, contexts=args.contexts,
        length=args.lengths[0], gaps=args.decode_gaps, prompt_tokens=args.decode_prompt,
        generations=args.decode_generations, gen_tokens=args.decode_gen_tokens,
        gen_budgets=args.decode_gen_budgets, seed=args.seed,
        chat=args.chat, device=args.device)


def check_fit(args, cfg):
    """Every sequence the run makes against the model's positions, before anything heavy."""
    n = cfg.max_position_embeddings
    # the free generation's prompt: ~160 excerpt tokens and the fact, in its chat turn (< 400)
    for flag, need in (("--lengths", args.lengths[0]),
                       ("--speed-lengths", max(args.speed_lengths, default=0)),
                       ("--decode-gen-tokens", args.decode_gen_tokens + 400 + decode.ANSWER_TOKENS
                        if args.decode_generations else 0)):
        if need > n:
            raise UsageError(f"{flag}: {need} positions, more than the model's {n}; use shorter "
                             "sequences")


def bench_run(args, root, folder, cfg, tok, gates, claim):
    """bench.py --suite decode after its cheap checks: the quality documents (resumable: each
    finished document is kept in --out/contexts/ at once), then the speed section; results.json,
    results.md and (--plot) decode.png in --out (default root/results/<timestamp>), which
    claim(path) makes and holds for the run (bench.py's: a folder of other files is refused)."""
    t_start = time.perf_counter()
    check_fit(args, cfg)
    out = Path(args.out or Path(root) / "results" / time.strftime("%Y%m%d-%H%M%S"))
    claim(out)
    args.out_dir = str(out)  # what an interrupted run keeps (bench.kept)
    exp = experiment(args)
    config = run_config(vars(args), folder, gates)
    key = config["quality_key"] = decode.run_key(exp, config)
    config["speed_key"] = dict(lengths=args.speed_lengths, budgets=args.decode_speed_budgets,
                               model=config["model"]["sha256"], gate=config["gate"]["sha256"],
                               threads=args.threads, device=args.device)
    done = load_records(out, key, key["contexts"])
    write_text(out / "config.json", json.dumps(config, indent=1))
    device = torch.device(args.device)
    model = load_checked(folder, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    for m in (m for m in exp.methods if m not in ("full", "cut")):  # before any work
        try:
            decode.decode_cache(model, m, 0, exp.budgets[0], gates, 0)
        except (ValueError, AssertionError) as e:
            raise UsageError(f"--methods {m}: this version cannot evict it during decoding ({e}); "
                             "leave it out of --methods") from None
    records, res = list(done.values()), dict(config=config, complete=False)
    old = out / "results.json"
    if old.exists() and not args.speed_lengths:  # keep an earlier run's speed rows
        prev = previous(old, "delete it (its speed rows are lost)")
        if prev.get("decode_speed") and (prev.get("config") or {}).get("speed_key") == \
                config["speed_key"]:
            res["decode_speed"] = prev["decode_speed"]

    def save():
        res["seconds"] = time.perf_counter() - t_start + sum(r["seconds"] for r in done.values())
        if records:
            res.update(results(records, args.bootstrap, args.seed))
        write_text(out / "results.json", json.dumps(res, indent=1))
        write_text(out / "results.md", "\n".join(header(res) + markdown(res)) + "\n")

    def finished(record):
        write_record(out, key, record)
        records.append(record)
        save()
    log(f"decode suite: model {folder}, gate {gates.meta.get('source')}; writing {out}"
        + (f"; resuming after {len(done)} finished documents" if done else ""))
    if not args.no_quality:
        decode.run(model, tok, exp, args.model, args.gate, args.shard, done, on_context=finished)
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


def previous(path, fix):
    """A run folder's results.json, or one line saying it is damaged and what to do (fix)."""
    try:
        prev = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        raise UsageError(f"{path} is unreadable; {fix}") from None
    if not isinstance(prev, dict) or not isinstance(prev.get("decode_speed") or [], list):
        raise UsageError(f"{path} is not a decode result; {fix}")
    return prev


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
        for c, rec in load_records(f, keys[0], keys[0]["contexts"],
                                   f"leave {f} out of --merge").items():
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
    try:
        write_text(out / "results.json", json.dumps(res, indent=1))
        write_text(out / "results.md", "\n".join(header(res) + markdown(res)) + "\n")
        write_text(out / "config.json", json.dumps(res["config"], indent=1))
    except cli.WriteError:  # a full disk: a folder made for this merge is not left empty
        cli.drop_folder(out, created)
        raise
    if draw:
        plot(res, out / "decode.png")
    log(f"merged {len(records)} documents from {len(folders)} runs -> {out}/results.md")


def header(res):
    """results.md's first lines: what ran (a --no-quality run: its speed section alone)."""
    cfg = res["config"]
    f, key = cfg["flags"], cfg["quality_key"]
    ran = (f"Model `{f['model']}`, gate `{shown(cfg['gate']['source'])}` (sha256 "
           f"{str(cfg['gate']['sha256'])[:12]}), commit {cfg['git_commit'][:10]}"
           f"{' (dirty)' if cfg['git_dirty'] else ''}. ")
    if f.get("no_quality"):
        speed = cfg.get("speed_key") or {}
        ran += (f"Speed and memory only (--no-quality): one greedy generation from a "
                f"{key['prompt_tokens']}-token prompt (an Austen chapter) to lengths "
                f"{speed.get('lengths')}, the full cache and budgets {speed.get('budgets')} "
                f"tokens per KV head")
    else:
        ran += (f"{res.get('n_contexts', 0)} of {key['contexts']} documents (held-out Austen "
                f"chapters) of {key['length']} tokens: {key['prompt_tokens']} prefilled, every "
                f"later token a decode step (128 per forward, aligned with the decode buffer); "
                f"budgets {key['budgets']} tokens per KV head; recall gaps {key['gaps']}; "
                f"{key['generations']} free generations of {key['gen_tokens']} tokens; seed "
                f"{key['seed']}")
    return [f"# Fast KVzip decode suite ({cfg['started']})", "",
            ran + f". Run time {res.get('seconds', 0) / 60:.1f} min"
            + ("." if res.get("complete") else " (not complete: rerun the command to resume)."),
            ""]
