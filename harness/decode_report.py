"""
The decode suite's report: results rows with 95% intervals over documents, the gate against each
method paired by document, results.md, decode.png (quality against budget, ms/token against
length). The runs are harness/decode.py's (the quality documents) and harness/decode_suite.py's
(bench.py --suite decode: the run, the speed section, the merge).

Intervals: a handful of documents is the usual run, and a percentile bootstrap over 4 or 5 of them
under-covers, so every interval is a Student-t interval over documents (n - 1 degrees of freedom):
of a mean for per-document values, of a ratio of sums with its linearized (delta-method) standard
error. Where n >= 20 the percentile bootstrap is kept beside it (ci_boot in results.json).
"""
import math

import numpy as np

from cli import pyplot, save_figure
from harness import closed_loop, decode_config
from harness.quality import TEXT_NAMES, ci
from harness.quality_report import fmt_ci
from harness.report import shown
from harness.stats import t_quantile

GATE = "fastkvzip"  # the method every other is compared with, document by document
BOOT_MIN = 20  # documents from which the bootstrap interval is kept beside the t-interval

# ---- 1. Intervals over documents ----------------------------------------------------------------

def t_interval(center, se, n):
    """center ± t_{0.975, n-1} · se; None below 2 documents (no spread to measure)."""
    if n < 2 or se is None or not np.isfinite(se):
        return None
    h = t_quantile(0.975, n - 1) * se
    return [float(center - h), float(center + h)]


def mean_ci(values):
    """The mean of per-document values and its t-interval."""
    x = np.asarray(values, float)
    n = len(x)
    return float(x.mean()), t_interval(x.mean(), x.std(ddof=1) / math.sqrt(n) if n > 1 else None,
                                       n)


def ratio_ci(num, den):
    """Σnum / Σden over documents and its t-interval, the standard error linearized (the ratio
    estimator's: the spread of num_d - R·den_d over documents, divided by the mean den); (None,
    None) when no document has a denominator."""
    y, x = np.asarray(num, float), np.asarray(den, float)
    n = len(x)
    if x.sum() == 0:
        return None, None
    r = y.sum() / x.sum()
    se = np.std(y - r * x, ddof=1) / math.sqrt(n) / x.mean() if n > 1 else None
    return float(r), t_interval(r, se, n)


def boot(num, den, idx):
    """A ratio of sums' percentile-bootstrap interval over documents (idx: (n_boot, n_docs))."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return ci(num[idx].sum(-1) / den[idx].sum(-1))


def finite(x):
    x = None if x is None else float(x)
    return x if x is not None and np.isfinite(x) else None


def exp_ci(c):
    return [float(np.exp(v)) for v in c] if c else None


def clip01(c):
    return [min(1.0, max(0.0, v)) for v in c] if c else None


# ---- 2. Summary: rows with intervals over documents ----------------------------------------------

def probe_sums(es, gap=None):
    """Per document, over its probes (at `gap`, or all): answer tokens, argmax hits, exact answers,
    probes, NLL sum, the full cache's NLL sum (None where a probe has no NLL)."""
    out = []
    for e in es:
        ps = [p for p in e["probes"] if gap is None or p[0] == gap]
        has_nll = all(p[3] is not None for p in ps)
        out.append(dict(tokens=sum(p[1] for p in ps), hits=sum(p[2] for p in ps),
                        exact=sum(p[2] == p[1] for p in ps), probes=len(ps),
                        nll=sum(p[3] for p in ps) if has_nll else None,
                        nll_full=sum(p[4] for p in ps)))
    return out


def row_key(key):
    """A record's entry key -> (row label, budget): "full", "rkv@512", "rkv@global/w128@512" (a
    configuration's name may hold an @ itself: the budget is the last one)."""
    name, at, budget = key.rpartition("@")
    return (name, int(budget)) if at and budget.isdigit() else (key, None)


