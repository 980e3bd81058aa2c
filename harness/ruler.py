"""
RULER (Hsieh et al., arXiv 2404.06654), the field's shared yardstick for KV compression, run as
kvpress's leaderboard runs it: 4K tokens, 13 tasks, `string_match` averaged over them. Its 11
synthetic tasks are generated offline by harness/ruler_tasks.py (RULER@e40fae1's generator, with
which kvpress's file was made); this module feeds them, or the rows of a file in kvpress's layout,
to every method's cache, answers from each, and scores the answers as kvpress does
(NVIDIA/kvpress:evaluation/benchmarks/ruler/calculate_metrics.py).

kvpress's layout, one row per question: context, question, answer_prefix, answer (the list of
strings a prediction must contain; kvpress's RULER files name it `answer`, other data sets
`answers`: both are read), max_new_tokens, task. Generated rows are split where kvpress's RULER
file splits RULER's text (ruler_tasks.to_row). A row is fed as kvpress's pipeline feeds it
(harness/kvpress_prompt.py: the context in one user turn of the chat template, compressed with
the template's opening, only 4 sink tokens protected; each question after it, then the model's
turn, then the answer prefix), or, as an option, in the harness's layout (prompts.prompt_format:
the authors' system prompt, never evicted, before the context). Files in that layout (JSONL or
parquet, e.g. kvpress's own RULER-4K file) are read as they are (read_dataset) and fed the same
way, so a local copy of the leaderboard's file gives its exact samples and prompts.
"""
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch

import generate
from cli import UsageError, check_text, file_sha256, json_line, md, pyplot, save_figure
from harness import kvpress_prompt
from harness import quality as Q
from harness.kvpress_prompt import KvpressFormat
from harness.quality_report import fmt_ci
from harness.ruler_tasks import (
    FWE_BUDGET,
    TASKS,
    TooShort,
    least_target,
    make_sample,
    make_samples,
    suite_name,
)
from harness.timing import TokenClock
from prompts import encode_prompt, encode_text
from serving import scheduler
from teacher import KVzipTeacher

COLUMNS = ("context", "question", "answer_prefix", "answer", "max_new_tokens", "task")


# ---- 4. kvpress's dataset layout: JSONL or parquet, read as it is --------------------------------

class DatasetError(UsageError, ValueError):
    """A dataset file that cannot be run, in one line naming its file and line (JSONL) or row
    (parquet): a UsageError for bench.py (exit 2), a ValueError for a library caller."""


