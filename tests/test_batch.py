"""Many requests at once (generate.decode, serving/batch.py): with greedy decoding every
request's answers and kept positions in a batch are the ones it gets alone (up to a near-tie at a
decode-time eviction's cut, check_batch_equals_alone). The oracle is the single-request path itself
(prefill + answer + rollback, as a lone request), on tiny random models."""
import json
from contextlib import contextmanager

import pytest
import torch

import cache as C
import gate
import model as M
from cache import Budget, WindowKV
from cli import UsageError
from gate import Gates
from generate import (
    METHODS,
    Compression,
    answer,
    make_cache,
    prefill,
    prefill_kvzip,
    prefill_request,
)
from kernels import RaggedKV
from prompts import PromptFormat, prompt_format
from serving.batch import Batch, extend, pop_heads
from serving.scheduler import decode
from teacher import KVzipTeacher
from tests.helpers import assert_close, run_main, tiny_checkpoint, tiny_tokenizer
from tests.test_decode_suite import budget_groups, first_free_flip

CHUNK, WINDOW = 64, 16


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request, tmp_path_factory):
    """A tiny Gemma3 (sliding layers: WindowKV rings, one compressed global layer) and a tiny Llama
    (every layer compressed), with a byte tokenizer and a random gate."""
    folder = tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param),
                             max_position_embeddings=1024)
    tiny_tokenizer(folder)
    model = M.load_model(folder, "cpu", torch.float32)
    tok = M.load_tokenizer(folder)
    cfg = model.config
    torch.manual_seed(0)
    gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                  cfg.group_size)
    return model, tok, prompt_format(cfg, str(folder), chat=True), gates


def requests_for(tok, fmt, lengths, max_new):
    """Requests of mixed context lengths (random bytes), two questions each; max_new per request."""
    g = torch.Generator().manual_seed(1)
    system = tok.encode(fmt.system, add_special_tokens=False).ids
    reqs = []
    for n, new in zip(lengths, max_new):
        ctx = torch.randint(40, 200, (n,), generator=g).tolist()
        qs = [(f"q{i}", torch.randint(40, 200, (3 + i,), generator=g).tolist()) for i in range(2)]
        reqs.append(dict(ids=system + ctx, n_protected=len(system), questions=qs, budget=None,
                         max_new_tokens=new))
    return reqs


def kept(cache):
    """Every layer's kept positions, per head, sorted."""
    return [[sorted(kv.head_pos(h).tolist()) for h in range(kv.n_heads)] for kv in cache.layers]


def alone(model, req, method, gates, decode_budget, stop_ids, teacher, evictions=None):
    """The single-request path: prefill, then each question answered and rolled back -> the answers,
    the kept positions after each answer, and those after the last rollback. evictions (from
    recording_evictions): the answers' decode-time evictions, listed per answer in
    `evictions["alone"]`."""
    m = "full" if req["budget"].ratio == 1.0 and decode_budget is None else method
    cache = make_cache(m, model, req["n_protected"], decode_tokens_per_head=decode_budget,
                       gates=gates)
    with torch.no_grad():
        if m == "kvzip":
            last = prefill_kvzip(model, teacher, cache, req["ids"], req["n_protected"],
                                 req["budget"])
        else:
            last = prefill(model, cache, req["ids"], req["n_protected"], req["budget"])
        outs, positions = [], []
        for _, q_ids in req["questions"]:
            state = cache.checkpoint()
            outs.append(answer(model, cache, q_ids, req["max_new_tokens"], stop_ids,
                               last_logits=last))
            positions.append(kept(cache))
            if evictions is not None:
                evictions.setdefault("alone", []).append(evictions.pop(id(cache), []))
            cache.rollback(state)
    return outs, positions, kept(cache)


