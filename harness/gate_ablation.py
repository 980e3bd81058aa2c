"""The gate-training ablation (METHOD.md §13.15): train_gate.py's options aimed at the cache's cut,
each alone and all together, over several seeds, on one features folder.

    python -m harness.gate_ablation --features out/gemma --out out/ablation --recipe paper \
        --recipe adam-logmse --seeds 0,1,2 --steps 300 --threads 1 \
        --train-args "--data ~/.cache/fastkvzip/assets/pydoc --tokens 22000 --min-doc-tokens 2000 \
                      --max-doc-tokens 6000 --long-doc-tokens 0"

Every (recipe, variant, seed) trains on a hard-linked copy of the features (offline/README.md: shards
are replaced, never edited) in --out/<recipe>/<variant>/seed<k>, one run at a time, its output in
train.log there. --train-args are the flags every run shares (the --data selection that made the
features: train_gate.py selects its documents again and finds their shards). A finished run (its
metrics.json) is kept: rerun the same command to resume, or with more seeds or variants to grow it.
results.json and results.md are rewritten after every run: per variant, the mean over seeds and a
95% Student-t interval (n - 1 degrees of freedom) of the held-out agreement (train_gate.py's report,
see metrics.json's "agreement"), and each variant minus base paired by seed ("tie": the interval
spans 0). Default variants: base, each option alone, all of them (weights 1: the first look of
METHOD.md §13.15), and --calibrate-heads (§13.17, a step after training, not part of "all")."""
import argparse
import contextlib
import io
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import cli
import train_gate
from commands import train_gate as command
from harness.stats import t_quantile

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"keep-term": "--keep-term 1", "cut-pairs": "--cut-pairs 1",
           "final-chunk-drop": "--final-chunk drop", "select-overlap": "--select overlap",
           "clip": "--clip 1"}
# the training options one by one and together; --calibrate-heads, a step after training, apart
VARIANTS = {"base": "", **OPTIONS, "all": " ".join(OPTIONS.values()),
            "calibrate-heads": "--calibrate-heads"}
OWN = ("--out", "--seed", "--steps", "--recipe", "--eval-features", "--threads")  # set per run here
# (key, label, value from an agreement dict: metrics.json's "agreement" or one --eval-features')
METRICS = ([("spearman", "mean Spearman", lambda a: a["all"]["spearman"])]
           + [(f"ovl@{r}", f"overlap @{r}", lambda a, r=r: a["all"][f"topk_overlap@{r}"])
              for r in (0.1, 0.2, 0.3, 0.5)]
           + [("worst_ovl@0.2", "worst layer's overlap @0.2", lambda a: min(a["topk_overlap@0.2"]))]
           + [(f"abs_err@{r}", f"mean abs share error @{r}",
               lambda a, r=r: a["all"][f"abs_share_error@{r}"]) for r in (0.2, 0.3)]
           + [(f"head_err@{r}", f"mean abs per-head share error @{r}",
               lambda a, r=r: mean_abs(a.get("heads", {}).get(f"share_error@{r}"))) for r in (0.2, 0.3)]
           + [(f"{k}@{r}", f"{k} kept @{r}", lambda a, k=k, r=r: a["all"].get(f"{k}_student@{r}"))
              for k in ("digits", "identifiers") for r in (0.2, 0.3)])


def mean_abs(rows):
    """The mean |x| over a per-layer list of per-head lists (None entries left out), or None."""
    xs = [abs(x) for row in rows or [] for x in row if x is not None]
    return sum(xs) / len(xs) if xs else None


class Bad(Exception):
    """Bad input: one line, exit 2."""


def interval(xs):
    """{mean, lo, hi, n} of the values xs: the 95% Student-t interval of their mean (lo, hi None
    below 2 values)."""
    n, mean = len(xs), sum(xs) / len(xs)
    if n < 2:
        return dict(mean=mean, lo=None, hi=None, n=n)
    half = t_quantile(0.975, n - 1) * math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)
    return dict(mean=mean, lo=mean - half, hi=mean + half, n=n)


