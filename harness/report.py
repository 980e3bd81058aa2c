"""
A benchmark run's files: config.json (flags, versions, machine, model and gate hashes), results.json
and results.md (the quality sections from harness.quality_report, then speed and memory), each written
atomically; and reading them back (bench.py's resume and --merge), each damage one line naming the
file.
"""
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tokenizers
import torch

from cache import LEVELS
from cli import UsageError, code, file_sha256, md
from harness import quality_report
from harness.speed import batch_markdown

ROOT = Path(__file__).resolve().parent.parent


# ---- 2. Output: config.json, results.json, results.md, relative.png — each written atomically ----

def run_config(flags, folder, gates):
    """config.json: the flags as given (a dict), what ran them (command, commit, versions, machine),
    and the hashes of the model's files and of the gate."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip()
    files = sorted(p for p in Path(folder).iterdir() if p.suffix in (".json", ".safetensors"))
    source = gates.meta.get("source")
    return dict(flags=flags, command=" ".join(sys.argv),
                started=time.strftime("%Y-%m-%dT%H:%M:%S"), git_commit=git("rev-parse", "HEAD"),
                git_dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
                versions=dict(python=platform.python_version(), torch=torch.__version__,
                              numpy=np.__version__, tokenizers=tokenizers.__version__),
                machine=dict(platform=platform.platform(), processor=platform.processor(),
                             cpus=os.cpu_count(), torch_threads=torch.get_num_threads(),
                             cuda=torch.cuda.is_available()),
                model=dict(folder=str(folder), sha256={p.name: file_sha256(p) for p in files}),
                # the gate by its file and by its tensors, what decides every score
                gate=dict(source=source, meta=gates.meta, sha256=file_sha256(source) if source
                          else None, tensors_sha256=gates.meta.get("tensors_sha256")),
                levels=list(LEVELS))


def speed_keys(s, kvzip, threads, config):
    """What makes two runs' speed rows (and GPU rows) comparable: rows are kept from an earlier run
    in the same --out, or merged, only if equal. s: harness.speed.SpeedSettings; kvzip: whether the
    teacher's rows were timed; threads: torch's CPU threads. The lengths are not part of it: each
    row names its own."""
    common = dict(budgets=list(s.budgets), speed_budget=s.budget, speed_decode=s.decode)
    return dict(speed=dict(common, model=config["model"]["sha256"], gate=config["gate"]["sha256"],
                           kvzip=kvzip, speed_chunk=s.chunk_size, speed_window=s.window,
                           threads=threads),
                gpu=dict(common, seed=s.seed))  # random weights and gate, Qwen3-8B's shape


def shown(path):
    """A path as results.md shows it: inside the repository, relative to it (a bundled gate);
    elsewhere, as given."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except (ValueError, OSError, TypeError):
        return str(path)