@contextmanager
def recording_evictions():
    """Every decode-time eviction (EvictingCache._evict_to_budget), per cache: {id(cache): [(n_seen,
    [(scores, keep) per budget group])]}, the form test_decode_suite.first_free_flip compares."""
    calls, current = {}, []
    evict, keep_within_budget = C.EvictingCache._evict_to_budget, C.keep_within_budget

    def evict_(self):
        current.append(self)
        try:
            return evict(self)
        finally:
            current.pop()

    def keep_within_budget_(scores, budget, level):
        keep = keep_within_budget(scores, budget, level)
        calls.setdefault(id(current[-1]), []).append(
            (current[-1].n_seen, list(zip(budget_groups(scores, level), budget_groups(keep, level)))))
        return keep

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C.EvictingCache, "_evict_to_budget", evict_)
        mp.setattr(C, "keep_within_budget", keep_within_budget_)
        yield calls


def check_batch_equals_alone(tiny, method, budget, decode_budget, lengths, max_new, batch_size,
                             stop_ids=()):
    """Each request decoded in a batch answers and keeps what it does alone. Streaming and random
    scores come from positions and a seed: their kept positions are compared exactly. The others'
    decode-time scores are computed from the batched forward (B rows, not 1), equal to rounding only
    (another CPU sums in another order): at each answer's first eviction where the two runs may
    keep other rows (first_free_flip: a kept and a dropped row within 2x the measured score move of
    each other, scores held to 1e-4 of scale, anything else kept differently fails), the answers
    are compared up to the token sampled before it, the kept positions not at all. Greedy tokens
    are compared exactly: the batched logits differ from the lone ones by at most 2.7e-6 here and
    the smallest top-two margin of these answers is 5.7e-5."""
    model, tok, fmt, gates = tiny
    reqs = requests_for(tok, fmt, lengths, max_new)
    for r in reqs:
        r["budget"] = Budget(budget, CHUNK, WINDOW)
    teacher = KVzipTeacher(model, tok, fmt) if method == "kvzip" else None
    seen = {}
    how = Compression(method, gates=gates, teacher=teacher, decode_tokens_per_head=decode_budget)
    made, results = [], {}
    exact = method in ("streaming", "random")

    def admitted():  # each prefilled as decode admits it, in order
        for req in reqs:
            made.append(prefill_request(model, req, how))
            yield made[-1]

    with recording_evictions() as evictions:
        for event, r in decode(model, admitted(), batch_size, stop_ids=stop_ids):
            if event == "answer":  # before the rollback: the rows the answer was generated from
                seen.setdefault(made.index(r), []).append(
                    (kept(r.cache), evictions.pop(id(r.cache), [])))
            elif event == "done":
                results[made.index(r)] = r.answers
        for i, req in enumerate(reqs):
            outs, positions, after = alone(model, req, method, gates, decode_budget,
                                           set(stop_ids), teacher, evictions)
            got = [a["output_ids"] for a in results[i]]
            assert len(got) == len(seen[i]) == len(outs), f"request {i}: answers missing"
            for j, (_, q_ids) in enumerate(req["questions"]):
                (kept_b, calls_b), calls_a = seen[i][j], evictions["alone"][j]
                flip = (None if exact or not (calls_a or calls_b)
                        else first_free_flip(calls_b, calls_a))
                if flip is None:
                    assert got[j] == outs[j], f"request {i}, answer {j}: answers differ"
                    assert kept_b == positions[j], (f"request {i}, answer {j}: kept positions "
                                                    "after the answer differ")
                else:  # token t was sampled having seen the prompt, the question and t tokens
                    same = flip - len(req["ids"]) - len(q_ids) + 1
                    assert got[j][:same] == outs[j][:same], (
                        f"request {i}, answer {j}: answers differ before the eviction at "
                        f"n_seen {flip}")
            evictions.pop("alone")
            assert len(outs[0]) <= req["max_new_tokens"]
    return results


@pytest.mark.parametrize("budget", [1.0, 0.3])
@pytest.mark.parametrize("method", [m for m in METHODS if m != "rkv"])  # rkv: decode time only
def test_batch_answers_equal_alone(tiny, method, budget):
    """Every method at budgets 1.0 and 0.3, three contexts of different lengths (one over two
    chunks), two questions each, batch size 2 (the third request joins when the first leaves), one
    request ending early."""
    check_batch_equals_alone(tiny, method, budget, None, [70, 150, 40], [12, 3, 8], batch_size=2)


