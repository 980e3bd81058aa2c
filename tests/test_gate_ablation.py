"""harness/gate_ablation.py: its table against a naive computation from fake metrics.json files
(a stand-in for train_gate.py), the t quantile against a numerical integral of the t density,
resuming, bad input."""
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from harness import gate_ablation as GA
from harness.stats import t_quantile

RATES = (0.1, 0.2, 0.3, 0.5)


def fake_features(folder, n=2):
    (folder / "features").mkdir(parents=True)
    docs = [dict(shard=f"features/doc{i:05d}.safetensors", split="train") for i in range(n)]
    (folder / "manifest.json").write_text(json.dumps(dict(documents=docs)))
    for d in docs:
        (folder / d["shard"]).write_bytes(b"x")
    return folder


def fake_agreement(rng):
    a = {"all": {"spearman": rng.random()}, "topk_overlap@0.2": [rng.random() for _ in range(3)],
         "heads": {}}
    for r in RATES:
        a["heads"][f"share_error@{r}"] = [[rng.random() - 0.5, None] for _ in range(3)]
        a["all"][f"topk_overlap@{r}"] = rng.random()
        a["all"][f"abs_share_error@{r}"] = rng.random()
        for k in ("digits", "identifiers"):
            a["all"][f"{k}_student@{r}"], a["all"][f"{k}_teacher@{r}"] = rng.random(), 0.25
    return a


class FakeTrain:
    """train_gate.py's stand-in: random metrics.json, a function of its flags (seed included)."""

    def __init__(self, features):
        self.features, self.calls = features, []

    def __call__(self, argv, folder, log):
        self.calls.append(folder)  # on hard links of the features
        assert (folder / "manifest.json").samefile(self.features / "manifest.json")
        rng = random.Random(" ".join(a for a in argv if "/" not in a))
        evals = {f.name: dict(agreement=fake_agreement(rng)) for f in eval_folders(argv)}
        (folder / "metrics.json").write_text(json.dumps(dict(
            agreement=fake_agreement(rng), eval_agreement=evals, seconds=rng.random() * 50)))
        log.write_text("trained\n")
        return 0


def eval_folders(argv):
    return [Path(argv[i + 1]) for i, a in enumerate(argv) if a == "--eval-features"]


@pytest.fixture
def setup(tmp_path):
    fake_features(tmp_path / "feat")
    fake_features(tmp_path / "numeric")
    return tmp_path


def args(tmp, *extra):
    return ["--features", str(tmp / "feat"), "--out", str(tmp / "abl"), "--seeds", "0,1,2",
            "--steps", "5", "--variant", "keep=--keep-term 1", "--variant", "clip=--clip 0.5",
            "--eval-features", str(tmp / "numeric"), *extra]


def naive(xs):
    """mean and 95% interval, the t quantile from a printed table (df 2: 4.303, df 3: 3.182)."""
    m, s = statistics.mean(xs), statistics.stdev(xs)
    half = {3: 4.303, 4: 3.182}[len(xs)] * s / math.sqrt(len(xs))
    return m, m - half, m + half