def values(metrics):
    """Of one metrics.json: sets, {"heldout" | an --eval-features folder's name: {metric key:
    value}}; train_s, the training seconds; teacher, the teacher's digit and identifier shares."""
    sets = {"heldout": metrics["agreement"],
            **{k: e["agreement"] for k, e in metrics.get("eval_agreement", {}).items()}}
    teacher = {f"{k}@{r}": metrics["agreement"]["all"].get(f"{k}_teacher@{r}")
               for k in ("digits", "identifiers") for r in (0.2, 0.3)}
    return dict(sets={name: {k: f(a) for k, _, f in METRICS} for name, a in sets.items()},
                train_s=metrics["seconds"], teacher=teacher)


def summarize(runs):
    """runs: {recipe: {variant: {seed: values(metrics)}}} -> per recipe and variant, the interval
    of every metric over seeds, and (variant != base) of its difference from base by seed."""
    res = {}
    for recipe, by_variant in runs.items():
        base = by_variant.get("base", {})
        res[recipe] = {}
        for variant, by_seed in by_variant.items():
            seeds = sorted(by_seed)
            first = by_seed[seeds[0]]
            row = dict(seeds=seeds, train_s=interval([by_seed[s]["train_s"] for s in seeds]),
                       teacher=first["teacher"], sets={}, diff={})
            paired = [s for s in seeds if s in base] if variant != "base" else []
            for name, got in first["sets"].items():
                row["sets"][name] = {k: interval([by_seed[s]["sets"][name][k] for s in seeds])
                                     for k, _, _ in METRICS if got[k] is not None}
                if paired:
                    row["diff"][name] = {k: interval([by_seed[s]["sets"][name][k]
                                                      - base[s]["sets"][name][k] for s in paired])
                                         for k in row["sets"][name]}
            res[recipe][variant] = row
    return res


def cell(iv, diff=False, digits=3):
    f = "{:+.%df}" % digits if diff else "{:.%df}" % digits
    if iv["lo"] is None:
        return f.format(iv["mean"]) + " (n=1)"
    tie = " tie" if diff and iv["lo"] <= 0 <= iv["hi"] else ""
    return f"{f.format(iv['mean'])} [{f.format(iv['lo'])}, {f.format(iv['hi'])}]{tie}"


def markdown(res, config):
    lines = ["# Gate-training ablation", "", f"`{config['command']}`", "",
             f"Features: `{config['features']}`; {config['steps']} steps. Cells: the mean over "
             "seeds [95% Student-t interval over seeds, n-1 dof]; differences from base are "
             "paired by seed, \"tie\" where the interval spans 0. Overlap @r: of the pairs the "
             "teacher keeps at budget r, the share among the gate's top-k of each head at the "
             "teacher's count (all layers pooled); share error and kept shares by the cache's cut.",
             ""]
    for recipe, rows in res.items():
        names = list(rows)
        sets = list(rows[names[0]]["sets"])
        for name in sets:
            teacher = rows[names[0]]["teacher"]
            lines += [f"## recipe {recipe}: {name}", "",
                      "| metric | " + " | ".join(f"{v} (seeds {len(rows[v]['seeds'])})"
                                                for v in names) + " |",
                      "|---" * (len(names) + 1) + "|"]
            for k, label, _ in METRICS:
                if k not in rows[names[0]]["sets"][name]:
                    continue
                t = f" (teacher {teacher[k]:.3f})" if k in teacher and name == "heldout" else ""
                lines.append(f"| {label}{t} | " + " | ".join(
                    cell(rows[v]["sets"][name][k]) if k in rows[v]["sets"].get(name, {}) else ""
                    for v in names) + " |")
            if name == "heldout":
                lines.append("| training seconds | " + " | ".join(
                    cell(rows[v]["train_s"], digits=1) for v in names) + " |")
            others = [v for v in names if name in rows[v]["diff"]]
            if others:
                lines += ["", f"Minus base ({recipe}, {name}), paired by seed:", "",
                          "| metric | " + " | ".join(others) + " |", "|---" * (len(others) + 1) + "|"]
                lines += [f"| {label} | " + " | ".join(cell(rows[v]["diff"][name][k], True)
                                                      for v in others) + " |"
                          for k, label, _ in METRICS if k in rows[others[0]]["diff"][name]]
            lines.append("")
    return "\n".join(lines)