@pytest.mark.parametrize("budget", [1.0, 0.3])
@pytest.mark.parametrize("method", ["fastkvzip", "streaming", "random", "snapkv", "rkv"])
def test_batch_with_decode_time_eviction(tiny, method, budget):
    """Decode-time eviction (every 128 tokens, back to 20 tokens per head more than the system
    prompt and the local window it always keeps) runs on each member's own heads of the shared
    storage: the same rows are evicted as alone, up to a near-tie at the cut swapped by scores
    computed from the batched forward (SnapKV's and R-KV's; the gate's tokens scored in the batch
    are still in its 128-token window at the one eviction here). One request stops after 5
    tokens."""
    model, tok, fmt, _ = tiny
    system = len(tok.encode(fmt.system, add_special_tokens=False).ids)
    window = (gate.GateScorer if method == "fastkvzip" else gate.Scorer).window_at_decode(
        model.config)
    results = check_batch_equals_alone(tiny, method, budget, system + window + 20, [90, 130, 60],
                                       [140, 5, 135], batch_size=3)
    assert all(len(a["output_ids"]) == 140 for a in results[0])


def test_batch_with_a_stop_token(tiny):
    """A request whose answer hits a stop id leaves the batch early, with the same (shorter) answer
    as alone."""
    model, tok, fmt, gates = tiny
    req = requests_for(tok, fmt, [80], [10])[0]
    req["budget"] = Budget(0.3, CHUNK, WINDOW)
    free = alone(model, req, "fastkvzip", gates, None, set(), None)[0]
    stop = free[1][4]  # the 5th token of the second answer ends it there
    results = check_batch_equals_alone(tiny, "fastkvzip", 0.3, None, [80, 120], [10, 10], 2,
                                       stop_ids={stop})
    assert len(results[0][1]["output_ids"]) <= 4


def test_batch_frees_rows_of_finished_members(tiny):
    """A member that leaves takes its rows out: the shared storage holds exactly the others'
    rows."""
    model, tok, fmt, gates = tiny
    cfg = model.config
    reqs = requests_for(tok, fmt, [50, 90], [4, 4])
    caches = []
    for r in reqs:
        c = make_cache("fastkvzip", model, r["n_protected"], gates=gates)
        with torch.no_grad():
            prefill(model, c, r["ids"], r["n_protected"], Budget(0.3, CHUNK, WINDOW))
        c.start_decoding()
        caches.append(c)
    rows = [[kv.n_rows for kv in c.layers] for c in caches]
    batch = Batch(cfg)
    for c in caches:
        batch.join(c)
    H = cfg.num_key_value_heads
    assert all(kv.n_heads == 2 * H for kv in batch.layers)
    assert [kv.n_rows for kv in batch.layers] == [a + b for a, b in zip(*rows)]
    with torch.no_grad():
        model(torch.tensor([5, 6]), batch)
    batch.leave(caches[0])
    # its own again
    assert all(type(kv) in (RaggedKV, WindowKV) and kv.n_heads == H for kv in caches[0].layers)
    # only the other's rows
    assert [kv.n_rows for kv in batch.layers] == [kv.n_rows for kv in caches[1].layers]
    assert sum(kv.nbytes for kv in batch.layers) == caches[1].nbytes
    batch.leave(caches[1])
    assert all(kv.n_heads == 0 and kv.nbytes == 0 for kv in batch.layers)


