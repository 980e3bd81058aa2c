"""The flags every program shares (--model, --seed, --threads): defined once, in cli.py, with one
help text and one check, which every program's parser gets."""
import argparse
import re

import pytest

import cli
from tests.test_layout import ROOT

SHARED = ("--model", "--seed", "--threads")


def parse(add, argv, **kw):
    p = argparse.ArgumentParser(prog="prog")
    add(p, **kw)
    return p.parse_args(argv)


def refused(capsys, add, argv, words, **kw):
    with pytest.raises(SystemExit) as e:
        parse(add, argv, **kw)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"prog: error: {words}", err


def test_the_shared_flags_are_defined_in_cli_only():
    """No program adds --model, --seed or --threads itself (they were in nine, five and eight
    files, each with its own help and check)."""
    flag = re.compile(r"add_argument\(\s*\"(%s)\"" % "|".join(SHARED))
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv") or rel.parts[0].startswith(".") or str(rel) == "cli.py":
            continue
        found = flag.findall(path.read_text(encoding="utf-8"))
        assert not found, f"{rel} adds {found} itself: use cli.add_model / add_seed / add_threads"


def test_seed_takes_what_torch_and_numpy_take(capsys):
    assert parse(cli.add_seed, [], seeds="x").seed == 0
    assert parse(cli.add_seed, [], seeds="x", default=42).seed == 42
    assert parse(cli.add_seed, ["--seed", str(2**63 - 1)], seeds="x").seed == 2**63 - 1
    refused(capsys, cli.add_seed, ["--seed", str(2**63)], f"argument --seed: {2**63} is not a "
            "seed: use an integer from 0 to 2**63 - 1", seeds="x")
    # numpy's generators (the bootstrap) refuse a negative seed: refused here, not in a traceback
    refused(capsys, cli.add_seed, ["--seed", "-1"], "argument --seed: -1 is not a seed: use an "
            "integer from 0 to 2**63 - 1", seeds="x")
    refused(capsys, cli.add_seed, ["--seed", "1.5"], "argument --seed: invalid seed value: '1.5'",
            seeds="x")


def test_threads_is_a_count_and_zero_only_where_a_program_takes_it(capsys):
    assert parse(cli.add_threads, []).threads == 1
    assert parse(cli.add_threads, [], default=None).threads is None  # torch's own choice
    assert parse(cli.add_threads, ["--threads", "3"], default=2).threads == 3
    refused(capsys, cli.add_threads, ["--threads", "0"], "argument --threads: must be >= 1, got 0")
    assert parse(cli.add_threads, ["--threads", "0"], zero=True).threads == 0  # bench.py's
    refused(capsys, cli.add_threads, ["--threads", "-1"], "argument --threads: must be >= 0, got -1",
            zero=True)
    refused(capsys, cli.add_threads, ["--threads", "two"],
            "argument --threads: invalid threads value: 'two'")


def test_model_keeps_each_programs_default_and_says_it():
    p = argparse.ArgumentParser()
    cli.add_model(p, default="smollm2-135m-gguf")
    (action,) = [a for a in p._actions if a.dest == "model"]
    assert p.parse_args([]).model == "smollm2-135m-gguf"
    assert action.help.endswith("default: smollm2-135m-gguf, converted offline from PyPI")
    assert parse(cli.add_model, []).model == cli.OFFLINE_DEFAULT
    assert parse(cli.add_model, ["--model", "qwen3-8b"]).model == "qwen3-8b"