def link_features(features, run):
    """run: a copy of the features folder, its files hard links, made whole or not at all."""
    tmp = run.with_name(run.name + ".tmp")
    if tmp.exists():  # an earlier copy interrupted: ours, inside --out
        for f in sorted(tmp.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        tmp.rmdir()
    (tmp / "features").mkdir(parents=True)
    os.link(features / "manifest.json", tmp / "manifest.json")
    for f in (features / "features").iterdir():
        os.link(f, tmp / "features" / f.name)
    os.replace(tmp, run)


def check_features(features):
    try:
        manifest = json.loads((features / "manifest.json").read_text())
        missing = [d["shard"] for d in manifest["documents"] if not (features / d["shard"]).is_file()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Bad(f"--features {features}: not a features folder ({e}); make one with "
                  "train_gate.py --steps 0 --out DIR") from None
    if missing:
        raise Bad(f"--features {features}: {len(missing)} shards missing (e.g. {missing[0]}); "
                  "finish it with the train_gate.py --steps 0 command that made it")


def check_flags(argv):
    """train_gate.py's own check of a run's flags; its complaint as one line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            command.parse_args(argv, train_gate.RECIPES, train_gate.PARTS)
    except SystemExit:
        return (err.getvalue().strip().splitlines() or ["rejected"])[-1]
    return None


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", required=True, type=Path, help="a features folder "
                   "(train_gate.py --steps 0 --out DIR)")
    p.add_argument("--out", required=True, type=Path, help="new folder, or one this program wrote")
    p.add_argument("--recipe", action="append", help="base recipe(s) (default: paper)")
    p.add_argument("--variant", action="append", metavar="NAME=FLAGS", help="a variant: name and "
                   "extra train_gate.py flags (base, with none, is always run); default: "
                   + "; ".join(f"{k}={v!r}" for k, v in VARIANTS.items()))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated, at least 3")
    p.add_argument("--steps", type=int, default=300)
    cli.add_threads(p, note="Each train_gate.py run's (one run at a time)")
    p.add_argument("--train-args", default="", help="flags every run shares (one string)")
    p.add_argument("--eval-features", action="append", default=[], type=Path, metavar="DIR")
    a = p.parse_args(argv)
    try:
        a.seeds = list(dict.fromkeys(int(s) for s in a.seeds.split(",")))
    except ValueError:
        raise Bad(f"--seeds {a.seeds!r}: give integers separated by commas, e.g. 0,1,2") from None
    if a.steps < 1:
        raise Bad(f"--steps {a.steps}: train at least 1 step (the features exist already)")
    if len(a.seeds) < 3:
        raise Bad(f"--seeds {a.seeds}: at least 3 distinct seeds for an interval worth reading")
    pairs = [v.split("=", 1) if "=" in v else [v, None] for v in a.variant or []]
    if any(f is None or not n.strip() or "/" in n for n, f in pairs):
        raise Bad(f"--variant {a.variant}: give NAME=FLAGS, e.g. --variant 'clip2=--clip 2'")
    names = [n for n, _ in pairs]
    if "base" in names or len(set(names)) < len(names):
        raise Bad(f"--variant names {names}: each once, and not base (the run with no extra flags)")
    a.variants = {"base": "", **dict(pairs)} if pairs else dict(VARIANTS)
    a.recipe = a.recipe or ["paper"]
    a.features = a.features.expanduser().resolve()
    a.eval_features = [f.expanduser().resolve() for f in a.eval_features]
    for f in [a.features, *a.eval_features]:
        check_features(f)
    a.train_args = shlex.split(a.train_args)
    for name, flags in [("--train-args", " ".join(a.train_args)), *a.variants.items()]:
        own = [f for f in shlex.split(flags) if f.split("=")[0] in OWN]
        if own:
            raise Bad(f"{name} {flags!r}: {own[0]} is set by this program per run")
        for recipe in a.recipe:
            why = check_flags(a.train_args + shlex.split(flags) + ["--recipe", recipe])
            if why:
                raise Bad(f"variant {name} ({flags!r}, recipe {recipe}): train_gate.py says: {why}")
    return a


def main(argv=None, train=None):
    """The ablation; train(argv, folder, log) runs one train_gate.py (a test's stand-in)."""
    try:
        a = parse(argv)
        out = a.out.expanduser()
        config = dict(features=str(a.features), steps=a.steps,
                      train_args=a.train_args, eval_features=[str(f) for f in a.eval_features],
                      command="python -m harness.gate_ablation " + shlex.join(sys.argv[1:]
                                                                               if argv is None
                                                                               else argv))
        marker = out / "ablation.json"
        if out.exists() and any(out.iterdir()) and not marker.exists():
            raise Bad(f"--out {out} holds files this program did not write; give a new folder")
        if marker.exists():
            old = json.loads(marker.read_text())
            if any(old[k] != config[k] for k in ("features", "steps", "train_args", "eval_features")):
                raise Bad(f"--out {out} holds an ablation of other --features/--steps/--train-args/"
                          "--eval-features; give a new folder")
    except Bad as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    cli.write_text(marker, json.dumps(config, indent=1))
    try:
        return ablate(a, out, config, train or run_train_gate)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished runs are kept in {out}; rerun the same command to resume",
              file=sys.stderr)
        return 130


def ablate(a, out, config, train):
    """Every (recipe, variant, seed) not yet run, then the results after each."""
    jobs = [(r, v, s) for r in a.recipe for v in a.variants for s in a.seeds]
    runs = {}
    for i, (recipe, variant, seed) in enumerate(jobs, 1):
        folder = out / recipe / variant / f"seed{seed}"
        argv_ = (a.train_args + shlex.split(a.variants[variant])
                 + ["--recipe", recipe, "--seed", str(seed), "--steps", str(a.steps),
                    "--threads", str(a.threads), "--quiet", "--out", str(folder)]
                 + [x for f in a.eval_features for x in ("--eval-features", str(f))])
        if (folder / "metrics.json").exists():
            done = folder / "run.json"
            if not done.exists() or json.loads(done.read_text())["argv"] != argv_:
                print(f"error: {folder} was trained with other flags; give a new --out",
                      file=sys.stderr)
                return 2
            print(f"[{i}/{len(jobs)}] {recipe} {variant} seed {seed}: done before, kept")
        else:
            if not folder.exists():
                folder.parent.mkdir(parents=True, exist_ok=True)
                link_features(a.features, folder)
            cli.write_text(folder / "run.json", json.dumps(dict(argv=argv_)))
            print(f"[{i}/{len(jobs)}] {recipe} {variant} seed {seed} ...", end=" ", flush=True)
            t0 = time.perf_counter()
            rc = train(argv_, folder, folder / "train.log")
            if rc != 0 or not (folder / "metrics.json").exists():
                print(f"\nerror: train_gate.py failed (exit {rc}); see {folder / 'train.log'}; "
                      "rerun this command to resume", file=sys.stderr)
                return 1
            wall = time.perf_counter() - t0
            cli.write_text(folder / "run.json", json.dumps(dict(argv=argv_, wall_seconds=wall)))
            print(f"{wall:.0f} s")
        metrics = json.loads((folder / "metrics.json").read_text())
        runs.setdefault(recipe, {}).setdefault(variant, {})[seed] = values(metrics)
        res = summarize(runs)
        cli.write_text(out / "results.json", json.dumps(dict(config=config, results=res), indent=1))
        cli.write_text(out / "results.md", markdown(res, config))
    print(f"results -> {out / 'results.md'}")
    return 0


def run_train_gate(argv, folder, log):
    with open(log, "w") as f:
        return subprocess.call([sys.executable, str(ROOT / "train_gate.py"), *argv], cwd=ROOT,
                               stdout=f, stderr=subprocess.STDOUT)


if __name__ == "__main__":
    sys.exit(main())
