"""
The decode suite's report: results rows with 95% intervals over documents, results.md, decode.png
(quality against budget, ms/token against length). The runs are harness/decode.py's (the quality
documents) and harness/decode_suite.py's (bench.py --suite decode: the run, the speed section, the
merge).
"""
import numpy as np

from cli import pyplot, save_figure
from harness import decode_config
from harness.quality import ci
from harness.quality_report import fmt_ci
from harness.report import shown

# ---- 1. Summary: rows with intervals over documents ----------------------------------------------

def boot(num, den, idx):
    """Ratio of sums, and its bootstrap values over documents (idx: (n_boot, n_docs))."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return num.sum() / den.sum(), num[idx].sum(-1) / den[idx].sum(-1)


def finite(x):
    x = float(x)
    return x if np.isfinite(x) else None


def row_key(key):
    """A record's entry key -> (row label, budget): "full", "rkv@512", "rkv@global/w128@512" (a
    configuration's name may hold an @ itself: the budget is the last one)."""
    name, at, budget = key.rpartition("@")
    return (name, int(budget)) if at and budget.isdigit() else (key, None)


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
        method, budget = row_key(key)
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
    rows += loop_rows(records)
    return dict(rows=rows, n_contexts=n,
                generations=[dict(doc=r["doc"], **r["generation"]) for r in records
                             if r.get("generation")])


def wilson(k, n, z=1.96):
    """Wilson score interval of k successes in n trials (95% at z = 1.96); None for n = 0."""
    if n == 0:
        return None
    p, z2 = k / n, z * z
    mid, half = (p + z2 / (2 * n)), z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return [float((mid - half) / (1 + z2 / n)), float((mid + half) / (1 + z2 / n))]


def loop_rows(records):
    """The closed loop's rows (harness/closed_loop.py), one per configuration that ran it: its
    samples, the invalid ones (a malformed list: never asked), the items asked and answered right,
    accuracy with a Wilson 95% interval over the items asked (seeds x items, taken as
    independent), the accuracy of a guess among the list's codes (chance: the models repeat codes
    within a list) and the share of codes the story wrote out again."""
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
        # a guess of a code from the list: each item's code is that share of its list
        chance = [x["codes"].count(c) / len(x["codes"]) for x in valid for c in x["codes"]]
        rows.append(dict(task="loop", method=method, budget=int(budget) if budget else None,
                         samples=len(xs), invalid=len(xs) - len(valid), n=asked, right=right,
                         score=right / asked if asked else None, ci=wilson(right, asked),
                         chance=float(np.mean(chance)) if chance else None,
                         restated=float(np.mean(restated)) if restated else None))
    return rows


def loop_markdown(rows):
    """results.md's closed-loop table (lines), [] when it did not run."""
    rows = [r for r in rows if r["task"] == "loop"]
    if not rows:
        return []
    out = ["", "## Closed loop: the model's own codes, asked after its own story", "",
           "Each sample: the model writes a list of codes (the harness writes each line's "
           "head, the model its code), then a story, then is asked for every code "
           "(harness/closed_loop.py); right = its answer's number is the code it wrote. "
           "invalid: samples whose list is malformed (not asked). accuracy: right / asked "
           "[Wilson 95% interval over the items asked, seeds x items taken as independent]. "
           "chance: the accuracy of answering a code drawn from the item's list (the models "
           "repeat codes). restated: the share of codes the story wrote out again. cut: the "
           "full cache stopped at the budget never reaches the questions.", "",
           "| method | budget | samples | invalid | asked | right | accuracy | chance | "
           "restated |", "|---|---|---|---|---|---|---|---|---|"]
    share = lambda x: "–" if x is None else f"{x:.2f}"
    for r in rows:
        out.append(f"| {r['method']} | {r['budget'] or '–'} | {r['samples']} | {r['invalid']} | "
                   f"{r['n']} | {r['right']} | {fmt_ci(r['score'], r['ci'])} | "
                   f"{share(r['chance'])} | {share(r['restated'])} |")
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
        if key.get("loop"):
            loop = key["loop"]
            ran += (f"; closed loop: {loop['seeds']} samples of {loop['items']} codes and "
                    f"{loop['tokens']}-token stories (temperature {loop['temperature']}, top-p "
                    f"{loop['top_p']}) at budgets {loop['budgets']}")
    return [f"# Fast KVzip decode suite ({cfg['started']})", "",
            ran + f". Run time {res.get('seconds', 0) / 60:.1f} min"
            + ("." if res.get("complete") else " (not complete: rerun the command to resume)."),
            ""]