def differing(a, b):
    return ", ".join(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


TEXT_NAMES = {"austen": "Austen", "prose": "held-out prose"}  # --text, as results.md names it


def markdown(results):
    """results.md: what was run, the quality sections (quality_report.markdown), then speed and memory."""
    cfg = results["config"]
    f = cfg["flags"]
    if cfg.get("quality_key", {}).get("suite") == "ruler":
        return ruler_markdown(results)
    g = cfg["gate"]
    tensors = f", tensors {g['tensors_sha256'][:12]}" if g.get("tensors_sha256") else ""
    out = [f"# Fast KVzip benchmark ({cfg['started']})", "",
           f"Model {code(f['model'])}, gate {code(shown(g['source']))} "
           f"(sha256 {str(g['sha256'])[:12]}{tensors}), "
           f"commit {cfg['git_commit'][:10]}{' (dirty)' if cfg['git_dirty'] else ''}. "
           + (f"{results['n_contexts']} {TEXT_NAMES[f.get('text', 'austen')]} contexts of "
              f"{f['lengths']} tokens, " + ("no chat template, " if f.get("chat") is False
                                            else "chat template, " if f.get("chat") else "")
              + f"{f['passkeys']} pass keys and "
              f"{f['kv_questions']} of {f['kv_pairs']} JSON pairs asked per context; chunk "
              f"{f['chunk_size']}, seed {f['seed']}. " if results.get("n_contexts")
              else "No quality section (speed and memory only). ")
           + f"Run time {results.get('seconds', 0) / 60:.1f} min"
           + (f" ({len(cfg['merged_from'])} runs side by side, merged)."
              if cfg.get("merged_from") else "."), ""]
    out += quality_report.markdown(results)
    return "\n".join(out + speed_markdown(results)) + "\n"


def speed_markdown(results):
    """The speed and memory sections of results.md (lines), of either suite."""
    f, out = results["config"]["flags"], []
    mib = lambda x, ratio: f"{x / 2**20:.1f} MiB ({ratio:.0%})"
    for key, title in (("speed", "CPU"), ("gpu", "GPU, random weights in Qwen3-8B's shape")):
        if results.get(key):
            chunk, window = ((f["speed_chunk"], f["speed_window"]) if key == "speed"
                             else (16000, 4096))
            out += ["", f"## Speed and memory: {title}", "",
                    "Real path (generate.prefill / prefill_kvzip, then answer); prefill chunk "
                    f"{chunk}, window {window}. KV bytes count every layer (Gemma3's sliding "
                    "layers hold their window whatever the budget); KV after prefill in % of an "
                    "exactly packed full cache; peak = the most held during prefill (a layer's old "
                    "and new buffers both count while it is re-laid out), in % of the full run's "
                    "peak. The paper's anchors (Figure 1b, Table 5): gate ≈ 1% of prefill; "
                    "compression ≈ 5× faster than KVzip at 170K tokens; prefill peak ≈ 3× lower "
                    "than full at a 30% budget.", "", "| context | method | budget | prefill s | × "
                    "full | gate/teacher share | KV after prefill | peak KV in prefill | "
                    "decode tok/s |", "|---|---|---|---|---|---|---|---|---|"]
            for r in results[key]:
                out.append(f"| {r['context']} | {r['method']} | {r['budget']:g} | "
                           f"{r['prefill_s']:.2f} | {r['prefill_vs_full']:.2f} | "
                           f"{r['score_fraction']:.1%} | {mib(r['kv_bytes'], r['kv_vs_full'])} | "
                           f"{mib(r['peak_kv_bytes'], r['peak_vs_full'])} | "
                           f"{r['decode_tok_s'] or 0:.1f} |")
            if key == "speed" and results.get("speed_peer"):
                out += peer_markdown(results)
    out += batch_markdown(results.get("batch_speed"), f.get("batch_length"), f.get("speed_decode"))
    return out + (["", results["gpu_note"]] if results.get("gpu_note") else [])


def ruler_markdown(results):
    """results.md of a --suite ruler run: what was run, then harness/ruler.py's sections."""
    from harness import ruler
    cfg = results["config"]
    f, key = cfg["flags"], cfg["quality_key"]
    if "dataset" in key:
        source = (f"the {key['dataset_contexts']} contexts of {code(key['dataset_name'])} "
                  "(kvpress's "
                  f"layout, sha256 {key['dataset'][:12]})")
    else:
        sizing = ("sized as RULER sizes kvpress's file, in Llama-3.1 tokens"
                  if key.get("ruler_sizing", "model") == "ruler" else "sized in the model's tokens")
        source = (f"{key['ruler_samples']} samples of each of {len(key['ruler_tasks'])} tasks at "
                  f"{key['lengths']} tokens, generated offline (harness/ruler_tasks.py, {sizing}; "
                  "essay haystack: Jane Austen's novels; qa_1 and qa_2 left out: SQuAD and "
                  "HotpotQA are not offline)")
    fed = ("fed as kvpress's pipeline feeds them (4 sink tokens kept)"
           if key.get("prompt", "harness") == "kvpress" else
           "fed after the authors' system prompt (never evicted)")
    chat = {False: "no chat template, ", True: "chat template, "}.get(f.get("chat"), "")
    merged = f" ({len(cfg['merged_from'])} runs, merged)." if cfg.get("merged_from") else "."
    if results.get("tasks_left_out"):
        left = ", ".join(map(md, results["tasks_left_out"]))
        merged += (f" Left out on purpose (--ruler-only): {left}; "
                   "their samples that finished before are in the tables.")
    what = (f"{results.get('n_contexts', 0)} finished contexts of {source}, {fed}; {chat}seed "
            f"{f['seed']}. Each context is compressed before its question is seen "
            "(query-agnostic), the question asked after it, the answer scored by kvpress's "
            "string_match." if results["rows"] or not f.get("no_quality")
            else "No quality section (--no-quality: speed and memory only).")
    out = [f"# Fast KVzip on {md(results.get('suite', 'RULER'))} ({cfg['started']})", "",
           f"Model {code(f['model'])}, gate {code(shown(cfg['gate']['source']))} (sha256 "
           f"{str(cfg['gate']['sha256'])[:12]}), commit {cfg['git_commit'][:10]}"
           f"{' (dirty)' if cfg['git_dirty'] else ''}. {what} Run time "
           f"{results.get('seconds', 0) / 60:.1f} min{merged}", ""]
    out += ruler.markdown(results)
    return "\n".join(out + speed_markdown(results)) + "\n"


def peer_markdown(results):
    """The peer table: transformers on the same checkpoint, run in turn with ours, and ours /
    transformers."""
    peer = results["speed_peer"]
    fmt = lambda x: f"{x:.2f}×" if x is not None else "–"
    out = ["", f"### Against transformers {peer[0].get('version', '')} (SDPA attention, "
           "DynamicCache, fp32)", "", f"The same checkpoint, chunks, question and greedy decode, "
           f"run in turn with ours in the same process ({peer[0]['repeats']} runs each, medians). "
           "Speed ratio ours / transformers: > 1 means ours is faster (prefill: its time over "
           "ours; decode: our tokens/s over its).", "", "| context | transformers prefill s | "
           "transformers decode tok/s | transformers KV after prefill | method | budget | prefill "
           "× transformers | decode × transformers |", "|---|---|---|---|---|---|---|---|"]
    for p in peer:
        for r in (r for r in results["speed"] if r["context"] == p["context"] and r.get("vs_peer")):
            out.append(f"| {p['context']} | {p['prefill_s']:.2f} | {p['decode_tok_s'] or 0:.1f} | "
                       f"{p['kv_bytes'] / 2**20:.1f} MiB | {r['method']} | {r['budget']:g} | "
                       f"{fmt(r['vs_peer']['prefill'])} | {fmt(r['vs_peer']['decode'])} |")
    return out


# ---- 3. Reading a run folder back: what bench.py wrote, or one line naming what is wrong ---------

def read_json(path, fix):
    """A JSON object this script wrote (atomically): damaged by something else (a copy cut short) ->
    UsageError naming the file and `fix`, what to do about it."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; too deep
        raise UsageError(f"{path} is not valid JSON ({type(e).__name__}: "
                         f"{str(e)[:80]}); {fix}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{path} holds a JSON {type(obj).__name__}, not a bench result; {fix}")
    return obj


def not_a_run(config):
    """Why a config.json's content is not one bench.py wrote (a run's, or a merge's), or None."""
    if not isinstance(config, dict):
        return f"a JSON {type(config).__name__}, not an object"
    missing = [k for k, kind in (("quality_key", dict), ("command", str))
               if not isinstance(config.get(k), kind)]
    return f"it has no {' or '.join(missing)}" if missing else None


def check_merged_configs(folders, configs):
    """What a merge's results.md reads of each run's config.json beside what not_a_run asks (the
    flags, when it started): else one line naming the file."""
    for f, c in zip(folders, configs):
        missing = [k for k, kind in (("flags", dict), ("started", str))
                   if not isinstance(c.get(k), kind)]
        if missing:
            raise UsageError(f"{f}/config.json has no {' or '.join(missing)}: not all of a bench "
                             f"run's; leave {f} out of --merge")


def check_kind(out, suite, merged):
    """--out holding bench.py's results of another kind than this one's is refused in one line:
    a run (merged=False) writes only over a run of its suite (resumed), a merge only over a merge
    of its suite (merged into again). Not bench.py's, or nothing: claim_folder's to judge."""
    config = bench_config(out)
    if config is None:
        return
    theirs = (bool(config.get("merged_from")), config["quality_key"].get("suite", "needle"))
    kind = lambda m, s: f"a --suite {s} {'merge' if m else 'run'}"
    if theirs != (merged, suite):
        raise UsageError(f"--out {out} holds the results of {kind(*theirs)}: "
                         f"{kind(merged, suite)} does not write over them; pass another --out "
                         "(a new or empty folder)")


def bench_config(folder):
    """`folder`'s config.json if bench.py wrote it (a run's or a merge's), else None (none there,
    unreadable, or another program's)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return None if not_a_run(config) else config


def is_run(folder):
    """Whether `folder` is a bench.py run (or merge) that it may write into again: its config.json
    is one bench.py wrote."""
    return bench_config(folder) is not None


def read_results(path, fix):
    """A run's results.json (read_json), with what merge and a resume take from it in the shape
    bench.py writes: a config, speed rows as objects; otherwise UsageError naming it and `fix`."""
    old = read_json(path, fix)
    if not isinstance(old.get("config"), dict):
        raise UsageError(f"{path} has no config: not a bench result; {fix}")
    if not isinstance(old.get("seconds", 0), (int, float)):
        raise UsageError(f"{path}: its seconds are not a number; {fix}")
    for k in ("speed", "speed_peer", "gpu"):
        rows = old.get(k)
        if rows is not None and not (isinstance(rows, list)
                                     and all(isinstance(r, dict) for r in rows)):
            raise UsageError(f"{path}: its {k} rows are not a list of objects; {fix}")
    return old