def results(records, n_boot, seed):
    """The decode part of results.json from the finished documents' records (any order): one row
    per (task, method, budget) with its t-interval over documents (and, from BOOT_MIN documents,
    the percentile bootstrap beside it: the same resampled documents for every configuration); the
    gate against every other method paired by document (paired()); the commits the documents ran
    at (provenance())."""
    records = sorted(records, key=lambda r: r["context"])
    n = len(records)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n)) if n >= BOOT_MIN else None
    keys = list(dict.fromkeys(k for r in records for k in r["entries"]))
    rows = []
    for key in keys:
        method, budget = row_key(key)
        es = [r["entries"][key] for r in records]
        base = dict(method=method, budget=budget, n_docs=n)
        if all("kept_nbytes" in e for e in es):  # at the stream's end
            base["kv_kept_bytes_end"] = float(np.mean([e["kept_nbytes"] for e in es]))
        if all(e.get("nll") for e in es) and method != "full":
            num, den = [e["nll"][2] - e["nll"][0] for e in es], [e["nll"][1] for e in es]
            s, c = ratio_ci(num, den)
            row = dict(base, task="nll", score=finite(np.exp(s)), ci=exp_ci(c),
                       increase=finite(-s), n=int(sum(den)))
            if idx is not None:
                row["ci_boot"] = exp_ci(boot(num, den, idx))
            rows.append(row)
        elif method == "cut":  # it never reaches a token past its budget
            rows.append(dict(base, task="nll", score=None, ci=None, n=0))
        gaps = sorted({p[0] for e in es for p in e["probes"]})
        for gap in [None] + gaps:
            ds = probe_sums(es, gap)
            tok, tok_ci = ratio_ci([d["hits"] for d in ds], [d["tokens"] for d in ds])
            ex, ex_ci = ratio_ci([d["exact"] for d in ds], [d["probes"] for d in ds])
            row = dict(base, task="recall", gap=gap, score=finite(tok), ci=clip01(tok_ci),
                       exact=finite(ex), exact_ci=clip01(ex_ci), n=sum(d["probes"] for d in ds))
            if idx is not None:
                row["ci_boot"] = boot([d["hits"] for d in ds], [d["tokens"] for d in ds], idx)
            if all(d["nll"] is not None for d in ds):
                s, s_ci = ratio_ci([d["nll"] for d in ds], [d["tokens"] for d in ds])
                f, _ = ratio_ci([d["nll_full"] for d in ds], [d["tokens"] for d in ds])
                gain, gain_ci = ratio_ci([d["nll_full"] - d["nll"] for d in ds],
                                         [d["tokens"] for d in ds])
                row.update(nll=finite(s), nll_ci=s_ci, nll_full=finite(f),
                           nll_ratio=finite(np.exp(gain)), nll_ratio_ci=exp_ci(gain_ci))
            rows.append(row)
        gens = [e["gen"] for e in es if e.get("gen")]
        if gens:
            first, first_ci = mean_ci([g["first_diff"] for g in gens])
            first_ci = first_ci and [max(0.0, first_ci[0]), first_ci[1]]  # a count: never < 0
            same, same_ci = mean_ci([float(g["same"]) for g in gens])
            correct, correct_ci = mean_ci([float(g["correct"]) for g in gens])
            rows.append(dict(base, task="generation", n=len(gens),
                             first_diff=float(np.median([g["first_diff"] for g in gens])),
                             first_diff_mean=first, first_diff_ci=first_ci, same=same,
                             same_ci=clip01(same_ci), correct=correct,
                             correct_ci=clip01(correct_ci)))
    rows += loop_rows(records)
    return dict(rows=rows, n_contexts=n, paired=paired(records, n_boot, seed),
                interval=dict(kind="t", n=n, level=0.95, bootstrap=n >= BOOT_MIN),
                provenance=provenance(records),
                generations=[dict(doc=r["doc"], **r["generation"]) for r in records
                             if r.get("generation")])


def per_document(e, task):
    """One entry's value on its document: the NLL ratio exp(NLL_full - NLL) over its tokens, or
    the recall (answer tokens right); None where it has none."""
    if task == "nll":
        return math.exp((e["nll"][2] - e["nll"][0]) / e["nll"][1]) if e.get("nll") \
            and e["nll"][1] else None
    tokens = sum(p[1] for p in e["probes"])
    return sum(p[2] for p in e["probes"]) / tokens if tokens else None


