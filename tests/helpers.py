"""Shared test utilities: tiny random checkpoints written by transformers, and a verbose
assert_close.

transformers is a test-only oracle: import it lazily (costs seconds), never at collection time.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5,
                 rtol: float = 0.0, name: str = "tensor", scale_rtol: float = 0.0) -> None:
    """Like torch.testing.assert_close, but always states the max and mean |difference|.

    scale_rtol adds scale_rtol * max|expected| to the bound: the error of an fp32 sum is relative to
    the size of its terms, not of its result, so a small entry of a tensor whose other entries are
    large (computed by the same reductions) can differ by far more than rtol * itself. Which
    rounding we get depends on the summation order, and that on the thread count."""
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert actual.shape == expected.shape, (f"{name}: shape {tuple(actual.shape)} != "
                                            f"{tuple(expected.shape)}")
    assert not (actual.isnan() & ~expected.isnan()).any(), f"{name}: NaN where a number is expected"
    diff = (actual - expected).abs()
    if diff.numel() == 0:
        return
    scale = expected.abs().max().item()
    bound = atol + scale_rtol * scale + rtol * expected.abs()
    bad = diff > bound
    assert not bad.any(), (f"{name}: max |diff| {diff.max().item():.3e} "
                           f"({diff.max().item() / max(scale, 1e-30):.1e} of max|expected| "
                           f"{scale:.3g}), mean {diff.mean().item():.3e}, {bad.sum().item()} of "
                           f"{diff.numel()} beyond atol {atol:g} rtol {rtol:g} scale_rtol "
                           f"{scale_rtol:g}")


# Rank and threshold statistics of two runs that agree only up to fp32 summation order (two code
# paths, or another CPU's SIMD width) may differ by a swapped near-tie: compare them with what the
# moved inputs allow, measured on the inputs, never with an rtol.
def pairs_within(x: torch.Tensor, d: float) -> int:
    """How many pairs of x's entries lie at most d apart (exact ties included): every pair whose
    order can flip when each entry moves by at most d / 2."""
    s = x.detach().flatten().double().sort().values
    return int((torch.searchsorted(s, s + d, right=True) - torch.arange(1, len(s) + 1)).sum())


def spearman_slack(x: torch.Tensor, moved: float) -> float:
    """The most teacher.spearman(x, t) can change, for any t, when each entry of x moves by at most
    `moved`. With n distinct ranks rho = 1 - 6 sum(d^2) / (n (n^2 - 1)), d the rank differences.
    Swapping the ranks r, r + 1 of two entries i, j changes sum(d^2) by 2 |rank_t(i) - rank_t(j)|
    <= 2 (n - 1), so rho by at most 12 / (n (n + 1)); the two rankings are apart by at most the
    pairs within 2·moved of each other (pairs_within), each one such adjacent swap."""
    n = x.numel()
    return pairs_within(x, 2 * moved) * 12 / (n * (n + 1))


def threshold_slack(x: torch.Tensor, threshold: float, moved: float) -> float:
    """The most the fraction of x's entries >= threshold can change when each entry moves by at
    most `moved`: the entries within `moved` of the threshold may cross it."""
    return int(((x.detach().double() - threshold).abs() <= moved).sum()) / x.numel()


# Tiny shapes: every matmul stays small so a forward takes milliseconds with one CPU thread.
QWEN3_TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
GEMMA3_TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=256, query_pre_attn_scalar=24, sliding_window=8,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention"],
                   tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
LLAMA_TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
QWEN2_TINY = LLAMA_TINY


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Overwrite every weight with well-spread random values (transformers' init leaves Gemma norms
    at 0 and gives nearly flat logits, which would hide bugs and make greedy ties likely)."""
    g = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # Qwen2's q/k/v, Llama's optional biases
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # norm weights: Gemma stores w of (1 + w), Qwen3 stores w
                p.copy_(0.3 * torch.randn(p.shape, generator=g) + (0.0 if gemma else 1.0))
            elif "embed_tokens" in name:  # small, or a tied lm_head just echoes the input token;
                # Gemma multiplies embeddings by sqrt(hidden) (8 here)
                p.copy_((0.05 if gemma else 0.1) * torch.randn(p.shape, generator=g))
            else:  # fan-in scaled: activations stay O(1) through the layers
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def tiny_checkpoint(arch: str, folder: str | Path, seed: int = 0, max_shard_size: str | None = None,
                    **overrides) -> Path:
    """save_pretrained a random tiny Qwen3, Gemma3, Llama or Qwen2 (fp32) into `folder`; overrides
    go to the config. Returns the folder (config.json, generation_config.json, model.safetensors or
    shards)."""
    import transformers as T

    folder = Path(folder)
    config_cls, cls, tiny = {"qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, QWEN3_TINY),
                             "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, GEMMA3_TINY),
                             "llama": (T.LlamaConfig, T.LlamaForCausalLM, LLAMA_TINY),
                             "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, QWEN2_TINY)}[arch]
    config = config_cls(**{**tiny, **overrides})
    torch.manual_seed(seed)
    model = cls(config).float()
    randomize_(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def hf_model(folder: str | Path):
    """The transformers oracle for a checkpoint folder: fp32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def edit_config(folder: str | Path, fn) -> dict:
    """Rewrite folder/config.json with fn(dict) -> dict; returns the new dict."""
    path = Path(folder) / "config.json"
    d = fn(json.loads(path.read_text()))
    path.write_text(json.dumps(d, indent=2))
    return d


SPECIALS = ["<bos>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<think>",
            "</think>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]


def tiny_tokenizer(folder):
    """A byte-level tokenizer (one token per byte, 267 ids) with every family's template tokens, so
    the real prompt strings of METHOD.md §4.1 encode inside the tiny models' 384-token
    vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))


@contextmanager
def no_access(folder, mode):
    """chmod `folder` to `mode` for the block: 0o000, nothing inside it can be looked at (pathlib
    raises PermissionError); 0o555, nothing can be created in it. Root ignores permissions, so for
    root the OS call they stop (os.stat, os.mkdir) raises the same PermissionError inside
    `folder`."""
    import errno
    import os
    folder, real = Path(folder).absolute(), {name: getattr(os, name) for name in ("stat", "mkdir")}
    denied = "stat" if mode == 0o000 else "mkdir"

    def refuse(path, *a, **kw):
        p = Path(os.fsdecode(path)) if not isinstance(path, int) else None
        if p is not None and p != folder and p.is_relative_to(folder):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
        return real[denied](path, *a, **kw)

    old = folder.stat().st_mode
    folder.chmod(mode)
    if os.geteuid() == 0:
        setattr(os, denied, refuse)
    try:
        yield folder
    finally:
        setattr(os, denied, real[denied])
        folder.chmod(old)


def run_main(capsys, *argv):
    """generate.py's main with argv -> (exit code, stdout, stderr)."""
    from generate import main
    code = 0
    try:
        main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