def test_t_quantile_is_the_integral_of_the_t_density():
    for df in (1, 2, 3, 4, 7, 30):
        t = t_quantile(0.975, df)
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
        n = 20000  # Simpson's rule on [0, t]: P(0 < T < t) = 0.475
        f = [c * (1 + (t * i / n) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        area = t / n / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
        assert area == pytest.approx(0.475, abs=1e-7)
    assert t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-6)


def test_table_is_the_naive_mean_interval_and_paired_difference(setup, capsys):
    train = FakeTrain(setup / "feat")
    assert GA.main(args(setup, "--recipe", "paper", "--recipe", "adam-logmse"), train) == 0
    assert len(train.calls) == 2 * 3 * 3
    out = setup / "abl"
    res = json.loads((out / "results.json").read_text())["results"]
    md = (out / "results.md").read_text()

    def metric(recipe, variant, seed, name):
        m = json.loads((out / recipe / variant / f"seed{seed}" / "metrics.json").read_text())
        return GA.values(m)["sets"][name]
    for recipe in ("paper", "adam-logmse"):
        for variant in ("base", "keep", "clip"):
            for name in ("heldout", "numeric"):
                for key, _, f in GA.METRICS:
                    xs = [metric(recipe, variant, s, name)[key] for s in (0, 1, 2)]
                    iv = res[recipe][variant]["sets"][name][key]
                    assert (iv["mean"], iv["lo"], iv["hi"]) == pytest.approx(naive(xs), abs=2e-3)
                    if variant != "base":
                        base = [metric(recipe, "base", s, name)[key] for s in (0, 1, 2)]
                        d = res[recipe][variant]["diff"][name][key]
                        assert (d["mean"], d["lo"], d["hi"]) == pytest.approx(
                            naive([x - b for x, b in zip(xs, base)]), abs=2e-3)
            m = [json.loads((out / recipe / variant / f"seed{s}" / "metrics.json").read_text())
                 for s in (0, 1, 2)]
            assert res[recipe][variant]["train_s"]["mean"] == pytest.approx(
                statistics.mean(x["seconds"] for x in m))
            worst = [min(x["agreement"]["topk_overlap@0.2"]) for x in m]
            assert res[recipe][variant]["sets"]["heldout"]["worst_ovl@0.2"]["mean"] == \
                pytest.approx(statistics.mean(worst))
        iv = res[recipe]["keep"]["sets"]["heldout"]["spearman"]
        assert f"{iv['mean']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}]" in md
    assert "## recipe adam-logmse: numeric" in md and "(teacher 0.250)" in md


def test_resume_keeps_finished_runs(setup, capsys):
    assert GA.main(args(setup), FakeTrain(setup / "feat")) == 0
    before = (setup / "abl" / "results.json").read_text()
    again = FakeTrain(setup / "feat")
    assert GA.main(args(setup), again) == 0
    assert again.calls == [] and (setup / "abl" / "results.json").read_text() == before
    (setup / "abl" / "paper" / "clip" / "seed1" / "metrics.json").unlink()  # stopped mid-run
    third = FakeTrain(setup / "feat")
    assert GA.main(args(setup, "--seeds", "0,1,2,3"), third) == 0
    assert [c.relative_to(setup / "abl").as_posix() for c in third.calls] == [
        "paper/base/seed3", "paper/keep/seed3", "paper/clip/seed1", "paper/clip/seed3"]
    assert "done before, kept" in capsys.readouterr().out


@pytest.mark.parametrize("extra, says", [
    (["--variant", "bogus=--no-such-flag 3"], "unrecognized arguments: --no-such-flag"),
    (["--variant", "neg=--clip -1"], "--clip must be a number >= 0"),
    (["--variant", "seeded=--seed 4"], "--seed is set by this program"),
    (["--seeds", "0,1,1"], "at least 3 distinct seeds"),
    (["--steps", "0"], "train at least 1 step"),
    (["--variant", "keep=--clip 2"], "each once, and not base"),
    (["--features", "/nonexistent/features"], "not a features folder"),
])
def test_bad_input_is_one_line_exit_2(setup, capsys, extra, says):
    train = FakeTrain(setup / "feat")
    assert GA.main(args(setup, *extra), train) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and train.calls == []


def test_never_writes_into_a_users_folder_or_a_half_features_folder(setup, capsys):
    (setup / "abl").mkdir()
    (setup / "abl" / "notes.txt").write_text("mine")
    assert GA.main(args(setup), FakeTrain(setup / "feat")) == 2
    assert "did not write" in capsys.readouterr().err
    assert sorted(p.name for p in (setup / "abl").iterdir()) == ["notes.txt"]
    (setup / "feat" / "features" / "doc00001.safetensors").unlink()
    assert GA.main(args(setup, "--out", str(setup / "abl2")), FakeTrain(setup / "feat")) == 2
    assert "1 shards missing" in capsys.readouterr().err


def test_per_head_share_error_is_the_mean_absolute_value_over_heads():
    """The per-head row: |share error| averaged over every layer's heads, missing heads left out."""
    heads = {"share_error@0.2": [[0.1, -0.3], [None, 0.2]], "share_error@0.3": [[None]]}
    got = {k: f({"heads": heads}) for k, _, f in GA.METRICS if k.startswith("head_err")}
    assert got == {"head_err@0.2": pytest.approx(0.2), "head_err@0.3": None}
    assert GA.mean_abs(None) is None