def verdict(c):
    """A paired interval of the gate minus a method: a tie when it holds 0 (or there is none)."""
    return "tie" if not c or c[0] <= 0 <= c[1] else "gate better" if c[0] > 0 else "gate worse"


def paired(records, n_boot, seed):
    """For every budget and every method beside the gate: per document, the gate's value minus the
    method's (nll ratio, recall), their mean and t-interval over the documents where both have
    one, and the verdict (tie when the interval holds 0); the bootstrap beside it from BOOT_MIN
    documents."""
    keys = list(dict.fromkeys(k for r in records for k in r["entries"]))
    out = []
    for key in keys:
        method, budget = row_key(key)
        if method in ("full", GATE) or budget is None or f"{GATE}@{budget}" not in keys:
            continue
        for task in ("nll", "recall"):
            diffs = []
            for r in records:
                g, m = (r["entries"].get(k) for k in (f"{GATE}@{budget}", key))
                a, b = (per_document(e, task) if e else None for e in (g, m))
                if a is not None and b is not None:
                    diffs.append(a - b)
            if not diffs:
                continue
            mean, c = mean_ci(diffs)
            row = dict(budget=budget, method=method, task=task, n=len(diffs), diff=mean,
                       ci=c, verdict=verdict(c))
            if len(diffs) >= BOOT_MIN:
                d = np.asarray(diffs)
                idx = np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))
                row["ci_boot"] = ci(d[idx].mean(-1))
            out.append(row)
    return out


def provenance(records):
    """The commits the documents ran at, in order of first use: [{commit, dirty, documents}];
    commit None for records written before the suite kept it ("unrecorded")."""
    seen = {}
    for r in records:
        p = r.get("provenance") or {}
        k = (p.get("git_commit"), p.get("git_dirty"))
        seen[k] = seen.get(k, 0) + 1
    return [dict(commit=c, dirty=d, documents=n) for (c, d), n in seen.items()]


def wilson(k, n, z=1.96):
    """Wilson score interval of k successes in n trials (95% at z = 1.96); None for n = 0."""
    if n == 0:
        return None
    p, z2 = k / n, z * z
    mid, half = (p + z2 / (2 * n)), z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return [float((mid - half) / (1 + z2 / n)), float((mid + half) / (1 + z2 / n))]


def loop_rows(records):
    """The closed loop's rows (harness/closed_loop.py), one per configuration that ran it: its
    samples, the invalid ones (a code repeated in the list: never asked), the items asked and
    answered right, accuracy with a Wilson 95% interval over the items asked (seeds x items, taken
    as independent), the accuracy of a guess among the list's codes (chance), the share of answers
    that name some code of the list, right or not (in list: the list was still there to read) and
    the share of codes the story wrote out again."""
    samples = {}
    for r in sorted(records, key=lambda r: r["context"]):
        for key, e in r["entries"].items():
            samples.setdefault(key, []).extend(e.get("loop") or [])
    rows = []
    for key, xs in samples.items():
        if not xs:
            continue
        method, _, budget = key.partition("@")
        valid = [x for x in xs if x["valid"]]
        right = sum(sum(x["right"]) for x in valid)
        asked = sum(len(x["right"]) for x in valid)
        restated = [r for x in valid for r in x.get("restated", [])]
        listed = [closed_loop.parse_answer(a) in x["codes"] for x in valid
                  for a in x.get("answers", [])]
        # a guess of a code from the list: each item's code is that share of its list
        chance = [x["codes"].count(c) / len(x["codes"]) for x in valid for c in x["codes"]]
        rows.append(dict(task="loop", method=method, budget=int(budget) if budget else None,
                         samples=len(xs), invalid=len(xs) - len(valid), n=asked, right=right,
                         score=right / asked if asked else None, ci=wilson(right, asked),
                         chance=float(np.mean(chance)) if chance else None,
                         listed=float(np.mean(listed)) if listed else None,
                         restated=float(np.mean(restated)) if restated else None))
    return rows


