"""
Calibrate a gate that is already trained: `train_gate.py --calibrate-heads` (METHOD.md §13.17)
applied to an existing gate file, on the teacher's scores and hidden states of a features folder
(one that `train_gate.py --steps 0 --out DIR` made for the same model). Each KV head gets an offset
at the cut so that the cache's global cut keeps the teacher's share of every head on the folder's
training documents. Only the prefill's cut moves (per-head offsets stored beside the gate's
tensors); the gate's scores, the order inside each head and decoding stay as they were. The new
gate is written to --out (never over an existing file, always as .safetensors: the authors' .pt
layout has no place for the offsets), its metadata recording the source gate and the calibration.

    python -m harness.calibrate_gate --gate gates/smollm2-135m-gguf.safetensors \\
        --features out/smollm2 --out smollm2-calibrated.safetensors

(run from the repository root: `-m` puts it on the import path.)
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

import cli
import teacher
from cli import UsageError
from commands import train_gate as command
from commands.features import FeatureStore
from formats.checkpoint import read_config
from formats.gate_file import GateError, load_gate, save_gate
from model import ModelError


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gate", required=True, help="the trained gate file (ours or the authors' .pt)")
    p.add_argument("--features", required=True, help="a train_gate.py features folder of the "
                   "gate's model (manifest.json and features/)")
    p.add_argument("--out", required=True, help="the calibrated gate (.safetensors); must not "
                   "exist")
    cli.add_model(p, default=None, default_note="the model the features folder was made from")
    cli.add_threads(p)
    return p.parse_args(argv)


def manifest_model(folder):
    """The model a features folder was made from (its manifest's "model"), the default --model."""
    try:
        return json.loads((Path(folder) / "manifest.json").read_text("utf-8"))["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        raise UsageError(f"--features {folder} is not a features folder (manifest.json: {why}); "
                         "make one with train_gate.py --steps 0 --out DIR, or pass --model") from None


def run(args):
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out, folder = Path(args.out), Path(args.features)
    if out.exists():
        raise UsageError(f"--out {out} exists; pass a new file name (a gate is never overwritten)")
    if out.suffix == ".pt":
        raise UsageError(f"--out {out}: the authors' .pt layout has no place for the cut offsets; "
                         "name a .safetensors file")
    model = args.model or manifest_model(folder)
    cfg = read_config(cli.resolve_model(model))
    # the folder checked as train_gate.py --eval-features checks it: this model's, every shard there
    [(_, _, manifest)] = command.eval_folders([folder], command.names(model, None)[0], cfg,
                                              flag="--features")
    store = FeatureStore(folder, manifest)
    gates = load_gate(args.gate, cfg)  # refused unless shaped for cfg, as the features are
    rows = teacher.calibrate_heads(gates, store, torch.device("cpu"),
                                   log=lambda s: print(s, file=sys.stderr))
    # the source's own metadata, less what load_gate added about the file it read
    meta = {k: v for k, v in gates.meta.items() if k not in ("source", "tensors_sha256")}
    meta["calibration"] = dict(
        source=str(args.gate), source_sha256=cli.file_sha256(args.gate),
        source_tensors_sha256=gates.meta["tensors_sha256"], features=str(folder),
        budgets=list(teacher.CALIBRATE_BUDGETS), iterations=teacher.CALIBRATE_ITERS,
        share_error=rows)
    save_gate(out, gates, meta=meta)
    print(f"calibrated gate -> {out} ({time.perf_counter() - t0:.0f} s)")


def main(argv=None):
    return cli.main(run, parse_args(argv), ModelError, GateError)


if __name__ == "__main__":
    sys.exit(main())