def read_rows(path, flag="--dataset"):
    """Rows of a JSONL or parquet file in kvpress's layout -> [(where, row)]: `where` names the
    file's line (JSONL, counted from 1 as an editor does) or row (parquet, from 1), `row` a dict
    with COLUMNS (answer a list of strings; `answers`, as in kvpress's other data sets, is read as
    answer; other columns are left). Every row is checked here, before any model work, as
    generate.py --batch checks its lines: a bad one is a DatasetError naming it and the column,
    never quoting the file's text."""
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"{flag} {path} is a folder; give a JSONL or parquet file")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq
            items = [(f"row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist(), 1)]
        else:
            with open(path, encoding="utf-8-sig", newline="") as f:
                # lines end at "\n" (and "\r\n") only: JSON strings may hold U+2028 or U+0085 as
                # they are, which str.splitlines() would also break lines at
                lines = f.read().split("\n")
            items = [(f"line {n}", line) for n, line in enumerate(lines, 1) if line.strip()]
    except OSError as e:
        raise DatasetError(f"cannot read {flag} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{flag} {path} is not UTF-8 text (byte {e.start}); JSONL files are "
                           "UTF-8") from None
    except Exception as e:  # pyarrow's errors (ArrowInvalid: not a parquet file)
        raise DatasetError(f"cannot read {flag} {path} as parquet ({type(e).__name__}); give a "
                           "parquet file, or JSONL with another suffix") from None
    if not items:
        raise DatasetError(f"{flag} {path} holds no rows: one JSON object a line (JSONL) or a "
                           f"parquet table, with columns {', '.join(COLUMNS)}")
    return [(f"{flag} {path} {where}", check_row(r, f"{flag} {path} {where}"))
            for where, r in items]


def _kind(x):
    name = type(x).__name__
    return "null" if x is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def check_row(r, where):
    """One row (a JSON line's text, or a parquet row's dict) -> the row in kvpress's layout, or a
    DatasetError naming `where` and the column at fault (its type, never its text)."""
    if isinstance(r, str):
        r = json_line(r, where, DatasetError)
    if not isinstance(r, dict):
        raise DatasetError(f"{where}: a JSON {type(r).__name__}, not an object with the columns "
                           f"{', '.join(COLUMNS)}")
    if "answer" not in r and "answers" in r:
        r = dict(r, answer=r["answers"])
    missing = [c for c in COLUMNS if c not in r and c != "answer_prefix"]
    if missing:
        raise DatasetError(f"{where} lacks {', '.join(missing)} (kvpress's layout: "
                           f"{', '.join(COLUMNS)})")
    for col in ("context", "question", "task", "answer_prefix"):
        x = r.get(col)
        if col == "answer_prefix" and x is None:
            continue  # none: the answer starts right after the turn
        if not isinstance(x, str) or (col != "answer_prefix" and not x.strip()):
            want = "a string or null" if col == "answer_prefix" else "a non-empty string"
            raise DatasetError(f"{where}: {col!r} must be {want}, got "
                               + ("a blank one" if isinstance(x, str) else _kind(x)))
        check_text(x, f"{where}: {col!r}")
    answer = r["answer"]
    answer = [answer] if isinstance(answer, str) else answer
    if not (isinstance(answer, list) and answer and all(isinstance(a, str) and a.strip()
                                                         for a in answer)):
        got = (_kind(answer) if not isinstance(answer, list) else "an empty list" if not answer
               else "a list holding " + next(
                   _kind(a) if not isinstance(a, str) else "an empty string"
                   for a in answer if not isinstance(a, str) or not a.strip()))
        raise DatasetError(f"{where}: 'answer' must be a non-empty string or a non-empty list of "
                           f"them, got {got} (the strings a prediction must contain)")
    for a in answer:
        check_text(a, f"{where}: 'answer'")
    n = r["max_new_tokens"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        got = "an integer below 1" if isinstance(n, int) and not isinstance(n, bool) else _kind(n)
        raise DatasetError(f"{where}: 'max_new_tokens' must be an integer >= 1 (the tokens the "
                           f"answer may take), got {got}")
    return dict(context=r["context"], question=r["question"],
                answer_prefix=r.get("answer_prefix") or "", answer=list(answer),
                max_new_tokens=n, task=r["task"])


def read_dataset(path):
    """Rows of a JSONL or parquet file in kvpress's layout -> dicts with COLUMNS (read_rows, without
    where each came from). Raises DatasetError (a ValueError) naming the line at fault."""
    return [r for _, r in read_rows(path)]


SHORTEN = "shorten the context or lower max_new_tokens (or use a model with more positions)"


def check_fit(tok, fmt, located, max_positions, fix=SHORTEN):
    """Every row of read_rows against the model's positions, as generate.py checks a request: the
    context as fed (context_ids: with the template's opening or the system prompt), the question's
    turn with the answer prefix, and max_new_tokens must fit; else a DatasetError naming the row
    and `fix`."""
    lengths = {}
    fed = "template + context" if isinstance(fmt, KvpressFormat) else "system prompt + context"
    for where, r in located:
        if r["context"] not in lengths:
            lengths[r["context"]] = len(context_ids(tok, fmt, r["context"])[0])
        n = lengths[r["context"]] + len(turn_ids(tok, fmt, r)) + r["max_new_tokens"]
        if n > max_positions:
            raise DatasetError(f"{where}: {fed} + question + max_new_tokens = {n} tokens exceeds "
                               f"the model's maximum of {max_positions}; {fix}")


def write_dataset(rows, path):
    """rows (dicts with at least COLUMNS) -> JSONL, or parquet when path ends in .parquet."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist([{c: r[c] for c in COLUMNS} for r in rows]), path)
    else:
        text = "".join(json.dumps({c: r[c] for c in COLUMNS}) + "\n" for r in rows)
        path.write_text(text, encoding="utf-8")


# ---- 5. Scores, as kvpress computes them ---------------------------------------------------------

CONTROL = re.compile(r"[\x00-\x1f]")


def clean(prediction):
    """kvpress's cleaning of a prediction: stripped, control characters (newlines too) removed."""
    return CONTROL.sub("", prediction.strip()).strip()


def match_all(prediction, answer):
    """One sample's string_match_all: the share of the answer's strings found in the prediction
    (case-insensitive)."""
    p = clean(prediction).lower()
    return sum(a.lower() in p for a in answer) / len(answer)


def match_part(prediction, answer):
    """One sample's string_match_part: 1 if any of the answer's strings is in the prediction."""
    p = clean(prediction).lower()
    return float(any(a.lower() in p for a in answer))


def metric(task):
    """kvpress's choice: string_match_part for the QA tasks, string_match_all for every other."""
    return match_part if task.split("_")[0] == "qa" else match_all


def string_match(task, predictions, answers):
    """A task's score as kvpress reports it: its samples' mean match x 100, rounded to 2 places."""
    f = metric(task)
    return round(100 * sum(f(p, a) for p, a in zip(predictions, answers)) / len(predictions), 2)


# ---- 6. The run: the quality harness's machinery, one prefill replayed into every cache ------

def load_rows(tok, dataset, lengths, n_per_task, seed, tasks=TASKS, sizing="ruler"):
    """The rows a run asks, in kvpress's layout: a file's (dataset), else RULER's generated here,
    n_per_task samples of every task at each length (all of them: a run makes each when it comes
    to it, sample_at). A file that cannot be read, a length too short for a task: UsageError."""
    if dataset:
        return read_dataset(dataset)
    try:
        return [r for n in lengths for r in make_samples(tok, n, n_per_task, seed, tasks, sizing)]
    except ValueError as e:
        raise UsageError(f"--lengths: {e}") from None


def sample_at(tok, lengths, n_per_task, seed, tasks, c, sizing="ruler"):
    """Context c of a generated run, made alone when the run comes to it: the c-th row of
    load_rows (lengths, then sample index, then task), so a run of any --ruler-samples starts at
    once (making every sample first took ~1.3 s per 11 samples at 4K tokens with model sizing,
    ~11 minutes at kvpress's 500 per task, forever at 10**20)."""
    per_length = n_per_task * len(tasks)
    i, t = divmod(c % per_length, len(tasks))
    try:
        return make_sample(tok, tasks[t], lengths[c // per_length], seed, i, sizing)
    except TooShort as e:  # how many are enough: sample 0 is made at the least (as checked first)
        raise too_short({e.task: least_target(tok, e.task, seed, sizing, e.need)}, e.target)
    except ValueError as e:
        raise UsageError(f"--lengths: {e}") from None


def check_generated(tok, fmt, lengths, tasks, seed, sizing, max_positions):
    """Sample 0 of every task at every length, before any model work: a length too short for a
    task, or a sample longer than the model's positions (RULER's sizing counts Llama-3.1's tokens,
    not the model's), is refused in one line (UsageError) before --out is written; ~0.5 s per 4K
    length (model sizing: ~1.3 s)."""
    for n in lengths:
        least = {}  # the tasks too long for n -> the least length that makes their sample 0
        for task in tasks:
            try:
                row = make_sample(tok, task, n, seed, 0, sizing)  # sample_at's context 0
            except TooShort as e:
                least[task] = least_target(tok, task, seed, sizing, e.need)
                continue
            except ValueError as e:
                raise UsageError(f"--lengths: {e}") from None
            fits(tok, fmt, row, n, max_positions)
        if least:
            raise too_short(least, n)


def too_short(least, n):
    """The refusal of --lengths n, too short for the smallest samples of the tasks in `least`
    (task -> the least length that makes its sample 0): one line saying how many are enough."""
    its = "its smallest sample" if len(least) == 1 else "their smallest samples"
    return UsageError(f"--lengths: RULER {', '.join(least)}: {n} tokens are too few for {its}; "
                      f"use --lengths {max(least.values())} or more")


def fits(tok, fmt, row, n, max_positions):
    """A generated row against the model's positions (check_fit); the fix: a lower --lengths."""
    where = f"RULER {row['task']} at --lengths {n}"
    check_fit(tok, fmt, [(where, row)], max_positions, fix="lower --lengths (or use a model with "
              "more positions)")
    return row


def contexts(tok, fmt, exp, max_positions):
    """(how many contexts, context c -> its quality.Sample) of a run: a file's read whole, a
    generated suite's made one at a time (sample_at), each checked against the model's positions
    as it is made (a file's rows were checked before the run: check_fit)."""
    assert isinstance(fmt, KvpressFormat) == (exp.ruler_prompt == "kvpress"), \
        "fmt must be the prompt exp.ruler_prompt names (kvpress_prompt.kvpress_format, or " \
        "prompts.prompt_format for the harness's)"
    if exp.dataset:
        samples = to_samples(tok, fmt, read_dataset(exp.dataset))
        return len(samples), samples.__getitem__
    tasks = list(exp.ruler_tasks)

    def at(c):
        n = exp.lengths[c // (exp.ruler_samples * len(tasks))]
        row = sample_at(tok, exp.lengths, exp.ruler_samples, exp.seed, tasks, c, exp.ruler_sizing)
        return to_samples(tok, fmt, [fits(tok, fmt, row, n, max_positions)])[0]
    return len(exp.lengths) * exp.ruler_samples * len(tasks), at


def context_ids(tok, fmt, context):
    """A context as it is fed -> (ids, n_protected). kvpress's prompt (fmt a KvpressFormat): the
    template's opening and the context, compressed as a whole but for the presses' sink tokens;
    the harness's (a prompts.PromptFormat): the authors' system prompt, never evicted, then the
    context."""
    if isinstance(fmt, KvpressFormat):
        ids = kvpress_prompt.context_ids(tok, fmt, context)
        return ids, min(kvpress_prompt.N_SINK, len(ids))
    system = encode_prompt(tok, fmt.system)
    return system + encode_text(tok, context), len(system)


def turn_ids(tok, fmt, r):
    """A row's question turn: the question, the end of the user's turn and the model's header
    (kvpress without a template: "\n"), the answer prefix; one text between control tokens, as
    kvpress encodes question + suffix + answer_prefix."""
    return encode_prompt(tok, "{question}" + fmt.postfix + "{prefix}", question=r["question"],
                         prefix=r["answer_prefix"])


def to_samples(tok, fmt, rows):
    """kvpress's rows -> quality.Samples, one per distinct context (in file order; kvpress
    compresses a context once for all its questions too): the context as fed (context_ids), each
    question asked after it (turn_ids)."""
    by_context = {}
    for r in rows:
        by_context.setdefault(r["context"], []).append(r)
    samples = []
    for context, asked in by_context.items():
        questions = [Q.Question(r["task"], turn_ids(tok, fmt, r), "", r["max_new_tokens"])
                     for r in asked]
        ids, n_protected = context_ids(tok, fmt, context)
        sample = Q.Sample(ids, n_protected, questions, {}, asked[0]["task"])
        sample.answers = [r["answer"] for r in asked]
        samples.append(sample)
    return samples


def answer_alone(model, tok, cache, sample, stop_ids):
    """Each question of the sample answered greedily from one cache (rolled back after each), up to
    its max_new_tokens, stopping at the end of the sequence, as kvpress generates; -> dict(outputs,
    scores (string_match, 0..1), decode (tokens, seconds)).

    It also stops once the text holds every expected string: string_match_all and _part only
    grow as the text does (the cleaned text of fewer tokens is a prefix of the longer one's), so the
    score is exactly the full-length generation's, for a fraction of its decoding (a small model
    that has answered tends to repeat itself up to max_new_tokens)."""
    res = dict(outputs=[], scores=[], decode=[0, 0.0])
    for q, expected in zip(sample.questions, sample.answers):
        state, f = cache.checkpoint(), metric(q.task)
        logits, out, t0 = generate.begin_answer(model, cache, q.prompt), [], time.perf_counter()
        while len(out) < q.max_new:
            token = generate.sample(logits)
            if token in stop_ids:
                break
            out.append(token)
            if f(tok.decode(out), expected) == 1.0 or len(out) == q.max_new:
                break
            logits = generate.decode_one(model, cache, token)
        res["decode"][0] += max(0, len(out) - 1)  # forwards after the question's
        res["decode"][1] += time.perf_counter() - t0
        cache.rollback(state)
        res["outputs"].append(out)
        res["scores"].append(f(tok.decode(out), expected))
    return res


def answer(model, tok, caches, sample, stop_ids):
    """answer_alone for many caches of one context at once: every cache of `caches` (name -> cache)
    answers each question in one batched decode (serving.scheduler.decode: the caches' rows in
    one Batch, one forward of one token each per step), each stopping on its own, as answer_alone
    does: a stop id, the question's max_new_tokens, or every expected string in the text. Greedy:
    the answers are answer_alone's (tests/test_ruler_batch.py). -> {name: dict(outputs, scores,
    decode)}; decode = (forwards, seconds of the batch steps the cache took part in, each step
    timed from the tokens as they arrive (harness.timing.TokenClock): how long its answers took
    in the batch, not its share of the machine).

    The caches are taken out of `caches` (left empty): each is freed as soon as its answers are
    in."""
    questions = [(q.task, q.prompt) for q in sample.questions]
    names = list(caches)
    reqs = [generate.Request(caches.pop(name), questions, 0, None) for name in names]
    clocks = {r: TokenClock() for r in reqs}
    for event, r in scheduler.decode(model, reqs, len(reqs), stop_ids):
        i = r.question_index
        if event == "question":  # its own length, set before decode reserves the answer's rows
            r.max_new_tokens = sample.questions[i].max_new
            clocks[r].new_answer()
        elif event == "token":
            clocks[r].token()
            if metric(sample.questions[i].task)(tok.decode(r.out), sample.answers[i]) == 1.0:
                r.max_new_tokens = len(r.out)  # the score is final: decode ends the answer here
    res = {}
    for name, r in zip(names, reqs):
        outs = [a["output_ids"] for a in r.answers]
        scores = [metric(q.task)(tok.decode(o), expected)
                  for q, o, expected in zip(sample.questions, outs, sample.answers)]
        res[name] = dict(outputs=outs, scores=scores,
                         decode=[clocks[r].steps, clocks[r].seconds])
    return res


def run(model, tok, fmt, exp, model_name, gate_file, shard=(0, 1), done=(), on_context=None,
        batched=True, only=None):
    """quality.run's loop on RULER's samples (exp: a quality.Experiment of the ruler suite): every
    (method, budget) cache made from one captured full prefill of each context
    (quality.prefill_from_capture), every question answered from it and scored by kvpress's
    string_match: all the context's caches in one batched decode (answer), or, batched=False, one
    cache after another, each answered as soon as it is made (answer_alone: one cache alive at a
    time beside the full one). A cache that evicted nothing is the full cache, row for row: the
    full cache's answers stand for it. Contexts c with c % n == k of shard = (k, n), but those in
    `done` and, with `only` (a set of task names; a generated run), those of other tasks: left to
    a later run of the same experiment, as a shard leaves its peers'; on_context(record) after
    each."""
    cfg = model.config
    methods = [m for m in exp.methods if m != "full"]
    configs = [(m, Q.DEFAULT_LEVEL[m]) for m in methods]
    configs += [(m, lv) for m in methods if m in ("fastkvzip", "kvzip") for lv in exp.extra_levels
                if lv != Q.DEFAULT_LEVEL[m]]
    teacher = KVzipTeacher(model, tok, fmt) if "kvzip" in methods else None
    stop_ids = set(cfg.eos_token_ids)
    total, sample_of = contexts(tok, fmt, exp, cfg.max_position_embeddings)
    k_shard, n_shard = shard
    tasks = list(exp.ruler_tasks)
    assert only is None or not exp.dataset, "only: the tasks of a generated run"
    mine = lambda c: runs(c, shard, tasks, only)
    # this run's contexts, walked without a list: a generated run may be of any size
    n_todo = n_runs(total, shard, tasks, only) - sum(1 for c in done if mine(c) and c < total)
    todo = (c for c in range(k_shard, total, n_shard) if mine(c) and c not in done)
    n_done, t_start = 0, time.perf_counter()
    n_layers = len(cfg.compressed_layers)
    full_key = Q.entry_key("full", 1.0)
    for c in todo:
        sample, t0 = sample_of(c), time.perf_counter()
        parts = dict(prefill=0.0, caches=0.0, answers=0.0)  # seconds: where the context's time went

        def clock(part, since):
            parts[part] += time.perf_counter() - since
            return time.perf_counter()

        with torch.no_grad():
            full, logits, tscores = Q.capture_prefill(model, sample.ids, exp.chunk_size, teacher,
                                                      sample.n_protected)
            t = clock("prefill", t0)  # with KVzip's teacher scoring it
            held = {full_key: ([1.0] * n_layers, full.nbytes)}  # kept fractions and bytes
            answering, same, res = {}, [], {}
            if batched:
                answering[full_key] = full
            else:
                res[full_key] = answer_alone(model, tok, full, sample, stop_ids)
                t = clock("answers", t)
            for method, level in configs:
                config = method if level == Q.DEFAULT_LEVEL[method] else f"{method}/{level}"
                for budget in exp.budgets:
                    key = Q.entry_key(config, budget)
                    cache = Q.method_cache(model, method, level, sample.n_protected, model_name,
                                           gate_file, exp.seed + c, tscores)
                    Q.prefill_from_capture(model, full, logits, cache, method, sample, budget,
                                           exp.chunk_size, exp.window)
                    kept = cache.kept_fraction_per_layer(sample.n_protected, len(sample.ids))
                    held[key] = (kept, cache.nbytes)
                    t = clock("caches", t)
                    if min(kept) == 1.0:  # nothing evicted: the full cache's answers stand
                        same.append(key)
                    elif batched:
                        answering[key] = cache
                    else:
                        res[key] = answer_alone(model, tok, cache, sample, stop_ids)
                        t = clock("answers", t)
                    del cache
            del full, logits, tscores  # the batch holds the full cache until its answers are in
            if batched:
                res.update(answer(model, tok, answering, sample, stop_ids))
                clock("answers", t)
        ref = res[full_key]
        res.update({key: ref for key in same})
        entries = {key: entry(res[key], *held[key]) for key in held}
        record = dict(context=c, n_tokens=len(sample.ids), doc=sample.doc,
                      seconds=time.perf_counter() - t0, entries=entries,
                      answers=[dict(task=q.task, expected=a, full=tok.decode(o)) for q, a, o in
                               zip(sample.questions, sample.answers, ref["outputs"])])
        n_done += 1
        left = n_todo - n_done
        Q.log(f"ruler context {c + 1}/{total} ({sample.doc}, {len(sample.ids)} tokens) done "
              f"in {record['seconds'] / 60:.1f} min (" +
              ", ".join(f"{k} {v:.0f} s" for k, v in parts.items()) +
              f"); full cache {sum(ref['scores']):.2f} of "
              f"{len(sample.questions)}; {left} left in this run, eta "
              f"{(time.perf_counter() - t_start) / n_done * left / 60:.0f} min")
        if on_context:
            on_context(record)


def runs(c, shard, tasks, only=None):
    """Whether context c is a run's: its shard's (shard = (k, n): c % n == k), and, with `only` (a
    set of task names; a generated run), of one of those tasks (c % len(tasks): load_rows)."""
    return c % shard[1] == shard[0] and (only is None or tasks[c % len(tasks)] in only)


def n_runs(total, shard, tasks, only=None):
    """How many of contexts 0..total-1 are a run's (runs), counted without a list: a generated run
    may be of any size, and which contexts are its repeats every lcm(n, len(tasks)) contexts."""
    period = math.lcm(shard[1], len(tasks) or 1)
    mine = lambda c: runs(c, shard, tasks, only)
    return total // period * sum(map(mine, range(period))) + \
        sum(map(mine, range(total - total % period, total)))


def entry(res, kept, nbytes):
    """One (config, budget) on one context: each question's string_match (0..1), kept fractions per
    compressed layer, KV bytes held once prefilled, decode (tokens, seconds; batched: see
    answer)."""
    return dict(scores=res["scores"], kept=kept, nbytes=nbytes, decode=list(res["decode"]))


def run_key(exp, config):
    """What makes two RULER runs' contexts the same experiment (resume, --merge): the samples (the
    generator's settings, or the file's sha256), the prompt they are fed in (kvpress's or the
    harness's), the configurations, the model and the gate."""
    names = ("methods", "budgets", "extra_levels", "chunk_size", "window", "seed")
    key = dict({k: getattr(exp, k) for k in names}, suite="ruler", model=config["model"]["sha256"],
               gate=config["gate"]["sha256"], chat=exp.chat, device=exp.device,
               prompt=exp.ruler_prompt)
    if exp.dataset:
        rows = read_dataset(exp.dataset)
        key.update(dataset=file_sha256(exp.dataset), dataset_name=Path(exp.dataset).name,
                   dataset_contexts=len({r["context"] for r in rows}))
    else:
        key.update(lengths=exp.lengths, ruler_samples=exp.ruler_samples,
                   ruler_tasks=list(exp.ruler_tasks), ruler_sizing=exp.ruler_sizing)
        if exp.ruler_sizing == "ruler" and "fwe" in exp.ruler_tasks:  # not the older runs' fwe
            key["fwe_budget"] = FWE_BUDGET
    return key


def n_contexts(key):
    """How many contexts the run of `key` has (a RULER sample is one context)."""
    if "dataset" in key:
        return key["dataset_contexts"]
    return len(key["lengths"]) * key["ruler_samples"] * len(key["ruler_tasks"])


def planned(key, flags, done):
    """What the runs of one experiment (`key`) meant to run, against what finished (`done`: context
    numbers) -> (contexts meant, of those finished, the tasks left out). flags: each quality run's
    (config.json's "flags"). When every run named tasks with --ruler-only, the tasks none named
    were left out on purpose: their contexts are not meant (those that finished still count in the
    tables); otherwise every context is."""
    total = n_contexts(key)
    only = [f.get("ruler_only") for f in flags]
    if "dataset" in key or not only or not all(only):
        return total, sum(1 for c in done if 0 <= c < total), []
    tasks = key["ruler_tasks"]
    chosen = {t for o in only for t in o}
    meant = lambda c: 0 <= c < total and runs(c, (0, 1), tasks, chosen)
    return (n_runs(total, (0, 1), tasks, chosen), sum(map(meant, done)),
            [t for t in tasks if t not in chosen])


# ---- 7. Results: per-task and average string_match with bootstrap intervals; results.md; plot --

def results(records, n_boot, seed, source, sizing="ruler"):
    """The RULER part of results.json from the finished contexts' records (any order). Scores are
    kvpress's (0-100). Intervals (95%): a percentile bootstrap over each task's samples, the same
    resamples for every configuration; the average's resamples each task's own (stratified).
    source: the target length of generated samples (the suite is named "RULER-4K, 11 tasks"), or the
    name of the kvpress-layout file they came from; sizing: generated samples' (suite_name)."""
    records = sorted(records, key=lambda r: r["context"])
    tasks = list(dict.fromkeys(a["task"] for r in records for a in r["answers"]))
    scores, raw = {}, {}
    for rec in records:
        for key, e in rec["entries"].items():
            config, budget = key.rsplit("@", 1)
            key = (config, float(budget))
            per_task = scores.setdefault(key, {t: [] for t in tasks})
            for a, s in zip(rec["answers"], e["scores"]):
                per_task[a["task"]].append(s)
            r = raw.setdefault(key, dict(kept=[], nbytes=[], decode=[0, 0.0]))
            r["kept"].append(e["kept"]), r["nbytes"].append(e["nbytes"])
            r["decode"] = [r["decode"][0] + e["decode"][0], r["decode"][1] + e["decode"][1]]
    name = suite_name(source, tasks, sizing) if isinstance(source, int) else \
        f"{source}, {len(tasks)} tasks"
    if not scores:
        return dict(suite=name, tasks=tasks, rows=[], n_contexts=0)
    extras = Q.finish_extras(raw)
    rng = np.random.default_rng(seed)
    full = scores[("full", 1.0)]
    idx = {t: rng.integers(0, len(full[t]), size=(n_boot, len(full[t]))) for t in tasks}
    capable = [t for t in tasks if np.mean(full[t]) > 0]  # the tasks the full cache does at all
    ci = lambda b: [float(np.percentile(b, 2.5)), float(np.percentile(b, 97.5))]
    rows, full_avg = [], None
    for key in sorted(scores, key=lambda k: (k[0] != "full", k[0], -k[1])):
        config, budget = key
        method, _, level = config.partition("/")
        level = level or ("full" if method == "full" else Q.DEFAULT_LEVEL[method])
        base = dict(method=method, level=level, budget=budget,
                    compression_ratio=round(1 - budget, 6), **extras[key])
        boots = {}
        for t in tasks:
            s = np.asarray(scores[key][t], dtype=float)
            boots[t] = 100 * s[idx[t]].mean(1)
            rows.append(dict(base, task=t, score=float(100 * s.mean()), ci=ci(boots[t]), n=len(s)))
        for avg, over in (("average", tasks), ("average_capable", capable)):
            if not over:
                continue
            point = float(np.mean([100 * np.mean(scores[key][t]) for t in over]))
            boot = np.mean([boots[t] for t in over], axis=0)
            if key == ("full", 1.0):
                full_avg = full_avg or {}
                full_avg[avg] = (point, boot)
            f_point, f_boot = full_avg[avg]
            with np.errstate(invalid="ignore", divide="ignore"):
                rel, rel_boot = point / f_point if f_point else None, boot / f_boot
            rows.append(dict(base, task=avg, score=point, ci=ci(boot), n=len(over),
                             relative=rel, relative_ci=ci(rel_boot[np.isfinite(rel_boot)])
                             if rel is not None else None))
    return dict(suite=name, tasks=tasks, capable=capable, rows=rows,
                n_contexts=len(records),
                answers=[dict(doc=r["doc"], n_tokens=r["n_tokens"], questions=r["answers"])
                         for r in records])


def label(r):
    return Q.label(r)


def markdown(results):
    """The RULER sections of results.md (lines)."""
    rows = results["rows"]
    if not rows:  # no context finished, or none run (--no-quality)
        return []
    tasks = results["tasks"]
    get = lambda task, r0: next(r for r in rows if r["task"] == task and label(r) == label(r0)
                                and r["budget"] == r0["budget"])
    cell = lambda r: fmt_ci(r["score"], r["ci"], "{:.0f}")
    fmt = lambda x, c: fmt_ci(x, c, "{:.1f}")  # the averages: one decimal
    averages = [r for r in rows if r["task"] == "average"]
    full = averages[0]
    capable = results.get("capable", [])
    out = [f"## {md(results['suite'])}: string_match (kvpress's score, 0-100)", "",
           f"Full cache: {fmt(full['score'], full['ci'])}. Compression ratio = 1 − budget "
           "(kvpress's `compression_ratio`: the fraction of the context's KV pairs removed). "
           "Cells: the mean over tasks of each task's string_match [95% bootstrap interval over "
           "samples, by task]; relative = ÷ the full cache's. The tasks the full cache does at "
           "all (scores above 0): "
           f"{', '.join(map(md, capable)) or 'none'}; only those say anything about compression: "
           "their average is the last column.", "",
           "| method | budget | compression ratio | average [95% CI] | relative | "
           f"average of the {len(capable)} tasks the full cache does [95% CI] |",
           "|---|---|---|---|---|---|"]
    for r in averages:
        cap = next((x for x in rows if x["task"] == "average_capable" and label(x) == label(r)
                    and x["budget"] == r["budget"]), None)
        rel = "" if r.get("relative") is None else f"{r['relative']:.2f}"
        cap = fmt(cap["score"], cap["ci"]) if cap else ""
        out.append(f"| {label(r)} | {r['budget']:g} | {r['compression_ratio']:g} | "
                   f"{fmt(r['score'], r['ci'])} | {rel} | {cap} |")
    n = {t: get(t, full)["n"] for t in tasks}
    out += ["", "## Per task (string_match, 0-100)", "",
            "Samples per task: " + ", ".join(f"{md(t)} {n[t]}" for t in tasks) + ". Cells: the "
            "task's string_match [95% bootstrap interval over its samples].", "",
            "| method | compression ratio | " + " | ".join(map(md, tasks)) + " |",
            "|---|---|" + "---|" * len(tasks)]
    for r in averages:
        out.append(f"| {label(r)} | {r['compression_ratio']:g} | "
                   + " | ".join(cell(get(t, r)) for t in tasks) + " |")
    if len(averages) == 1:  # the full cache alone
        return out
    out += ["", "## Kept fraction per compressed layer (mean over contexts)", "",
            "| method | budget | kept per layer | KV held |", "|---|---|---|---|"]
    for r in averages[1:]:
        kept = "/".join(f"{x:.2f}" for x in r["kept_fraction_per_layer"])
        out.append(f"| {label(r)} | {r['budget']:g} | {kept} | {r['kv_fraction']:.0%} |")
    return out


def plot(results, path):
    """The average string_match against the compression ratio, one line per method, as kvpress's
    leaderboard plots it; the full cache as a dashed line."""
    plt = pyplot()
    rows = [r for r in results["rows"] if r["task"] == "average"]
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in dict.fromkeys(label(r) for r in rows if r["method"] != "full"):
        rs = sorted((r for r in rows if label(r) == c), key=lambda r: r["compression_ratio"])
        x, y = [r["compression_ratio"] for r in rs], [r["score"] for r in rs]
        err = [[abs(v - r["ci"][i]) for v, r in zip(y, rs)] for i in (0, 1)]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=2, label=c)
    ax.axhline(rows[0]["score"], color="grey", ls="--", lw=1, label="full cache")
    ax.set(xlabel="compression ratio (1 - budget)", ylabel="average string_match (0-100)",
           title=results["suite"])
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