def loop_markdown(rows):
    """results.md's closed-loop table (lines), [] when it did not run."""
    rows = [r for r in rows if r["task"] == "loop"]
    if not rows:
        return []
    out = ["", "## Closed loop: the model's own codes, asked after its own story", "",
           "Each sample: the model writes a list of codes (the harness writes each line's "
           "words, the model samples its four digits), then a story, then is asked for every "
           "code (harness/closed_loop.py); right = its answer's number is the code it wrote. "
           "invalid: samples whose list repeats a code (not asked). accuracy: right / asked "
           "[Wilson 95% interval over the items asked, seeds x items taken as independent]. "
           "chance: the accuracy of answering a code drawn from the item's list. in list: the "
           "share of answers that name a code of the list, right or not. restated: the share "
           "of codes the story wrote out again. cut: the "
           "full cache, its story stopped where the questions and answers still fit in the "
           "budget, then asked (the authors' forced answer, METHOD.md §11).", "",
           "| method | budget | samples | invalid | asked | right | accuracy | chance | "
           "in list | restated |", "|---|---|---|---|---|---|---|---|---|---|"]
    share = lambda x: "–" if x is None else f"{x:.2f}"
    for r in rows:
        out.append(f"| {r['method']} | {r['budget'] or '–'} | {r['samples']} | {r['invalid']} | "
                   f"{r['n']} | {r['right']} | {fmt_ci(r['score'], r['ci'])} | "
                   f"{share(r['chance'])} | {share(r['listed'])} | {share(r['restated'])} |")
    return out


# ---- 2. results.md and decode.png ----------------------------------------------------------------

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
                f"the answer right; recall NLL ratio as nll. {interval_note(results)} "
                + ("cut: the full cache held to the budget, a question past it asked at the "
                   "budget instead (harness/decode.py; no token past the budget, so no nll)."
                   if results.get("interval") else  # a run from before cut was run, as it said
                   "cut: the full cache stopped at the budget (it never reaches a token past it: "
                   "n/a, or a wrong answer)."), "",
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
        named = described(dict.fromkeys(m for m, _ in configs))
        if named:
            out += ["", "Rows that are configurations (a method at another level or window, or "
                    "the static split of heads: harness/decode_config.py):", ""]
            out += [f"- {line}" for line in named]
        out += ["", "### Recall by distance (answer-token accuracy)", "",
                "| method | budget | " + " | ".join(f"gap {g}" for g in gaps) + " |",
                "|---|---|" + "---|" * len(gaps)]
        for m, b in configs:
            out.append(f"| {m} | {b or '–'} | " + " | ".join(
                fmt_ci(r["score"], r["ci"]) for g in gaps
                for r in get("recall", method=m, budget=b, gap=g)) + " |")
        out += paired_markdown(results)
        gens = get("generation")
        if gens:
            out += ["", "### Free generation (greedy)", "",
                    f"{gens[0]['n']} generations. first difference: tokens generated before the "
                    "first token that differs from the full cache's (median; mean [95% CI]); same "
                    "answer: the final answer equals the full cache's token for token; correct: "
                    "it holds the fact stated in the prompt." + (
                        " cut stops its generation where the question must be asked to fit the "
                        "budget: its first difference is where it stopped."
                        if results.get("interval") else ""), "",
                    "| method | budget | first difference (median) | mean | same answer | "
                    "correct |", "|---|---|---|---|---|---|"]
            for r in gens:
                out.append(f"| {r['method']} | {r['budget'] or '–'} | {r['first_diff']:.0f} | "
                           f"{fmt_ci(r['first_diff_mean'], r['first_diff_ci'], '{:.0f}')} | "
                           f"{fmt_ci(r['same'], r['same_ci'])} | "
                           f"{fmt_ci(r['correct'], r['correct_ci'])} |")
    out += loop_markdown(rows)
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


def interval_note(results):
    """Which interval the tables show, over how many documents."""
    iv = results.get("interval")
    if not iv:  # a results.json written before the t-intervals
        return "[95% bootstrap interval over documents.]"
    n = iv["n"]
    return (f"[95% Student-t interval over the n = {n} documents ({n - 1} degrees of freedom; "
            "a ratio of sums with its linearized standard error)"
            + ("; the percentile bootstrap beside it in results.json (ci_boot)" if iv["bootstrap"]
               else "") + (": one document has no interval" if n < 2 else "") + ".]")