@pytest.mark.parametrize("method", ["full", "fastkvzip"])
def test_batch_holds_the_rows_it_keeps(tiny, method):
    """An answer reserves its question's and its tokens' rows (begin_answer with
    max_new_tokens), so decoding in a batch copies nothing and ends holding exactly the rows kept;
    a member that leaves takes back its rows and no slack."""
    from generate import begin_answer, decode_batch
    model, tok, fmt, gates = tiny
    reqs = requests_for(tok, fmt, [50, 90, 70], [4, 4, 4])
    steps, question = 6, [5, 6, 7, 8]
    batch, tokens = Batch(model.config), []
    with torch.no_grad():
        for r in reqs:
            c = make_cache(method, model, r["n_protected"], gates=gates if method != "full"
                           else None)
            prefill(model, c, r["ids"], r["n_protected"], Budget(0.3, CHUNK, WINDOW))
            tokens.append(int(begin_answer(model, c, question, max_new_tokens=steps + 1).argmax()))
            batch.join(c)
        storage = [kv.k.data_ptr() for kv in batch.layers]
        for _ in range(steps):
            tokens = decode_batch(model, batch, tokens).argmax(-1).tolist()
    assert batch.nbytes == batch.kept_nbytes  # every reserved row used, none spare
    assert [kv.k.data_ptr() for kv in batch.layers] == storage, "decoding re-laid a layer out"
    member = batch.members[1]
    batch.leave(member)
    assert member.nbytes == member.kept_nbytes and batch.nbytes == batch.kept_nbytes


def test_ragged_layout_of_a_batch_against_the_reference():
    """The batched layout (sequences' heads side by side, each with its own length and slack)
    attends as the reference over each sequence's own rows; extend / pop_heads move rows without
    changing them."""
    torch.manual_seed(0)
    H, G, d = 2, 3, 16
    seqs = []
    for n in (5, 40, 17):
        kv = RaggedKV(H, d, torch.float32, "cpu")
        kv.append(torch.randn(n, H, d), torch.randn(n, H, d), torch.arange(n))
        # evicted: every head its own length
        kv.keep_rows(torch.cat([torch.rand(n) < 0.6 for _ in range(H)]))
        # slack after a decode token
        kv.append(torch.randn(1, H, d), torch.randn(1, H, d), torch.tensor([n]))
        seqs.append(kv)
    batch = RaggedKV(0, d, torch.float32, "cpu")
    for kv in seqs:
        extend(batch, kv)
    q = torch.randn(1, len(seqs) * H * G, d)
    for backend in ("torch", "reference"):
        out = batch.attend(q, 0.25, backend=backend)
        for b, kv in enumerate(seqs):
            expect = kv.attend(q[:, b * H * G:(b + 1) * H * G], 0.25, backend="reference")
            assert_close(out[:, b * H * G:(b + 1) * H * G], expect, atol=1e-5,
                         name=f"{backend}, sequence {b}")
    middle = pop_heads(batch, H, H)
    for a, b in ((middle, seqs[1]), (batch, None)):
        if b is None:
            continue
        assert torch.equal(a.lens, b.lens)
        for h in range(H):
            assert torch.equal(a.head_pos(h), b.head_pos(h))
            assert torch.equal(a.k[int(a.starts[h]):][:int(a.lens[h])],
                               b.k[int(b.starts[h]):][:int(b.lens[h])])
    assert batch.n_heads == 2 * H and torch.equal(batch.lens,
                                                  torch.cat([seqs[0].lens, seqs[2].lens]))


def test_window_rings_of_a_batch_wrap_on_their_own():
    """WindowKV heads of sequences at different points of their rings (one still filling, one
    wrapped) take one decode token each, as each would alone."""
    torch.manual_seed(0)
    H, d, W = 2, 16, 8
    alone, lens = [], (3, 13)
    for n in lens:
        kv = WindowKV(H, d, W, torch.float32, "cpu")
        kv.append(torch.randn(n, H, d), torch.randn(n, H, d), torch.arange(n))
        kv.wrap()
        alone.append(kv)
    batch = WindowKV(0, d, W, torch.float32, "cpu")
    for kv in alone:
        extend(batch, kv)
    for step in range(12):
        k, v = torch.randn(1, 2 * H, d), torch.randn(1, 2 * H, d)
        q = torch.randn(1, 2 * H, d)
        pos = torch.tensor([lens[0] + step] * H + [lens[1] + step] * H)[:, None]
        batch.append(k, v, pos)
        out = batch.attend(q, 0.3, window=W)
        for b, kv in enumerate(alone):
            sl = slice(b * H, (b + 1) * H)
            kv.append(k[:, sl], v[:, sl], torch.tensor([lens[b] + step]))
            assert_close(out[:, sl], kv.attend(q[:, sl], 0.3, window=W), atol=1e-6,
                         name=f"step {step}, seq {b}")
            for h in range(H):
                assert sorted(batch.head_pos(b * H + h).tolist()) == sorted(kv.head_pos(h).tolist())


