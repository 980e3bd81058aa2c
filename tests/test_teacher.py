"""The KVzip teacher (teacher.py) against a naive O(n²) computation of METHOD.md §4.

The oracle rebuilds every repeat input from the spec's strings, runs system ⊕ context ⊕ repeat in
one plain forward (no chunked prefill, no cache tricks), materialises every attention probability of
the repeat queries over [system ; chunk ; repeat (causal)] and takes the maxima.
"""
import math

import pytest
import torch
from helpers import assert_close, tiny_checkpoint, tiny_tokenizer

import model as M
from cache import KVCache
from prompts import prompt_format
from teacher import PREV_TOKENS, REPEAT_FIRST, REPEAT_NEXT, KVzipTeacher


def tiny_model_folder(root, arch, seed=0):
    """A tiny random checkpoint with a tokenizer and room for the template + repeat prompts."""
    folder = tiny_checkpoint(arch, root / arch, seed=seed, max_position_embeddings=8192)
    tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: tiny_model_folder(root, arch) for arch in ("qwen3", "gemma3")}


class Recorder(KVCache):
    """A full cache that remembers every layer's q, k and attention input of the last forward."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.q, self.k, self.hidden = {}, {}, {}

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        self.q[layer], self.k[layer], self.hidden[layer] = q, k, hidden
        return super().attend(layer, q, k, v, hidden, scale, window)


def naive_scores(model, system, ctx, repeat, start, end):
    """(L_g, H, end-start) by brute force for one chunk."""
    ids = system + ctx + repeat
    rec = Recorder(model.config)
    model(torch.tensor(ids), rec)
    n_sys, first_q, N, T = len(system), len(system) + len(ctx), len(ids), len(repeat)
    out = []
    for layer in model.config.compressed_layers:
        q, k = rec.q[layer][first_q:], rec.k[layer]              # (T, Hq, d), (N, H, d)
        H, G, d = k.shape[1], q.shape[1] // k.shape[1], q.shape[2]
        # (Hq, T, N)
        logits = torch.einsum("thd,nhd->htn", q, k.repeat_interleave(G, 1)) / math.sqrt(d)
        j = torch.arange(N)[None, :]
        i = torch.arange(T)[:, None] + first_q  # absolute position of each repeat query
        visible = ((j < n_sys) | ((j >= n_sys + start) & (j < n_sys + end))
                   | ((j >= first_q) & (j <= i)))
        # every probability
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        chunk = probs[:, :, n_sys + start:n_sys + end]                              # (Hq, T, c)
        out.append(chunk.amax(dim=1).view(H, G, -1).amax(dim=1))  # max over queries, group
    return torch.stack(out)


def spec_repeat_inputs(tok, postfix, ctx, chunk):
    """METHOD.md §4.2 written out independently of teacher.py."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids
    out = []
    for i, start in enumerate(range(0, len(ctx), chunk)):
        piece = ctx[start:start + chunk]
        head = enc(REPEAT_FIRST) if i == 0 else enc(REPEAT_NEXT) + ctx[start - PREV_TOKENS:start]
        out.append((start, start + len(piece), head + enc(postfix) + piece))
    return out


def context_ids(tok, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = ["cache", "gate", "key", "value", "the", "of", "sink", "attention", "head", "token",
             "layer"]
    text = " ".join(words[int(i)] for i in torch.randint(len(words), (n,), generator=g))
    return tok.encode(text, add_special_tokens=False).ids[:n]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_scores_equal_naive_computation(tiny_models, arch):
    folder = tiny_models[arch]
    model, tok = M.load_model(folder, "cpu", torch.float32), M.load_tokenizer(folder)
    fmt = prompt_format(model.config, arch, chat=True)  # a real system prompt and postfix
    # 4 chunks (the last one short), a prefill split in 3 pieces, Gemma3's window (8) far shorter
    # than all
    teacher = KVzipTeacher(model, tok, fmt, chunk_size=23, prefill_chunk=70)
    ctx = context_ids(tok, 75)
    scores, hidden = teacher(ctx, capture_hidden=True)
    L_g, H = len(model.config.compressed_layers), model.config.num_key_value_heads
    assert scores.shape == (L_g, H, 75) and scores.dtype == torch.float32
    assert float(scores.min()) >= 0 and float(scores.max()) <= 1

    repeats = spec_repeat_inputs(tok, fmt.postfix, ctx, 23)
    assert [(s, e) for s, e, _ in repeats] == [(0, 23), (23, 46), (46, 69), (69, 75)]
    assert [r for _, _, r in repeats] == [r for _, _, r in teacher.repeat_inputs(ctx)]
    expected = torch.cat([naive_scores(model, teacher.system, ctx, r, s, e) for s, e, r in repeats],
                         dim=-1)
    assert_close(scores, expected, atol=1e-5, name=f"{arch} KVzip scores")

    # the features: attention inputs of the context tokens in the compressed layers, system prompt
    # excluded
    rec = Recorder(model.config)
    model(torch.tensor(teacher.system + ctx), rec)
    n_sys = len(teacher.system)
    want = torch.stack([rec.hidden[layer][n_sys:] for layer in model.config.compressed_layers])
    assert_close(hidden, want, atol=1e-5, name=f"{arch} hidden features")


def test_score_leaves_the_cache_as_it_was(tiny_models):
    folder = tiny_models["gemma3"]
    model, tok = M.load_model(folder, "cpu", torch.float32), M.load_tokenizer(folder)
    teacher = KVzipTeacher(model, tok, prompt_format(model.config, "gemma3"), chunk_size=16,
                           prefill_chunk=32)
    ctx = context_ids(tok, 40, seed=1)
    cache = teacher.new_cache()
    teacher.prefill(cache, teacher.system + ctx)
    # per head
    held = lambda kv: [kv.k[int(s):int(s) + int(n)].clone() for s, n in zip(kv.starts, kv.lens)]
    before = [(kv.lens.clone(), held(kv)) for kv in cache.layers]
    n_seen = cache.n_seen
    first = teacher.score(cache, len(teacher.system), ctx)
    assert cache.n_seen == n_seen
    for (lens, k), kv in zip(before, cache.layers):
        assert torch.equal(kv.lens, lens) and all(torch.equal(a, b) for a, b in zip(held(kv), k))
    # repeatable on the same cache
    assert torch.equal(teacher.score(cache, len(teacher.system), ctx), first)


def test_softmax_in_model_dtype(tiny_models):
    """--teacher-softmax model: logits and softmax in the model dtype (bf16 here), as the
    authors."""
    folder = tiny_models["qwen3"]
    model, tok = M.load_model(folder, "cpu", torch.bfloat16), M.load_tokenizer(folder)
    fmt = prompt_format(model.config, "qwen3")
    ctx = context_ids(tok, 30, seed=2)
    fp32 = KVzipTeacher(model, tok, fmt, chunk_size=16)(ctx)[0]
    bf16 = KVzipTeacher(model, tok, fmt, chunk_size=16, softmax_dtype="model")(ctx)[0]
    assert not torch.equal(fp32, bf16)
    assert_close(bf16, fp32, atol=2e-2, name="bf16 vs fp32 softmax")
    assert torch.equal(bf16, bf16.bfloat16().float())  # the values themselves are bf16 numbers
