"""The library's misuse, as a caller writes it from the README: every check of what a caller passes
to the public API (generate.make_cache / prefill / answer, cache.Budget, cache.EvictingCache,
gate.GateScorer, kernels.varlen_attention, formats.cache_file.save_cache / load_cache,
formats.gate_file.load_gate / resolve_gate) raises kernels.ArgumentError in one sentence that
names the argument, and does so under `python -O` too, where an assert would vanish (and, for
n_protected, the system prompt would be evicted)."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import model as M
from cache import Budget, DecodeBudgetError, EvictingCache
from formats.cache_file import load_cache, save_cache
from formats.gate_file import load_gate, resolve_gate
from gate import Gates, GateScorer
from generate import Compression, answer, begin_answer, decode_one, make_cache, prefill, prefill_request
from kernels import ArgumentError, varlen_attention
from serving.batch import Batch
from serving.scheduler import decode

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 64
TINY = dict(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10_000.0,
            tie_word_embeddings=True, eos_token_id=1)


def tiny():
    """A random 2-layer Qwen3 built from its config (no checkpoint, no transformers: the -O
    subprocess starts fast) and a gate of its shape."""
    torch.manual_seed(0)
    cfg = M.ModelConfig.from_dict(TINY)
    model = M.Transformer(cfg).eval().requires_grad_(False)
    model.identity = {"config_sha256": "0" * 64}  # what save_cache records; no folder here
    gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                  cfg.group_size, dim=4, sinks=2)
    return model, gates


def cases():
    """(name, call, words its one line must hold[, the error: ArgumentError unless named]), each
    a misuse of the public API."""
    model, gates = tiny()
    cfg, ids = model.config, list(range(10, 40))
    kv = Path(tempfile.gettempdir()) / "never-written.kv"  # every save_cache below is refused
    other = Gates(len(cfg.compressed_layers), 48, cfg.num_key_value_heads, cfg.group_size,
                  dim=4, sinks=2)  # another model's gate: hidden 48
    cache = lambda n_protected=4: make_cache("fastkvzip", model, n_protected, gates=gates)
    done = make_cache("full", model, 0)
    last = prefill(model, done, ids, 0)
    evicted = cache(4)
    evicted_last = prefill(model, evicted, ids, 4, Budget(0.5, 16, 4))
    q, k = torch.randn(6, 4, 8), torch.randn(8, 2, 8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)

    def ready(**kw):  # a prefilled evicting cache (nothing evicted), made when its case runs
        c = make_cache("fastkvzip", model, 4, gates=gates, **kw)
        return c, prefill(model, c, ids, 4, Budget(1.0, 16, 4))

    def in_order(*steps):  # the calls, in order, on one prefilled evicting cache
        c, last = ready()
        for step in steps:
            step(c, last)

    # refused too; apart from kv, which the last test checks was never written
    answered_kv = kv.with_name("never-written-answered.kv")

    def after_answer(c, last):
        answer(model, c, [5, 6], 3, set())
        save_cache(answered_kv, c, model, ids, last)

    def other_checkpoint(**kw):
        (c, _), (other, _) = ready(**kw), ready(**kw)
        c.rollback(other.checkpoint())

    def before_prefill():
        c = cache(4)
        state = c.checkpoint()
        prefill(model, c, ids, 4)
        c.rollback(state)

    def joined(*caches):  # into a new Batch of the model, in order
        batch = Batch(cfg)
        for c in caches:
            batch.join(c)
        return batch

    def answering():  # a prefilled evicting cache whose answer began
        c, last = ready()
        begin_answer(model, c, [5], last)
        return c

    return [
        ("Batch.join of an empty cache", lambda: joined(answering(), cache(4)),
         ["Batch.join: the cache holds no prompt"]),
        ("Batch.join before begin_answer", lambda: joined(ready()[0]),
         ["Batch.join: the answer has not begun", "begin_answer"]),
        ("Batch.join of a member again", lambda: joined(*[answering()] * 2),
         ["Batch.join", "in no batch yet", "got a member"]),
        ("Batch.leave of a cache not in it", lambda: joined(answering()).leave(answering()),
         ["Batch.leave: the cache is not a member of this batch"]),
        ("decode temperature nan", lambda: next(decode(model, [], temperature=float("nan"))),
         ["decode: temperature must be a number >= 0", "nan"]),
        ("decode answer_stop_ids None inside",
         lambda: next(decode(model, [], answer_stop_ids=[2, None])),
         ["decode: stop_ids must be a set of token ids", "[2, None]"]),
        ("decode_one before prefill", lambda: decode_one(model, cache(4), 5),
         ["decode_one: the cache holds no prompt"]),
        ("decode_one before begin_answer", lambda: decode_one(model, ready()[0], 5),
         ["decode_one: the answer has not begun", "begin_answer"]),
        ("decode_one token past the vocabulary", lambda: decode_one(model, done, VOCAB),
         ["decode_one: token 64", f"0 to {VOCAB - 1}"]),
        ("decode_one token float", lambda: decode_one(model, done, 5.0), ["decode_one: token 5.0"]),
        ("prefill a kvzip cache to a budget",
         lambda: prefill(model, make_cache("kvzip", model, 4), ids, 4, Budget(0.5, 16, 4)),
         ["prefill: the cache has no scorer", "budget 0.5", "prefill_kvzip"]),
        ("prefill a cache without a scorer to a budget",
         lambda: prefill(model, EvictingCache(cfg, None, n_protected=4), ids, 4, Budget(0.3)),
         ["prefill: the cache has no scorer", "budget 0.3"]),
        ("EvictingCache decode budget without a scorer",
         lambda: EvictingCache(cfg, None, decode_tokens_per_head=200),
         ["EvictingCache: decode-time eviction", "needs a scorer"]),
        ("save_cache after answer", lambda: in_order(after_answer),
         ["save_cache: last_logits are not", "past its prompt", "rollback"]),
        ("save_cache after begin_answer",
         lambda: in_order(lambda c, last: begin_answer(model, c, [5, 6], last),
                          lambda c, last: save_cache(answered_kv, c, model, ids, last)),
         ["save_cache: last_logits are not", "2 tokens past its prompt"]),
        ("rollback to another cache's checkpoint", other_checkpoint,
         ["rollback: the state is not a checkpoint of this cache"]),
        ("rollback to another decode-evicting cache's checkpoint",
         lambda: other_checkpoint(decode_tokens_per_head=200),
         ["rollback: the state is not a checkpoint of this cache"]),
        ("rollback to a checkpoint before prefill", before_prefill,
         ["rollback: the checkpoint was taken at position 0", "after the prefill"]),
        ("rollback across an eviction",
         lambda: in_order(lambda c, last: c.__setattr__("state", c.checkpoint()),
                          lambda c, last: c.evict(4, 20, 0.5),
                          lambda c, last: c.rollback(c.state)),
         ["rollback: layer", "unevenly", "an eviction after it"]),
        ("evict a segment twice",
         lambda: in_order(*[lambda c, last: c.evict(4, 20, 0.5)] * 2),
         ["EvictingCache.evict: segment [4, 20)", "evict each segment once"]),
        ("evict past the positions seen", lambda: in_order(lambda c, last: c.evict(20, 40, 0.5)),
         ["EvictingCache.evict: segment [20, 40)", "within the 30 positions seen"]),
        ("answer stop_ids None", lambda: answer(model, done, [5], 3, None),
         ["answer: stop_ids must be a set of token ids", "None"]),
        ("answer stop_ids text", lambda: answer(model, done, [5], 3, ["</s>"]),
         ["answer: stop_ids", "'</s>'"]),
        ("answer temperature nan", lambda: answer(model, done, [5], 3, set(), float("nan")),
         ["answer: temperature must be a number >= 0", "nan"]),
        ("answer temperature text", lambda: answer(model, done, [5], 3, set(), "0.7"),
         ["answer: temperature", "'0.7'"]),
        ("answer top_p 0", lambda: answer(model, done, [5], 3, set(), 1.0, 0),
         ["answer: top_p must be a number in (0, 1]", "got 0"]),
        ("answer top_p negative", lambda: answer(model, done, [5], 3, set(), 1.0, -0.5),
         ["answer: top_p", "-0.5"]),
        ("Budget ratio text", lambda: Budget("0.5"), ["Budget: ratio", "'0.5'"]),
        ("Budget ratio bool", lambda: Budget(True), ["Budget: ratio", "True"]),
        ("Budget window float", lambda: Budget(0.5, 16, 2.5), ["Budget: window", "2.5"]),
        ("make_cache method", lambda: make_cache("bogus", model, 0), ["'bogus' is not one of"]),
        ("make_cache no gates", lambda: make_cache("fastkvzip", model, 0), ["needs its gates"]),
        ("make_cache kvzip decoding",
         lambda: make_cache("kvzip", model, 0, decode_tokens_per_head=200),
         ["kvzip", "cannot evict during decoding"]),
        ("make_cache decode budget the window fills",
         lambda: make_cache("snapkv", model, 0, decode_tokens_per_head=8),
         ["decode_tokens_per_head 8", "use at least 13"], DecodeBudgetError),
        ("make_cache n_protected", lambda: cache(-1), ["n_protected", "-1"]),
        ("EvictingCache level", lambda: EvictingCache(cfg, GateScorer(gates), level="pair"),
         ["level 'pair'"]),
        ("make_cache redundancy of a baseline",
         lambda: make_cache("snapkv", model, 0, decode_tokens_per_head=200, decode_redundancy=1),
         ["decode_redundancy is fastkvzip's λ", "got 1 for snapkv"]),
        ("make_cache redundancy nan",
         lambda: make_cache("fastkvzip", model, 0, gates=gates, decode_tokens_per_head=200,
                            decode_redundancy=float("nan")),
         ["decode_redundancy", "a finite number >= 0", "got nan"]),
        ("make_cache decode window 0",  # [-0:] would keep every query: refused, not run
         lambda: make_cache("snapkv", model, 0, decode_tokens_per_head=200, decode_window=0),
         ["decode_window an integer >= 1", "got 0, 0 and 200"]),
        ("EvictingCache gate of another model",
         lambda: EvictingCache(cfg, GateScorer(other), n_protected=4),
         ["the gate has", "48", "this model's gate"]),
        ("GateScorer of a path", lambda: GateScorer("gate.safetensors"),  # gate.py lifts out alone
         ["GateScorer: gates must be a gate.Gates", "str"], TypeError),
        ("prefill n_protected past the prompt", lambda: prefill(model, cache(50), ids, 50),
         ["n_protected 50", "[0, 30]"]),
        ("prefill n_protected not the cache's", lambda: prefill(model, cache(4), ids, 2),
         ["n_protected 2", "the cache protects 4"]),
        ("prefill empty", lambda: prefill(model, cache(0), [], 0), ["ids is empty"]),
        ("prefill twice", lambda: prefill(model, done, ids, 0), ["already holds a prompt"]),
        ("prefill id past the vocabulary", lambda: prefill(model, cache(), ids + [VOCAB], 4),
         ["prefill: id 64 at position 30", f"0 to {VOCAB - 1}"]),
        ("prefill negative id", lambda: prefill(model, cache(), [-1] + ids, 4),
         ["prefill: id -1 at position 0"]),
        ("prefill float ids", lambda: prefill(model, cache(0), [1.5, 2.0], 0),
         ["prefill: ids must be a list of token ids", "1.5"]),
        ("prefill budget as a float", lambda: prefill(model, cache(), ids, 4, 0.3),
         ["budget must be a cache.Budget", "0.3"]),
        ("answer before prefill", lambda: answer(model, cache(), [5, 6], 3, set()),
         ["answer: the cache holds no prompt"]),
        ("answer no question", lambda: answer(model, done, [], 3, set()),
         ["give question_ids", "last_logits"]),
        ("answer id past the vocabulary", lambda: answer(model, done, [VOCAB + 5], 3, set()),
         ["answer: id 69 at position 0"]),
        ("answer max_new_tokens text", lambda: answer(model, done, [5], "3", set()),
         ["max_new_tokens", "'3'"]),
        ("prefill_request kvzip without teacher",
         lambda: prefill_request(model, dict(ids=ids, n_protected=4, budget=Budget(0.5),
                                             questions=[], max_new_tokens=1),
                                 Compression("kvzip")),
         ["kvzip needs its teacher"]),
        ("varlen cu_seqlens_q short of q",
         lambda: varlen_attention(q, k, k, i32(0, 3, 5), i32(0, 4, 8), 3, 4),
         ["cu_seqlens_q", "q's 6 rows", "0..5"]),
        ("varlen cu_seqlens_k past k",
         lambda: varlen_attention(q, k, k, i32(0, 3, 6), i32(0, 4, 9), 3, 5),
         ["cu_seqlens_k", "k's 8 rows", "0..9"]),
        ("varlen seqused_k past its region",
         lambda: varlen_attention(q, k, k, i32(0, 3, 6), i32(0, 4, 8), 3, 5,
                                  seqused_k=i32(5, 1)),
         ["seqused_k within its region"]),
        ("varlen max_seqlen_q short",  # Triton's grid would skip the rows past it
         lambda: varlen_attention(q, k, k, i32(0, 3, 6), i32(0, 4, 8), 2, 4),
         ["max_seqlen_q", "(2, 4)", "(3, 4)"]),
        ("varlen heads", lambda: varlen_attention(q, k[:, :1].expand(8, 3, 8), k, i32(0, 6),
                                                  i32(0, 8), 6, 8),
         ["Hq a multiple of Hk"]),
        ("save_cache of a config", lambda: save_cache(kv, done, cfg, ids, last),
         ["save_cache: model must be a model.Transformer", "ModelConfig"]),
        ("save_cache without a cache", lambda: save_cache(kv, None, model, ids, last),
         ["save_cache: cache must be"]),
        ("save_cache budget True",
         lambda: save_cache(kv, evicted, model, ids, evicted_last, budget=True),
         ["budget", "True"]),
        ("load_cache of no path", lambda: load_cache(None, model), ["load_cache: path"]),
        ("load_cache scorer text", lambda: load_cache(kv, model, "gate"),
         ["load_cache: scorer", "str"]),
        ("load_gate of a model", lambda: load_gate("g.safetensors", model),
         ["load_gate: cfg", "Transformer"]),
        ("load_gate dtype text", lambda: load_gate("g.safetensors", cfg, dtype="bfloat16"),
         ["load_gate: dtype", "'bfloat16'"]),
        ("resolve_gate no model name", lambda: resolve_gate(None, cfg, None),
         ["resolve_gate: model_name"]),
    ]


def run_cases():
    """Each case -> one line "name: ExceptionType: message" (what the -O subprocess prints)."""
    lines = []
    with torch.no_grad():
        for name, call, *_ in cases():
            try:
                call()
                lines.append(f"{name}: no error")
            except Exception as e:  # noqa: BLE001 - the line records which, compared below
                lines.append(f"{name}: {type(e).__name__}: {e}")
    return lines


@pytest.mark.parametrize("case", range(len(cases())), ids=[c[0] for c in cases()])
def test_misuse_is_one_named_error(case):
    name, call, words, *error = cases()[case]
    with torch.no_grad(), pytest.raises(error[0] if error else ArgumentError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), (name, msg)


def test_python_O_gives_the_same_errors():
    """The acceptance line: the misuse cases in a `python -O` subprocess (asserts stripped) end in
    the same errors, line for line, as without -O; every one the case's named error."""
    script = "import tests.test_bad_input_library as t; print(json.dumps(t.run_cases()))"
    out = {}
    for flags in ([], ["-O"]):
        r = subprocess.run([sys.executable, *flags, "-c", "import json; " + script], cwd=ROOT,
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        out[tuple(flags)] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out[("-O",)] == out[()], [(a, b) for a, b in zip(out[()], out[("-O",)]) if a != b]
    assert len(out[()]) == len(cases())
    named = [f": {(c[3] if len(c) > 3 else ArgumentError).__name__}: " for c in cases()]
    assert all(n in line for n, line in zip(named, out[()])), out[()]


def test_the_commands_report_an_argument_error_in_one_line(capsys, monkeypatch):
    """A library refusal that reaches a command line is one line, exit 2, as a UsageError is."""
    import bench
    import commands.generate as gen
    import commands.train_gate as tg

    def refuse(args):
        raise ArgumentError("prefill: n_protected 50 must be an integer in [0, 30]")

    with pytest.raises(SystemExit) as e:
        gen.main(["--model", "x", "--prompt", "hi"], refuse)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines() == [
        "error: prefill: n_protected 50 must be an integer in [0, 30]"], err
    assert ArgumentError in bench.ERRORS
    monkeypatch.setattr(tg, "parse_args", lambda argv, recipes, parts: argv)
    monkeypatch.setattr(tg, "kept", lambda *a: None)
    with pytest.raises(SystemExit) as e:
        tg.main(object(), refuse, {}, {})
    assert e.value.code == 2 and "error: prefill: n_protected" in capsys.readouterr().err


def test_non_finite_logits_are_not_saved_and_float32_is_not_advised_to_float32():
    """save_cache of inf/NaN last logits said "the model overflowed torch.float32; use float32" on
    a float32 run: now it says what is known, and advises float32 only to a narrower dtype."""
    model, _ = tiny()
    cache = make_cache("full", model, 0)
    with torch.no_grad():
        prefill(model, cache, [5, 6, 7], 0)
    nan = torch.full((VOCAB,), float("nan"))
    kv = Path(tempfile.gettempdir()) / "never-written.kv"
    with pytest.raises(ArgumentError, match=r"inf/NaN \(computed in torch.float32\): not saved$"):
        save_cache(kv, cache, model, [5, 6, 7], nan)
    assert not kv.exists()