# -- the command line: generate.py --batch FILE --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_cli(tmp_path_factory):
    """A tiny Gemma3 folder with a byte tokenizer, and the same folder without its weights."""
    import shutil
    folder = tiny_checkpoint("gemma3", tmp_path_factory.mktemp("cli"), max_position_embeddings=1024)
    tiny_tokenizer(folder)
    bare = tmp_path_factory.mktemp("bare")
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, bare / f.name)
    return folder, bare


def test_batch_cli_prints_what_each_request_gets_alone(capsys, tiny_cli, tmp_path):
    import json
    folder, _ = tiny_cli
    (tmp_path / "doc.txt").write_text("Emma lives in Highbury. The code is 4721. " * 6)
    lines = [{"context_file": str(tmp_path / "doc.txt"),
              "questions": ["What is the code?", "Where?"]},
             {"context": "Water boils at 100 degrees. " * 3, "questions": ["At what?"],
              "budget": 1.0, "max_new_tokens": 3},
             {"context": "A short one."}]
    (tmp_path / "req.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    flags = ["--model", str(folder), "--method", "streaming", "--budget", "0.5", "--max-new-tokens",
             "6", "--window", "8"]
    code, out, err = run_main(capsys, *flags, "--batch", str(tmp_path / "req.jsonl"),
                              "--batch-size", "2")
    assert code == 0, err
    got = [json.loads(x) for x in out.strip().splitlines()]
    assert len(got) == 3
    for line, res in zip(lines, got):
        ctx = (["--context-file", line["context_file"]] if "context_file" in line
               else ["--prompt", line["context"]])
        qs = [w for q in line.get("questions", []) for w in ("--question", q)]
        extra = [w for k in ("budget", "max_new_tokens") if k in line
                 for w in (f"--{k.replace('_', '-')}", str(line[k]))]
        code, single, err = run_main(capsys, *flags, *ctx, *qs, *extra, "--json")
        assert code == 0, err
        single = json.loads(single)
        assert res["prompt_ids"] == single["prompt_ids"]
        assert [(a["question"], a["output_ids"], a["text"]) for a in res["answers"]] == \
               [(a["question"], a["output_ids"], a["text"]) for a in single["answers"]]
        for key in ("method", "budget", "kept_fraction", "kept_fraction_per_layer", "kv_bytes",
                    "peak_kv_bytes"):
            assert res["stats"][key] == single["stats"][key], key


