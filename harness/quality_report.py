"""
The quality sections of results.md and relative.png, from results.json (harness/quality.py runs
the quality suite and summarizes it; harness/report.py writes the run's files).
"""
from cli import pyplot, save_figure
from harness.quality import AVERAGED, CONTRASTS, TASKS, label


def fmt_ci(x, c, f="{:.2f}"):
    """A value and its interval c as the reports print them ("0.93 [0.91, 0.95]"), in format f;
    n/a for none."""
    if x is None:
        return "n/a"
    return f"{f.format(x)} [{f.format(c[0])}, {f.format(c[1])}]" if c else f.format(x)


def markdown(results):
    """The quality sections of results.md (lines), from results.json's rows and contrasts."""
    rows = results["rows"]
    if not rows:
        return []
    budgets = sorted({r["budget"] for r in rows if r["method"] != "full"}, reverse=True)
    configs = list(dict.fromkeys(label(r) for r in rows if r["method"] != "full"))
    get = lambda task, c, b: next((r for r in rows if r["task"] == task and label(r) == c
                                   and r["budget"] == b), None)
    grid = lambda task, cell: ["| method | " + " | ".join(f"{b:g}" for b in budgets) + " |",
                               "|---|" + "---|" * len(budgets)] + [
        f"| {c} | " + " | ".join(cell(get(task, c, b)) if get(task, c, b) else "" for b in budgets)
        + " |" for c in configs]
    averaged = (", ".join(results.get("averaged", AVERAGED))
                or "no task: none was asked or scored by the full cache")
    out = [f"## Relative performance (mean of {averaged}; 1 = full cache)", "",
            "Cells: relative [95% bootstrap interval over contexts]. Budget = fraction of the "
           "context's KV pairs kept in the compressed layers. At budget 1.0 nothing is evicted "
           "(checked per context: every layer keeps everything), the cache is the full cache and "
           "its answers are reused.", ""]
    out += grid("average", lambda r: fmt_ci(r["relative"], r["ci"]))
    out += ["", "## Kept fraction per compressed layer", "",
            "Layers " + ", ".join(str(x) for x in results.get("compressed_layers", [])) +
            ", mean over contexts (the trailing window included: 2% of a context shorter than "
            "one chunk).", ""]
    out += grid("average", lambda r: "/".join(f"{x:.2f}" for x in r["kept_fraction_per_layer"]))
    if results.get("contrasts"):
        out += ["", "## Paired differences of the average relative performance", "",
                "Cells: a − b [95% paired bootstrap interval over contexts]; an interval that "
                "excludes 0 is a difference beyond the noise.", "",
                "| a − b | " + " | ".join(f"{b:g}" for b in budgets) + " |",
                "|---|" + "---|" * len(budgets)]
        for a, b, question in CONTRASTS:
            cells = {c["budget"]: fmt_ci(c["diff"], c["ci"], "{:+.2f}")
                     for c in results["contrasts"] if c["a"] == a and c["b"] == b}
            if cells:
                out.append(f"| {question} | " + " | ".join(cells.get(x, "")
                                                           for x in budgets) + " |")
    titles = dict(passkey="Pass-key accuracy", kv="Key-value retrieval accuracy (SCBench.KV style)",
                  nll_next="NLL of the document's next tokens (nats/token; relative = "
                  "ppl_full/ppl)",
                  nll_repeat="NLL of a repeated passage (nats/token; relative = ppl_full/ppl)",
                  agreement="Agreement of greedy answers with the full cache's")
    for task in TASKS:
        full = next(r for r in rows if r["task"] == task and r["method"] == "full")
        out += ["", f"## {titles[task]}", "",
                f"Full cache: {fmt_ci(full['score'], full['score_ci'])} (n = {full['n']}). Cells: "
                "score (relative [95% interval]); kept per layer beside it.", "",
                "| method | budget | score [95% CI] | relative [95% CI] | kept per layer "
                "| KV held |", "|---|---|---|---|---|---|"]
        for c in configs:
            for b in budgets:
                r = get(task, c, b)
                if r:
                    kept = "/".join(f"{x:.2f}" for x in r["kept_fraction_per_layer"])
                    out.append(f"| {c} | {b:g} | {fmt_ci(r['score'], r['score_ci'])} | "
                               f"{fmt_ci(r['relative'], r['ci'])} | {kept} | "
                               f"{r['kv_fraction']:.0%} |")
    a = results.get("agreement")
    if a:
        pct = lambda x: "–" if x is None else f"{100 * x:.0f}%"
        out += ["", "## Gate vs teacher, per compressed layer (agreement on these contexts)", "",
                "Spearman rank correlation of the gate's scores with the teacher's over every "
                "(head, token) pair; overlap = share of the pairs the teacher keeps that the gate "
                "keeps too, both selected by the cache's rule at that budget, outside the window "
                "both keep (chance = the gate's kept share); digits = share of digit-token pairs "
                "(names, numbers, pass keys) each keeps.", "", "| layer | Spearman | overlap@0.5 "
                "(chance) | overlap@0.3 (chance) | digits@0.5 gate / teacher | digits@0.3 gate "
                "/ teacher |", "|---|---|---|---|---|---|"]
        for j, layer in enumerate(results.get("compressed_layers", range(len(a["spearman"])))):
            out.append(f"| {layer} | {a['spearman'][j]:.2f} | {pct(a['overlap@0.5'][j])} "
                       f"({pct(a['chance@0.5'][j])}) | {pct(a['overlap@0.3'][j])} "
                       f"({pct(a['chance@0.3'][j])}) | {pct(a['digits_student@0.5'][j])} / "
                       f"{pct(a['digits_teacher@0.5'][j])} | {pct(a['digits_student@0.3'][j])} / "
                       f"{pct(a['digits_teacher@0.3'][j])} |")
    out += ["", "## Decode speed per budget (greedy answers of the quality run, tokens/s)", ""]
    out += grid("average", lambda r: f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "")
    return out


def plot(results, path):
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in results["rows"] if r["task"] == "average" and r["method"] != "full"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in dict.fromkeys(label(r) for r in rows):
        rs = sorted((r for r in rows if label(r) == c), key=lambda r: r["budget"])
        y = [r["relative"] if r["relative"] is not None else float("nan") for r in rs]
        err = [[abs(v - r["ci"][i]) if r["ci"] else 0 for v, r in zip(y, rs)] for i in (0, 1)]
        ax.errorbar([r["budget"] for r in rs], y, yerr=err, marker="o", capsize=2, label=c)
    ax.set(xlabel="KV budget (fraction of context kept)",
           ylabel="relative performance (1 = full cache)")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