def paired_markdown(results):
    """The gate against each method at each budget, paired by document (lines)."""
    rows = results.get("paired")
    if not rows:
        return []
    fmt = lambda r: "n/a" if r is None else (
        f"{r['diff']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] {r['verdict']}" if r["ci"]
        else f"{r['diff']:+.3f} (n = {r['n']}: no interval) {r['verdict']}")
    out = ["", f"### The gate ({GATE}) against each method, paired by document", "",
           "Per document, the gate's value minus the method's at the same budget (nll ratio: "
           "exp(NLL_full − NLL) of the document; recall: its answer tokens right); the mean of "
           f"the n = {max(r['n'] for r in rows)} differences and its 95% Student-t interval (n − 1 "
           "degrees of freedom). gate better / gate worse: the interval lies above / below 0; "
           "tie: it holds 0.", "",
           "| budget | method | nll ratio: gate − method | recall: gate − method |", "|---|---|---|---|"]
    for b, m in dict.fromkeys((r["budget"], r["method"]) for r in rows):
        cell = lambda task: fmt(next((r for r in rows if (r["budget"], r["method"], r["task"])
                                      == (b, m, task)), None))
        out.append(f"| {b} | {m} | {cell('nll')} | {cell('recall')} |")
    return out


def described(labels):
    """What each row label that is not a method at its own level and window ran, or the split."""
    out = []
    for m in labels:
        try:
            c = decode_config.parse(m)
        except ValueError:  # a label this version does not know: shown as it is
            continue
        if c.name != c.method or c.method in decode_config.SPLIT:
            out.append(decode_config.describe(c))
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

def header(res):
    """results.md's first lines: what ran (a --no-quality run: its speed section alone)."""
    cfg = res["config"]
    f, key = cfg["flags"], cfg["quality_key"]
    ran = (f"Model `{f['model']}`, gate `{shown(cfg['gate']['source'])}` (sha256 "
           f"{str(cfg['gate']['sha256'])[:12]}), {commits(res)}. ")
    if f.get("no_quality"):
        speed = cfg.get("speed_key") or {}
        ran += (f"Speed and memory only (--no-quality): one greedy generation from a "
                f"{key['prompt_tokens']}-token prompt (an Austen chapter) to lengths "
                f"{speed.get('lengths')}, the full cache and budgets {speed.get('budgets')} "
                f"tokens per KV head")
    else:
        docs = TEXT_NAMES[key.get("text", "austen")]
        ran += (f"{res.get('n_contexts', 0)} of {key['contexts']} documents (held-out {docs}) of "
                f"{key['length']} tokens: {key['prompt_tokens']} prefilled, every "
                f"later token a decode step (128 per forward, aligned with the decode buffer); "
                f"budgets {key['budgets']} tokens per KV head; recall gaps {key['gaps']}; "
                f"{key['generations']} free generations of {key['gen_tokens']} tokens; seed "
                f"{key['seed']}")
        if key.get("loop"):
            loop = key["loop"]
            ran += (f"; closed loop: {loop['seeds']} samples of {loop['items']} codes and "
                    f"{loop['tokens']}-token stories (temperature {loop['temperature']}, top-p "
                    f"{loop['top_p']}) at budgets {loop['budgets']}")
    return [f"# Fast KVzip decode suite ({cfg['started']})", "",
            ran + f". Run time {res.get('seconds', 0) / 60:.1f} min"
            + ("." if res.get("complete") else " (not complete: rerun the command to resume)."),
            ""]


def commits(res):
    """The commits a result's documents ran at ("unrecorded" for records written before each kept
    its own); a speed-only run, or a results.json written before, names config.json's commit."""
    cfg, prov = res["config"], res.get("provenance")
    one = lambda c, dirty: f"{c[:10]}{' (dirty)' if dirty else ''}"
    if not prov:
        return (f"commit {one(cfg['git_commit'], cfg['git_dirty'])}"
                + ("" if cfg["flags"].get("no_quality") else
                   " (the run's last start: which commit ran each document was not recorded)"))
    return "documents run at " + ", ".join(
        f"{'unrecorded commit' if p['commit'] is None else 'commit ' + one(p['commit'], p['dirty'])}"
        f" ({p['documents']} document{'s' if p['documents'] != 1 else ''})" for p in prov)