@pytest.mark.parametrize("line,words", [
    ("not json", ["line 2", "not JSON"]),
    ("[1, 2]", ["line 2", "not an object"]),
    ('{"context": "x", "question": ["q"]}', ["line 2", "unknown key 'question'"]),
    ('{"questions": ["q"]}', ["line 2", "exactly one of"]),
    ('{"context": "x", "context_file": "f"}', ["line 2", "exactly one of"]),
    ('{"context": "  "}', ["line 2", "non-empty string"]),
    ('{"context": "x", "questions": "q"}', ["line 2", "list of non-empty strings"]),
    ('{"context": "x", "budget": 1.5}', ["line 2", "budget", "1.5"]),
    ('{"context": "x", "budget": true}', ["line 2", "budget"]),
    ('{"context": "x", "max_new_tokens": -1}', ["line 2", "max_new_tokens", "-1"]),
    ('{"context": "x", "max_new_tokens": 2.5}', ["line 2", "max_new_tokens"]),
    ('{"context_file": "missing.txt"}', ["line 2", "missing.txt", "No such file"]),
    ('{"context": "' + "word " * 300 + '"}', ["line 2", "exceeds the model's maximum"]),
    # a key given twice took the last; NUL, refused in --context-file, and lone surrogates (a
    # TypeError in tokenizers) were taken
    ('{"context": "x", "context": "y"}', ["line 2", "key 'context' given twice"]),
    # a RecursionError's traceback; Python's advice to raise sys.set_int_max_str_digits()
    ("[" * 100_000 + "]" * 100_000, ["line 2", "JSON nested too deep to read"]),
    ('{"context": "x", "max_new_tokens": ' + "7" * 5000 + "}",
     ["line 2", "an integer of 5000 digits (at most 4300"]),
    ('{"context": "a\\u0000b"}', ["line 2", "\"context\" holds a NUL character"]),
    ('{"context": "x", "questions": ["why\\u0000"]}', ["line 2", "a question holds a NUL"]),
    ('{"context": "x", "questions": ["\\ud800?"]}', ["line 2", "a question holds a lone"]),
    ('{"context": "\\udc80x"}', ["line 2", "\"context\" holds a lone surrogate"]),
    ('{"context": "' + "word " * 20 + '", "budget": 0.01, "max_new_tokens": 4}',
     ["line 2", "fastkvzip would choose nothing"]),  # the 2% window is the whole budget
])
def test_bad_batch_lines_fail_before_the_weights_load(capsys, tiny_cli, tmp_path, line, words):
    _, bare = tiny_cli
    path = tmp_path / "req.jsonl"
    path.write_text('{"context": "fine", "questions": ["q"]}\n' + line + "\n")
    code, out, err = run_main(capsys, "--model", str(bare), "--batch", str(path),
                              "--max-new-tokens", "800")
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "safetensors" not in lines[0], err
    for w in words:
        assert w in lines[0], lines[0]


def test_batch_lines_end_at_newlines_and_files_are_found_beside_the_batch(tiny_cli, tmp_path,
                                                                          monkeypatch):
    """A JSON string may hold U+2028 or U+0085 as they are: the file was split with
    str.splitlines(), which breaks lines there too ("Unterminated string"). A relative context_file
    is read from the batch file's folder (it was read from the current one), and a missing one is
    named with the folder looked in."""
    from commands.generate import read_requests
    folder, _ = tiny_cli
    tok, fmt = M.load_tokenizer(folder), PromptFormat("", "")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "doc.txt").write_text("the document beside the batch file")
    context = "one\u2028two\x85three"
    lines = [json.dumps({"context": context}, ensure_ascii=False),
             json.dumps({"context_file": "doc.txt"})]
    (tmp_path / "b" / "req.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # not the batch file's folder
    reqs = read_requests("b/req.jsonl", tok, fmt, 1024, Budget(0.5), 4)
    assert [r["ids"] for r in reqs] == [tok.encode(t, add_special_tokens=False).ids
                                        for t in (context, "the document beside the batch file")]
    (tmp_path / "b" / "req.jsonl").write_text(json.dumps({"context_file": "missing.txt"}) + "\n")
    missing = tmp_path / "b" / "missing.txt"
    with pytest.raises(UsageError, match=f"context_file {missing}: No such file"):
        read_requests("b/req.jsonl", tok, fmt, 1024, Budget(0.5), 4)


@pytest.mark.parametrize("flags,words", [
    (["--prompt", "hi"], ["--batch", "drop --prompt"]),
    (["--question", "q"], ["--batch", "drop --question"]),
    (["--batch-size", "0"], ["--batch-size", "positive"]),
])
def test_batch_flags(capsys, tiny_cli, tmp_path, flags, words):
    _, bare = tiny_cli
    (tmp_path / "r.jsonl").write_text('{"context": "x"}\n')
    code, _, err = run_main(capsys, "--model", str(bare), "--batch", str(tmp_path / "r.jsonl"),
                            *flags)
    assert code == 2 and all(w in err for w in words), err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, _, err = run_main(capsys, "--model", str(bare), "--batch", str(empty))
    assert code == 2 and "no request" in err, err


def test_bench_batch_speed_section(tiny_cli, tmp_path):
    """bench.py's batched-decoding rows on a tiny model, beside transformers' batched generate:
    every B runs, tokens/s are counted over the batch, eviction holds less KV than the full cache at
    the same B."""
    import bench
    from formats.gate_file import save_gate
    from harness import speed
    folder, _ = tiny_cli
    model = M.load_model(folder, "cpu", torch.float32)
    cfg = model.config
    torch.manual_seed(0)
    save_gate(tmp_path / "g.safetensors", Gates(len(cfg.compressed_layers), cfg.hidden_size,
                                                cfg.num_key_value_heads, cfg.group_size),
              {"model": "tiny"})
    args = bench.parse_args(["--model", str(folder), "--gate", str(tmp_path / "g.safetensors"),
                             "--batch-sizes", "1,3", "--speed-decode", "3", "--speed-chunk", "32",
                             "--speed-window", "8", "--batch-repeats", "3"])
    g = torch.Generator().manual_seed(0)
    docs = [[2] + torch.randint(3, 300, (n,), generator=g).tolist() for n in (90, 70, 60)]
    rows = speed.batch_speed(model, speed.load_peer(folder), docs, 1, bench.speed_settings(args),
                             args.batch_sizes, args.batch_repeats)
    assert [(r["method"], r["batch"]) for r in rows] == [("full", 1), ("full", 3), ("fastkvzip", 1),
                                                         ("fastkvzip", 3), ("transformers", 1),
                                                         ("transformers", 3)]
    assert all(r["decode_tok_s"] > 0 for r in rows)
    # medians
    assert all(len(r["runs"]) == 3 and r["decode_tok_s"] == sorted(r["runs"])[1] for r in rows)
    full3, fast3 = rows[1], rows[3]
    assert fast3["kv_bytes"] < full3["kv_bytes"] and rows[-1]["padded_to"] == 95
    assert "| fastkvzip | 0.3 | 3 |" in "\n".join(speed.batch_markdown(
        rows, args.batch_length, args.speed_decode))


# -- the same on a GPU: the compiled kernel end to end (harness/gpu_check.py runs `-m gpu`) --------

@pytest.mark.gpu
def test_gpu_batch_decode_equals_alone_and_reference(monkeypatch):
    """A tiny Gemma3 on CUDA (sliding-window rings and a compressed global layer, fp32): three
    contexts prefilled and evicted alone (the gate, budget 0.3), then decoding together through the
    compiled kernel, give each step the logits each gets alone; and all of it equals the reference
    backend's."""
    import copy

    from generate import decode_batch, decode_one
    from tests.helpers import GEMMA3_TINY, randomize_
    cfg = M.ModelConfig.from_dict({**GEMMA3_TINY, "model_type": "gemma3_text",
                                   "max_position_embeddings": 1024})
    torch.manual_seed(0)
    model = M.Transformer(cfg)
    randomize_(model)
    model = model.cuda().eval()
    gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                  cfg.group_size, device="cuda")
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (70, 150, 40)]
    steps = torch.randint(3, 300, (5, len(docs)), generator=g).tolist()  # fed, not sampled: no ties

    def run(backend):
        monkeypatch.setenv("FASTKVZIP_ATTN_BACKEND", backend)
        caches = []
        with torch.no_grad():
            for ids in docs:
                c = make_cache("fastkvzip", model, 4, gates=gates)
                prefill(model, c, ids, 4, Budget(0.3, CHUNK, WINDOW))
                c.start_decoding()
                caches.append(c)
            solo = [copy.deepcopy(c) for c in caches]
            batch = Batch(cfg, torch.float32, "cuda")
            for c in caches:
                batch.join(c)
            together = [decode_batch(model, batch, tokens) for tokens in steps]
            alone_ = [torch.stack([decode_one(model, c, tokens[b]) for b, c in enumerate(solo)])
                      for tokens in steps]
        return torch.stack(together).cpu(), torch.stack(alone_).cpu()

    together, alone_ = run("triton")
    assert_close(together, alone_, atol=1e-4, scale_rtol=1e-5, name="batch vs alone (triton)")
    ref_together, _ = run("reference")
    assert_close(together, ref_together, atol=1e-3, scale_rtol=1e-4, name="triton vs reference")
