"""model.py against transformers 5.24 (the test-only oracle) on tiny random checkpoints it wrote
itself, plus hand-built folders in the formats of released checkpoints (legacy config keys,
multimodal Gemma3)."""
import inspect
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import model as M
from cache import KVCache
from cli import _HUB_FILES, ALIASES, OFFLINE_DEFAULT, parse_device, resolve_model
from formats.checkpoint import check_config, load_checked, read_config, read_tokenizer
from prompts import PromptFormat, encode_prompt, prompt_format, question_ids, uses_chat
from tests.helpers import assert_close, edit_config, hf_model, tiny_checkpoint

VOCAB = 384  # helpers.QWEN3_TINY / GEMMA3_TINY
GEMMA_RoPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 200_000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0}}
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "rope_theta": 10_000.0}
# Llama 3.1's scaling with its factors, over an original length short enough for 40-token prompts to
# reach every band (head_dim 16, base 1e4: wavelengths 6 to 2.4e4; kept < 4, blended 4..16, divided
# > 16)
LLAMA3_RoPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 10_000.0}

# checkpoints transformers writes: name -> (arch, config overrides, save_pretrained kwargs)
SAVED = {
    "qwen3-gqa2-tied": ("qwen3", {}, {}),
    "qwen3-gqa4-untied-sharded": ("qwen3", dict(num_attention_heads=8, tie_word_embeddings=False),
                                  dict(max_shard_size="100KB")),
    "qwen3-mqa-yarn": ("qwen3", dict(num_key_value_heads=1, rope_parameters=QWEN_YARN,
                                     max_position_embeddings=64),
                       {}),
    "gemma3-mixed-softcap": ("gemma3", dict(final_logit_softcapping=5.0,
                                            rope_parameters=GEMMA_RoPE), {}),
    "gemma3-mqa-untied": ("gemma3", dict(num_key_value_heads=1, tie_word_embeddings=False,
                                         num_hidden_layers=3,
                                         layer_types=["sliding_attention", "full_attention",
                                                      "sliding_attention"]),
                          {}),
    "llama-gqa2-tied": ("llama", {}, {}),
    "llama-untied-sharded-llama3": ("llama", dict(tie_word_embeddings=False,
                                                  rope_parameters=LLAMA3_RoPE,
                                                  max_position_embeddings=64),
                                    dict(max_shard_size="100KB")),
    "llama-mqa-biases-head32": ("llama", dict(num_key_value_heads=1, attention_bias=True,
                                              # q_proj 128 x 64: heads*head_dim != hidden
                                              mlp_bias=True, head_dim=32), {}),
    "qwen2-mqa-untied-sharded": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=False),
                                  dict(max_shard_size="100KB")),
    "qwen2-gqa2-tied": ("qwen2", {}, {}),  # q/k/v biases
}
# folders built by hand from a saved one: name -> (source, builder); the oracle is noted per builder
BUILT = ["qwen3-legacy-yarn", "llama-legacy-llama3", "gemma3-legacy", "gemma3-multimodal-old",
         "gemma3-multimodal-new"]
ALL = list(SAVED) + BUILT


# the key layout of released Qwen3 configs (transformers 4.51), YaRN as the authors run it
def _legacy_qwen(d):
    for k in ("rope_parameters", "layer_types"):
        d.pop(k)
    return {**d, "rope_theta": 10_000.0, "rope_scaling": {k: v for k, v in QWEN_YARN.items()
                                                          if k != "rope_theta"}}


# the key layout of released Llama 3.1 configs (transformers 4.43): rope_scaling
def _legacy_llama(d):
    d.pop("rope_parameters")
    return {**d, "rope_theta": 10_000.0, "rope_scaling": {k: v for k, v in LLAMA3_RoPE.items()
                                                          if k != "rope_theta"}}


# released Gemma3 configs: no layer_types, a pattern, two RoPE keys, rope_scaling
def _legacy_gemma(d):
    for k in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        d.pop(k)
    return {**d, "sliding_window_pattern": 3, "rope_theta": 200_000.0,
            "rope_local_base_freq": 5_000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}


def _multimodal(src: Path, dst: Path, new_names: bool) -> None:
    """A Gemma3ForConditionalGeneration-style folder holding src's text decoder and a fake vision
    tower."""
    dst.mkdir()
    text = json.loads((src / "config.json").read_text())
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
           "eos_token_id": [1, 106]}
    (dst / "config.json").write_text(json.dumps(cfg))
    prefix = "model.language_model." if new_names else "language_model.model."
    tensors = {prefix + k[len("model."):] if k.startswith("model.") else "language_model." + k: v
               for k, v in load_file(src / "model.safetensors").items()}
    vision = "model.vision_tower." if new_names else "vision_tower."
    tensors[vision + "vision_model.post_layernorm.weight"] = torch.ones(8)  # must be skipped
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> (folder our model loads, folder the transformers oracle loads). Built on first
    use."""
    root, made = tmp_path_factory.mktemp("ckpt"), {}

    def get(name):
        if name in made:
            return made[name]
        if name in SAVED:
            arch, overrides, save = SAVED[name]
            folder = tiny_checkpoint(arch, root / name, seed=list(SAVED).index(name), **save,
                                     **overrides)
            made[name] = (folder, folder)
        elif "legacy" in name:  # oracle: transformers on the same folder
            family = name.split("-")[0]
            src = get({"qwen3": "qwen3-mqa-yarn", "llama": "llama-untied-sharded-llama3",
                       "gemma3": "gemma3-mixed-softcap"}[family])[0]
            shutil.copytree(src, root / name)
            edit_config(root / name, {"qwen3": _legacy_qwen, "llama": _legacy_llama,
                                      "gemma3": _legacy_gemma}[family])
            made[name] = (root / name, root / name)
        else:  # multimodal: oracle = transformers' text model on the source checkpoint
            src = get("gemma3-mixed-softcap")[0]
            _multimodal(src, root / name, new_names=name.endswith("new"))
            made[name] = (root / name, src)
        return made[name]

    return get


@pytest.fixture(scope="session")
def oracle():
    models = {}

    def get(folder):
        if folder not in models:
            models[folder] = hf_model(folder)
        return models[folder]

    return get


def prompt(n, seed=0):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# -- 1. logits parity ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(name, checkpoints, oracle):
    ours_dir, ref_dir = checkpoints(name)
    model = M.load_model(ours_dir, "cpu", torch.float32)
    ids = prompt(40)  # > 2 x the sliding window (8), > the YaRN original length (16)
    with torch.no_grad():
        expected = oracle(ref_dir)(ids[None]).logits[0]
        assert_close(model(ids), expected, atol=1e-4, name=f"{name} logits")
        # chunked prefill through one cache (positions from n_seen) = one pass; num_logits keeps the
        # tail
        cache = KVCache(model.config, torch.float32, "cpu")
        first = model(ids[:13], cache)
        tail = model(ids[13:], cache, num_logits=5)
    assert cache.n_seen == 40 and tail.shape == (5, VOCAB) and tail.dtype == torch.float32
    assert_close(torch.cat([first, tail]), torch.cat([expected[:13], expected[-5:]]), atol=1e-4,
                 name=f"{name} chunked")


@pytest.mark.parametrize("name", [n for n in SAVED if "sharded" in n])
def test_sharded_checkpoint_really_is_sharded(checkpoints, name):
    folder = checkpoints(name)[0]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert "lm_head.weight" in index["weight_map"]  # untied: its own matrix


def test_configs_parsed_as_intended(checkpoints):
    """The legacy mappings are checked against transformers above; here, against the intent
    itself."""
    legacy = M.ModelConfig.from_json(checkpoints("gemma3-legacy")[0])
    assert legacy.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                                  "sliding_attention"]
    assert legacy.rope["full_attention"] == {"rope_type": "linear", "factor": 4.0,
                                             "rope_theta": 200_000.0}
    assert legacy.rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 5_000.0}
    assert legacy.compressed_layers == [2] and legacy.window(0) == 8 and legacy.window(2) is None
    assert legacy.attn_scale == 24 ** -0.5 and legacy.final_logit_softcapping == 5.0
    mm = M.ModelConfig.from_json(checkpoints("gemma3-multimodal-old")[0])
    assert mm.arch == "gemma3" and mm.eos_token_ids == [1, 106] and mm.tie_word_embeddings
    yarn = M.ModelConfig.from_json(checkpoints("qwen3-legacy-yarn")[0])
    assert yarn.rope["full_attention"]["rope_type"] == "yarn" and yarn.compressed_layers == [0, 1]
    assert yarn.group_size == 4 and yarn.attn_scale == 16 ** -0.5
    llama = M.ModelConfig.from_json(checkpoints("llama-legacy-llama3")[0])
    assert llama.rope["full_attention"] == LLAMA3_RoPE and not llama.qk_norm and not llama.qkv_bias
    # no template: the family's
    assert llama.compressed_layers == [0, 1] and llama.chat_format == "llama3"
    wide = M.ModelConfig.from_json(checkpoints("llama-mqa-biases-head32")[0])
    assert wide.qkv_bias and wide.attention_bias and wide.mlp_bias and wide.head_dim == 32
    qwen2 = M.ModelConfig.from_json(checkpoints("qwen2-gqa2-tied")[0])
    assert (qwen2.qkv_bias and not qwen2.attention_bias and not qwen2.qk_norm
            and qwen2.chat_format == "chatml")
    # q/k/v carry a bias, o_proj none
    model = M.load_model(checkpoints("qwen2-gqa2-tied")[0], "cpu")
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None and attn.v_proj.bias is not None
            and attn.o_proj.bias is None)
    assert not hasattr(attn, "q_norm")


def test_released_config_layouts():
    """Key layouts of published configs (values as on the Hub), no weights needed."""
    gemma4b = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
               "eos_token_id": [1, 106], "text_config": {
                   "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                   "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                   "sliding_window": 1024}}
    cfg = M.ModelConfig.from_dict(gemma4b)
    assert ((cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
            == (8, 4, 256, 262208))
    # METHOD.md §9: range(pattern-1, L, pattern)
    assert cfg.compressed_layers == list(range(5, 34, 6))
    assert cfg.rope["full_attention"] == {"factor": 8.0, "rope_type": "linear", "rope_theta": 1e6}
    assert cfg.rope["sliding_attention"]["rope_theta"] == 1e4 and cfg.eos_token_ids == [1, 106]
    qwen8b = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "bos_token_id": 151643,
              "eos_token_id": 151645, "head_dim": 128, "hidden_size": 4096,
              "intermediate_size": 12288, "max_position_embeddings": 40960,
              "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
              "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
    cfg = M.ModelConfig.from_dict(qwen8b, {"eos_token_id": [151645, 151643]})
    assert (cfg.layer_types == ["full_attention"] * 36 and cfg.window(0) is None
            and cfg.group_size == 4)
    assert cfg.rope["full_attention"] == {"rope_type": "default", "rope_theta": 1000000}
    assert cfg.eos_token_ids == [151643, 151645] and len(cfg.compressed_layers) == 36
    # the models of the authors' released Qwen2.5 gates: G = 7 and 5, every layer compressed
    for size, (L, D, I, Hq, H) in {"7B": (28, 3584, 18944, 28, 4),
                                   "14B": (48, 5120, 13824, 40, 8)}.items():
        qwen25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                  "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
                  "hidden_size": D, "intermediate_size": I, "max_position_embeddings": 1010000,
                  "max_window_layers": L, "num_attention_heads": Hq, "num_hidden_layers": L,
                  "num_key_value_heads": H, "rms_norm_eps": 1e-05, "rope_scaling": None,
                  "rope_theta": 10000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
                  # ignored, as transformers does:
                  "use_sliding_window": False, "vocab_size": 152064,
                  "dual_chunk_attention_config": {"chunk_size": 262144, "local_size": 8192,
                                                  "original_max_position_embeddings": 262144}}
        cfg = M.ModelConfig.from_dict(qwen25, {"eos_token_id": [151645, 151643]})
        assert (cfg.compressed_layers == list(range(L)) and cfg.window(L - 1) is None
                and cfg.head_dim == 128)
        assert cfg.qkv_bias and not cfg.qk_norm and cfg.eos_token_ids == [151643, 151645], size
        assert (cfg.group_size == {"7B": 7, "14B": 5}[size]
                and cfg.rope["full_attention"]["rope_theta"] == 1e7)
    llama8b = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "attention_bias": False, "bos_token_id": 128000,
               "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu",
               "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
               "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256}
    cfg = M.ModelConfig.from_dict(llama8b)
    assert (cfg.rope["full_attention"]["rope_type"] == "llama3" and cfg.eos_token_ids
            == [128001, 128008, 128009])
    assert (len(cfg.compressed_layers) == 32 and cfg.group_size == 4 and not cfg.qkv_bias
            and cfg.chat_format == "llama3")
    with pytest.raises(M.ModelError, match="llama3.*without low_freq_factor"):
        check_config({**llama8b, "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}})


def test_llama3_frequencies_match_transformers_at_llama31_8b_size():
    """Llama 3.1's scaling (factor 8, low 1, high 4, original 8192, base 5e5) at its real
    head_dim."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                     rope_parameters=dict(rope))
    expected, expected_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    inv_freq, factor = M.rope_inv_freq(rope, 128)
    assert_close(inv_freq, expected, atol=0, name="llama3 inv_freq")
    assert factor == expected_factor == 1.0
    base = M.rope_inv_freq({"rope_type": "default", "rope_theta": 500000.0}, 128)[0]
    kept, divided = inv_freq == base, inv_freq == base / 8
    # all three bands occur
    assert kept.sum() > 10 and divided.sum() > 10 and (~kept & ~divided).sum() > 2


def test_yarn_frequencies_match_transformers_at_qwen3_8b_size():
    """The authors' setting (factor 4 over 32768, METHOD.md §9) at the real head_dim and base."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
            "rope_theta": 1e6}
    hf = Qwen3Config(head_dim=128, max_position_embeddings=131072, rope_parameters=dict(yarn))
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = M.ModelConfig.from_dict({"model_type": "qwen3", "head_dim": 128,
                                   "max_position_embeddings": 131072, "rope_theta": 1e6,
                                   "rope_scaling": {k: v for k, v in yarn.items()
                                                    if k != "rope_theta"}})
    inv_freq, factor = M.rope_inv_freq(cfg.rope["full_attention"], 128)
    assert_close(inv_freq, expected, atol=0, name="yarn inv_freq")
    assert factor == pytest.approx(expected_factor, abs=1e-12) and factor > 1.13  # 0.1 ln 4 + 1


# -- 2. cached decoding ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SAVED))
def test_greedy_decoding_matches_generate(name, checkpoints, oracle):
    folder = checkpoints(name)[0]
    model, hf = M.load_model(folder, "cpu", torch.float32), oracle(folder)
    ids = prompt(20, seed=1)  # longer than the window: decoding slides from the first step
    hf.generation_config.eos_token_id = None  # 32 tokens, no early stop
    with torch.no_grad():
        expected = hf.generate(ids[None], max_new_tokens=32, do_sample=False,
                               pad_token_id=0)[0, 20:]
        cache = KVCache(model.config, torch.float32, "cpu")
        token = model(ids, cache, num_logits=1)[-1].argmax()
        out = [int(token)]
        for _ in range(31):
            token = model(token[None], cache, num_logits=1)[-1].argmax()
            out.append(int(token))
    assert out == expected.tolist()
    assert len(set(out)) > 4, "degenerate oracle output: the test would prove little"


# -- 5. bad input ----------------------------------------------------------------------------------

def _one_line_error(fn, *needles):
    with pytest.raises(M.ModelError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_bad_folders(tmp_path):
    _one_line_error(lambda: load_checked(tmp_path / "nope", "cpu"), "not found")
    _one_line_error(lambda: resolve_model(str(tmp_path / "nope")), "not found")
    _one_line_error(lambda: load_checked(tmp_path, "cpu"), "no config.json")
    _one_line_error(lambda: resolve_model(tmp_path), "no config.json")
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64}))
    _one_line_error(lambda: load_checked(tmp_path, "cpu"), "unsupported model_type 'phi3'")
    _one_line_error(lambda: read_tokenizer(tmp_path), "no tokenizer.json")


def test_bad_weights(checkpoints, tmp_path):
    good = checkpoints("qwen3-gqa2-tied")[0]
    shutil.copytree(good, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # an interrupted download
    _one_line_error(lambda: load_checked(tmp_path / "m", "cpu"), "model.safetensors",
                    "truncated or corrupt")
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    _one_line_error(lambda: load_checked(tmp_path / "m", "cpu"), "truncated or corrupt")
    weights.unlink()
    _one_line_error(lambda: load_checked(tmp_path / "m", "cpu"), "no *.safetensors")
    shutil.copy(good / "model.safetensors", weights)  # weights of a 2-layer model, config says 3
    edit_config(tmp_path / "m", lambda d: {**d, "num_hidden_layers": 3, "layer_types": None})
    _one_line_error(lambda: load_checked(tmp_path / "m", "cpu"), "lacks")


def test_a_tensor_in_two_weight_files_is_refused(checkpoints, tmp_path):
    """model.py loads every file (the index's shards, else every *.safetensors) and the later one's
    tensors won, where transformers reads model.safetensors alone: a tensor in two files is refused
    in one line naming both, whether two whole checkpoints or two shards of one."""
    shutil.copytree(checkpoints("qwen3-gqa2-tied")[0], tmp_path / "two")
    other = checkpoints("llama-gqa2-tied")[0] / "model.safetensors"  # same names, other values
    shutil.copy(other, tmp_path / "two" / "model-finetuned.safetensors")
    _one_line_error(lambda: load_checked(tmp_path / "two", "cpu"), "model.embed_tokens.weight",
                    "in both model-finetuned.safetensors and model.safetensors")
    shutil.copytree(checkpoints("qwen3-gqa4-untied-sharded")[0], tmp_path / "shards")
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    name = next(k for k, f in index["weight_map"].items() if f == first)
    tensors = load_file(tmp_path / "shards" / second)
    tensors[name] = load_file(tmp_path / "shards" / first)[name] + 1
    save_file(tensors, tmp_path / "shards" / second, metadata={"format": "pt"})
    _one_line_error(lambda: load_checked(tmp_path / "shards", "cpu"), name,
                    f"in both {first} and {second}")


def test_a_json_key_given_twice_is_refused(checkpoints, tmp_path):
    """Python's json keeps the last of a key given twice, silently: config.json (top level or
    nested), generation_config.json, tokenizer_config.json and the shard index refuse it in one
    line naming the key."""
    shutil.copytree(checkpoints("qwen3-mqa-yarn")[0], tmp_path / "m")
    config, gen = tmp_path / "m" / "config.json", tmp_path / "m" / "generation_config.json"
    good = config.read_text()
    twice = lambda path, key, text: path.write_text(path.read_text().replace(
        f'"{key}":', f'"{key}": {text}, "{key}":', 1))
    twice(config, "num_hidden_layers", "1")
    _one_line_error(lambda: read_config(tmp_path / "m"), "config.json", "'num_hidden_layers'",
                    "given twice")
    config.write_text(good)
    twice(config, "factor", "8.0")  # inside rope_parameters
    _one_line_error(lambda: read_config(tmp_path / "m"), "config.json", "'factor' given twice")
    config.write_text(good)
    twice(gen, "eos_token_id", "7")
    _one_line_error(lambda: read_config(tmp_path / "m"), "generation_config.json",
                    "'eos_token_id' given twice")
    gen.unlink()
    (tmp_path / "m" / "tokenizer_config.json").write_text(
        '{"chat_template": "a", "chat_template": "b"}')
    _one_line_error(lambda: read_config(tmp_path / "m"), "tokenizer_config.json",
                    "'chat_template' given twice")
    shutil.copytree(checkpoints("qwen3-gqa4-untied-sharded")[0], tmp_path / "s")
    index = tmp_path / "s" / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"]["model.norm.weight"]
    twice(index, "lm_head.weight", json.dumps(shard))
    _one_line_error(lambda: load_checked(tmp_path / "s", "cpu"), "model.safetensors.index.json",
                    "'lm_head.weight' given twice")


@pytest.mark.parametrize("text", ["{not json", "[]", '{"metadata": {}}',
                                  '{"weight_map": ["a.safetensors"]}',
                                  '{"weight_map": {"lm_head.weight": 3}}'])
def test_unreadable_shard_index(checkpoints, tmp_path, text):
    """A model.safetensors.index.json that is not JSON, lacks weight_map or holds the wrong types:
    one line naming the index, not a JSONDecodeError, KeyError or AttributeError."""
    shutil.copytree(checkpoints("qwen3-gqa4-untied-sharded")[0], tmp_path / "m")
    (tmp_path / "m" / "model.safetensors.index.json").write_text(text)
    _one_line_error(lambda: load_checked(tmp_path / "m", "cpu"), "model.safetensors.index.json",
                    "re-download the model")


def test_bad_configs(checkpoints, tmp_path):
    """config.json that is not an object, holds values of the wrong type or sign, or whose sizes do
    not match the weights: one line naming the field, never a traceback or a silently different
    model."""
    good = checkpoints("qwen3-gqa2-tied")[0]
    shutil.copytree(good, tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    original = config.read_text()
    config.write_text("[1, 2, 3]")
    _one_line_error(lambda: load_checked(tmp_path / "m", "cpu"),
                    "config.json holds a JSON list, not an object")
    for key, value in (("hidden_size", "64"), ("num_attention_heads", -4),
                       ("num_key_value_heads", 2.5), ("max_position_embeddings", True),
                       ("rms_norm_eps", "small"), ("rope_theta", 0), ("eos_token_id", "2"),
                       ("rope_scaling", "yarn"), ("layer_types", "full_attention")):
        config.write_text(json.dumps({**json.loads(original), key: value}))
        _one_line_error(lambda: read_config(tmp_path / "m"), key)
    # shapes that parse but do not fit the weights: wider MLP, and more KV heads (so no "missing"
    # tensor)
    for key, value in (("intermediate_size", 96), ("num_key_value_heads", 4)):
        config.write_text(json.dumps({**json.loads(original), key: value}))
        _one_line_error(lambda: load_checked(tmp_path / "m", "cpu"), "has shape",
                        "config.json implies")
    config.write_text(original)
    assert load_checked(tmp_path / "m", "cpu") is not None
    assert load_checked(tmp_path / "m", "cpu:0") is not None  # the CPU by its index


# RoPE dicts as a tester writes them into config.json, each refused in one line naming its key:
# (the dict, words of the line). Before, the first ran as plain RoPE, -2 and inf as frequencies,
# and the strings ended in a TypeError inside model.rope_inv_freq.
ROPE_REFUSED = [
    ({"factor": 4}, ["rope_scaling", "'factor'", "no rope_type"]),
    ({"rope_type": "linear", "factor": -2}, ["rope_scaling.factor", "positive", "-2"]),
    ({"rope_type": "linear", "factor": 0}, ["rope_scaling.factor", "positive"]),
    ({"type": "linear", "factor": float("inf")}, ["rope_scaling.factor", "inf"]),
    ({"rope_type": "yarn", "factor": float("nan")}, ["rope_scaling.factor", "nan"]),
    ({"rope_type": "linear", "factor": "2"}, ["rope_scaling.factor", "'2'"]),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": "fast"},
     ["rope_scaling.beta_fast", "'fast'"]),
    ({**LLAMA3_RoPE, "low_freq_factor": "1"}, ["rope_scaling.low_freq_factor", "'1'"]),
    ({**LLAMA3_RoPE, "low_freq_factor": 4.0}, ["low_freq_factor < high_freq_factor"]),
    ({**QWEN_YARN, "original_max_position_embeddings": "16"},
     ["rope_scaling.original_max_position_embeddings", "'16'"]),
    ({**QWEN_YARN, "truncate": "no"}, ["rope_scaling.truncate", "'no'"]),
    ({**QWEN_YARN, "mscale": "1"}, ["rope_scaling.mscale", "'1'"]),
    ({"rope_type": "default", "partial_rotary_factor": 0.5},
     ["rope_scaling.partial_rotary_factor", "0.5"]),
    # positive, but the tables divide by zero (yarn's ramp by log(rope_theta)) or overflow float32
    # (NaN logits that named no cause)
    ({**QWEN_YARN, "rope_theta": 1}, ["rope_scaling.rope_theta 1", "divide by zero"]),
    ({"rope_type": "linear", "factor": 1e-300}, ["rope_scaling.factor 1e-300", "float32"]),
    ({**QWEN_YARN, "factor": 1e-300}, ["rope_scaling.factor 1e-300", "float32"]),
    ({**LLAMA3_RoPE, "factor": 1e-300}, ["rope_scaling.factor 1e-300", "float32"]),
    ({"rope_type": "default", "rope_theta": 1e-300}, ["rope_scaling.rope_theta 1e-300"]),
    ({**QWEN_YARN, "attention_factor": 1e30}, ["rope_scaling.attention_factor 1e+30"]),
    # yarn's attention factor divides by 0.1 * mscale_all_dim * ln(factor) + 1
    ({**QWEN_YARN, "factor": math.exp(10), "mscale": 1.0, "mscale_all_dim": -1.0},
     ["rope_scaling.mscale_all_dim -1.0", "divide by zero"]),
]


@pytest.mark.parametrize("scaling, words", ROPE_REFUSED)
def test_rope_dicts_are_checked_when_config_json_is_read(checkpoints, scaling, words):
    """The legacy rope_scaling beside rope_theta (released checkpoints) and the same dict as
    transformers-5's rope_parameters: one ModelError line naming the key."""
    d = json.loads((checkpoints("qwen3-gqa2-tied")[0] / "config.json").read_text())
    legacy = {**{k: v for k, v in d.items() if k != "rope_parameters"}, "rope_theta": 1e4,
              "rope_scaling": scaling}
    _one_line_error(lambda: check_config(legacy), *words)
    v5 = {**d, "rope_parameters": {"rope_theta": 1e4, **scaling}}
    _one_line_error(lambda: check_config(v5),
                    *[w.replace("rope_scaling", "rope_parameters") for w in words])


def test_rope_layouts_refused_beside_the_ones_that_run(checkpoints):
    """Gemma 3's per-layer-type dicts are checked each; a flat one (which model.py would have
    ignored), both rope_parameters and rope_scaling (transformers reads rope_scaling, model.py read
    rope_parameters) and a top-level partial_rotary_factor are refused; the released layouts
    still read."""
    gemma = json.loads((checkpoints("gemma3-mixed-softcap")[0] / "config.json").read_text())
    nested = {**GEMMA_RoPE, "full_attention": {"rope_theta": 1e6, "factor": 8.0}}
    _one_line_error(lambda: check_config({**gemma, "rope_parameters": nested}),
                    "rope_parameters.full_attention", "'factor'", "no rope_type")
    _one_line_error(lambda: check_config({**gemma, "rope_parameters": QWEN_YARN}),
                    "one object per layer type")
    qwen = json.loads((checkpoints("qwen3-gqa2-tied")[0] / "config.json").read_text())
    _one_line_error(lambda: check_config({**qwen, "rope_scaling": QWEN_YARN}),
                    "both rope_parameters and rope_scaling")
    _one_line_error(lambda: check_config({**qwen, "partial_rotary_factor": 0.5}),
                    "config.json: partial_rotary_factor is 0.5")
    check_config({**qwen, "partial_rotary_factor": 1.0})  # the whole head: what runs
    check_config({**qwen, "rope_scaling": qwen["rope_parameters"]})  # the same dict twice
    for name in ("qwen3-legacy-yarn", "llama-legacy-llama3", "gemma3-legacy"):
        read_config(checkpoints(name)[0])


def test_rope_bases_that_break_the_tables_are_named_where_they_are_given(checkpoints):
    """A top-level base (legacy configs: rope_theta beside rope_scaling, Gemma 3's
    rope_local_base_freq) that makes the tables divide by zero or overflow is named as the key it
    is; an odd head_dim (RoPE rotates pairs) is refused; bases that only look odd still read."""
    qwen = json.loads((checkpoints("qwen3-gqa2-tied")[0] / "config.json").read_text())
    legacy = {k: v for k, v in qwen.items() if k != "rope_parameters"}
    yarn = {k: v for k, v in QWEN_YARN.items() if k != "rope_theta"}  # the top-level base
    _one_line_error(lambda: check_config({**legacy, "rope_theta": 1, "rope_scaling": yarn}),
                    "config.json: rope_theta 1", "yarn", "divide by zero")
    _one_line_error(lambda: check_config({**legacy, "rope_theta": 1e-300}),
                    "config.json: rope_theta 1e-300", "float32")
    gemma = json.loads((checkpoints("gemma3-legacy")[0] / "config.json").read_text())
    _one_line_error(lambda: check_config({**gemma, "rope_local_base_freq": 1e-300}),
                    "config.json: rope_local_base_freq 1e-300", "sliding_attention")
    _one_line_error(lambda: check_config({**qwen, "head_dim": 15}), "head_dim 15", "even")
    llama = json.loads((checkpoints("llama-gqa2-tied")[0] / "config.json").read_text())
    _one_line_error(lambda: check_config({**llama, "head_dim": None, "hidden_size": 2}),
                    "head_dim 0", "> 0")  # hidden_size // num_attention_heads: 1 / 0 in attn_scale
    for theta in (1.0, 1e300):  # all frequencies 1, or all but the first 0: finite, as transformers
        check_config({**qwen, "rope_parameters": {"rope_type": "default", "rope_theta": theta}})


def _keys_read(fn) -> set[str]:
    """The config.json keys a function of model.py reads (d["key"], d.get("key"))."""
    return set(re.findall(r'\bd(?:\[|\.get\()"(\w+)"', inspect.getsource(fn)))


@pytest.mark.parametrize("name", ["qwen3-gqa2-tied", "gemma3-mixed-softcap"])
def test_every_number_and_flag_model_py_reads_is_type_checked(checkpoints, name):
    """Every key ModelConfig.from_dict and model.rope_parameters read whose value is a number or a
    flag (found in their source, so a key added later is covered): given as a string, or a number
    as a flag (bool is not an int, "false" is truthy), it is refused in one line naming it."""
    d = json.loads((checkpoints(name)[0] / "config.json").read_text())
    arch, full = M.config_keys(d)
    absent = {"original_max_position_embeddings": 16, "_sliding_window_pattern": 6,
              "use_sliding_window": False, "use_bidirectional_attention": False,
              "max_window_layers": 1, "sliding_window": 8, "bos_token_id": 1}
    keys = _keys_read(M.ModelConfig.from_dict) | _keys_read(M.rope_parameters)
    typed = {k: full.get(k, absent.get(k)) for k in keys}
    typed = {k: v for k, v in typed.items() if isinstance(v, (bool, int, float))}
    assert {"vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
            "original_max_position_embeddings"} <= set(typed), sorted(typed)
    for key, value in typed.items():
        for wrong in ("2", 1 if isinstance(value, bool) else True):
            _one_line_error(lambda: check_config({**d, key: wrong}), key)


@pytest.mark.parametrize("dtype, stored", [(torch.int8, "I8"), (torch.bool, "BOOL"),
                                           (torch.int32, "I32"), (torch.uint8, "U8"),
                                           (torch.float8_e4m3fn, "F8_E4M3")])
def test_integer_and_quantised_weights_are_refused(checkpoints, tmp_path, dtype, stored):
    """A weight stored as an integer, bool or 8-bit float tensor was cast to float and ran with
    wrong answers: its scales (a quantised checkpoint's other tensors) are not read. Refused from
    the header, naming the tensor."""
    shutil.copytree(checkpoints("llama-gqa2-tied")[0], tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    _one_line_error(lambda: load_checked(tmp_path / "m", "cpu"), name, stored,
                    "quantised or integer")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_when_they_load(checkpoints, tmp_path, value):
    """NaN / inf in a weight ended in "activations overflowed torch.float32; use --dtype float32"
    mid-answer: found as the weights load, naming the tensor, and no wider dtype advised for a
    float32 run."""
    shutil.copytree(checkpoints("qwen3-gqa2-tied")[0], tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name][3, 5] = value
    save_file(tensors, str(path), metadata={"format": "pt"})
    _one_line_error(lambda: load_checked(tmp_path / "m", "cpu", torch.float32), name, "inf/NaN",
                    "re-download")
    with pytest.raises(M.ModelError) as e:
        load_checked(tmp_path / "m", "cpu", torch.float32)
    assert "--dtype" not in str(e.value), e.value


def test_non_finite_logits_advise_only_a_wider_dtype(checkpoints, tmp_path):
    """The model that load_model loads unchecked (the library) with a NaN weight: the answer stops
    on non-finite logits saying so, in the dtype it ran in, with no advice to use that dtype."""
    from generate import answer, prefill
    shutil.copytree(checkpoints("qwen3-gqa2-tied")[0], tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    model = M.load_model(tmp_path / "m", "cpu", torch.float32)
    cache = KVCache(model.config, torch.float32)
    with torch.no_grad(), pytest.raises(M.ModelError) as e:
        last = prefill(model, cache, [2, 10, 11, 12], 1)
        answer(model, cache, [], 3, set(), last_logits=last)
    msg = str(e.value)
    assert "inf/NaN" in msg and "torch.float32" in msg and "--dtype" not in msg, msg


def test_parse_device():
    assert parse_device("cpu") == torch.device("cpu") and parse_device(None) == M.default_device()
    _one_line_error(lambda: parse_device("foo"), "--device 'foo' is not a device")
    _one_line_error(lambda: parse_device("meta"), "only cpu and cuda")
    # torch takes cpu:N; safetensors refused it: "corrupt safetensors file ... re-download it"
    _one_line_error(lambda: parse_device("cpu:1"), "--device cpu:1", "use --device cpu")
    assert parse_device("cpu:0") == torch.device("cpu")
    if not torch.cuda.is_available():
        _one_line_error(lambda: parse_device("cuda"), "CUDA is not available")
    _one_line_error(lambda: parse_device(f"cuda:{torch.cuda.device_count()}"), "--device cuda:")


def test_unreachable_hub_is_a_one_line_error(monkeypatch):
    import huggingface_hub.constants

    # never touch the network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _one_line_error(lambda: resolve_model("nobody-here/no-such-model-xyz"),
                    "nobody-here/no-such-model-xyz")
    _one_line_error(lambda: resolve_model("not a repo id"), "not found")


def test_resolve_model_routes(checkpoints, monkeypatch, tmp_path):
    import sys
    import types

    folder = checkpoints("qwen3-gqa2-tied")[0]
    assert resolve_model(str(folder)) == folder
    # offline/models.py converts
    fake = types.SimpleNamespace(ensure_offline_model=lambda name: tmp_path / name)
    import offline
    monkeypatch.setitem(sys.modules, "offline.models", fake)
    monkeypatch.setattr(offline, "models", fake, raising=False)
    assert resolve_model("gemma3-270m-gguf") == tmp_path / "gemma3-270m-gguf"
    assert resolve_model("SmolLM2-135M-gguf") == tmp_path / "smollm2-135m-gguf"
    (tmp_path / "weights.bin").write_text("x")
    _one_line_error(lambda: resolve_model(tmp_path / "weights.bin"), "is a file")


# -- tokenizer / prompt helpers --------------------------------------------------------------------

def test_prompt_formats_are_method_4_1():
    qwen = M.ModelConfig.from_dict({"model_type": "qwen3"})
    gemma = M.ModelConfig.from_dict({"model_type": "gemma3_text"})
    task = "Given the context, answer to the following question or request without explanation.\n\n"
    f = prompt_format(qwen, "qwen3-8b")
    assert (
        f.system
        == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + task)
    assert f.postfix == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert (prompt_format(qwen, "Qwen/Qwen3-8B", thinking=True).postfix
            == "<|im_end|>\n<|im_start|>assistant\n")
    assert (prompt_format(qwen, "Qwen/Qwen3-4B-Instruct-2507").postfix
            == "<|im_end|>\n<|im_start|>assistant\n")
    g = prompt_format(gemma, "gemma3-12b", task="gsm8k")
    assert g.system == ("<bos><start_of_turn>user\nYou are a helpful assistant.\n\n"
                        "Given the context, answer to the following reasoning question.\n\n")
    assert g.postfix == "<end_of_turn>\n<start_of_turn>model\n"
    assert prompt_format(gemma, "x", chat=False) == PromptFormat("<bos>", "")
    assert prompt_format(qwen, "x", chat=False) == PromptFormat("", "")
    # end-of-turn stops chat models
    assert 106 in gemma.eos_token_ids and 151645 in qwen.eos_token_ids
    assert (ALIASES["qwen3-0.6b"] == "Qwen/Qwen3-0.6B" and ALIASES["gemma3-270m"]
            == "google/gemma-3-270m-it")
    # Qwen2.5 (no thinking switch, even without "instruct" in the name) and LLaMA-3 (METHOD.md §4.1)
    qwen25 = M.ModelConfig.from_dict({"model_type": "qwen2"})
    assert (prompt_format(qwen25, "qwen2.5-7b-1m")
            == prompt_format(qwen, "Qwen/Qwen3-4B-Instruct-2507"))
    llama = M.ModelConfig.from_dict({"model_type": "llama"})
    f = prompt_format(llama, "llama3.1-8b")
    assert (f.system == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are "
                         "a helpful "
                         "assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n" + task))
    assert f.postfix == "\n\n<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert prompt_format(llama, "x", chat=False) == PromptFormat("<|begin_of_text|>", "")
    assert ALIASES["qwen2.5-14b-1m"] == "Qwen/Qwen2.5-14B-Instruct-1M"
    assert ALIASES["llama3.1-8b"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_the_tokenizer_template_decides_the_prompt(checkpoints, tmp_path):
    """A Llama whose tokenizer writes ChatML (SmolLM2) gets the authors' ChatML (Qwen) prompt,
    without the Qwen3 thinking switch; its family's LLaMA-3 layout only when the folder has no
    template."""
    shutil.copytree(checkpoints("llama-gqa2-tied")[0], tmp_path / "m")
    chatml = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
              "'<|im_end|>\n'}}{% endfor %}")
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"chat_template": chatml}))
    cfg = M.ModelConfig.from_json(tmp_path / "m")
    assert cfg.arch == "llama" and cfg.chat_format == "chatml"
    qwen = M.ModelConfig.from_dict({"model_type": "qwen3"})
    assert (prompt_format(cfg, "smollm2-135m-gguf")
            == prompt_format(qwen, "Qwen/Qwen3-4B-Instruct-2507"))
    assert prompt_format(cfg, "smollm2-135m-gguf", chat=False) == PromptFormat("", "")
    (tmp_path / "m" / "tokenizer_config.json").unlink()  # newer repos: chat_template.jinja
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ '<|start_header_id|>' + m['role'] }}")
    assert M.ModelConfig.from_json(tmp_path / "m").chat_format == "llama3"


def test_a_tokenizer_without_a_chat_template_is_a_base_model(checkpoints, tmp_path):
    """What the model is decides whether prompts use a chat template, not the name it is given by:
    a tokenizer_config.json without a template is a base model's (the offline Gemma 3 270M's),
    prompted without one unless --chat; a folder without tokenizer_config.json keeps the template,
    as before."""
    shutil.copytree(checkpoints("llama-gqa2-tied")[0], tmp_path / "m")
    cfg = M.ModelConfig.from_json(tmp_path / "m")
    assert cfg.chat_template is None and uses_chat(cfg)
    config = json.dumps({"bos_token": "<|begin_of_text|>"})
    (tmp_path / "m" / "tokenizer_config.json").write_text(config)
    cfg = M.ModelConfig.from_json(tmp_path / "m")
    assert cfg.chat_template is False and not uses_chat(cfg) and uses_chat(cfg, chat=True)
    assert prompt_format(cfg, "llama3.1-8b") == PromptFormat("<|begin_of_text|>", "")
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ '<|im_start|>' + m['role'] }}")
    cfg = M.ModelConfig.from_json(tmp_path / "m")
    assert cfg.chat_template is True and uses_chat(cfg) and not uses_chat(cfg, chat=False)
    assert "chat_template.jinja" in _HUB_FILES  # downloaded, so that a model's template is seen


def test_prompt_pieces_tokenize_to_the_special_tokens():
    """With the published tokenizers, the written-out templates hit the real special-token ids."""
    from tests.assets import require_asset

    # <bos><start_of_turn>
    pieces = {"gemma3": ("gemma3_text", "gemma3-1b", [2, 105], [106, 107, 105, 4368, 107]),
              "qwen3": ("qwen3", "qwen3-8b", [151644], [151645, 198, 151644, 77091, 198, 151667,
                                                        271, 151668, 271])}
    for name, (model_type, alias, head, postfix) in pieces.items():
        tok = M.load_tokenizer(require_asset("tokenizers", name))
        fmt = prompt_format(M.ModelConfig.from_dict({"model_type": model_type}), alias)
        assert encode_prompt(tok, fmt.system)[:len(head)] == head
        assert encode_prompt(tok, fmt.postfix) == postfix
        assert question_ids(tok, fmt, "Who?")[-len(postfix):] == postfix


@pytest.mark.parametrize("text,words", [
    # cut short: read as "no template", it gave the LLaMA-3 layout
    ('{"chat_template": 5', "is not valid JSON"),
    ('{"chat_template": 5}', "chat_template is a string"),
    ('["chat_template"]', "expected an object"),
    (b'{"chat_template": "\xff"}', "is not valid JSON"),
])
def test_unreadable_tokenizer_config_is_refused(checkpoints, tmp_path, text, words):
    """The tokenizer's template decides the prompt layout: a tokenizer_config.json that cannot be
    read is refused, not taken for a folder without a template."""
    shutil.copytree(checkpoints("llama-gqa2-tied")[0], tmp_path / "m")
    path = tmp_path / "m" / "tokenizer_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    _one_line_error(lambda: read_config(tmp_path / "m"), "tokenizer_config.json", words)


def test_unreadable_model_folder_and_foreign_tokenizer(checkpoints, tmp_path):
    """A model inside a folder this user may not read: one ModelError line (pathlib raises
    PermissionError). A tokenizer with more ids than the model's vocab_size (Gemma's beside a
    384-token model) is refused when loaded, instead of an IndexError in the embedding."""
    from tests.helpers import no_access
    shutil.copytree(checkpoints("llama-gqa2-tied")[0], tmp_path / "locked" / "m")
    with no_access(tmp_path / "locked", 0o000):
        _one_line_error(lambda: resolve_model(tmp_path / "locked" / "m"), "cannot read",
                        "Permission denied")
        _one_line_error(lambda: read_config(tmp_path / "locked" / "m"), "cannot read")
        _one_line_error(lambda: read_tokenizer(tmp_path / "locked" / "m"), "cannot read")
    shutil.copy(resolve_model(OFFLINE_DEFAULT) / "tokenizer.json", tmp_path / "locked" / "m")
    cfg = read_config(tmp_path / "locked" / "m")
    _one_line_error(lambda: read_tokenizer(tmp_path / "locked" / "m", cfg), "262144 token ids",
                    f"vocab_size {cfg.vocab_size}")
    own = resolve_model(OFFLINE_DEFAULT)
    assert read_tokenizer(own, read_config(own)).get_vocab_size() == 262144  # it fits


def overflowing_gemma3(folder):
    """A tiny Gemma3 whose residual stream grows layer by layer as the real one's does, past
    float16's 65504 (post-feedforward norms of weight 1 + 3e4: each block adds ~3e4 to the
    stream)."""
    tiny_checkpoint("gemma3", folder)
    model = M.load_model(folder, "cpu", torch.float32)
    with torch.no_grad():
        for block in model.model.layers:
            block.post_feedforward_layernorm.weight.fill_(3e4)
    return model


def test_gemma3_in_float16_overflows_and_is_refused(tmp_path):
    """Gemma 3's activations outgrow float16 (the real 270M passes 65504 at layer 7 of 18): the
    output turns to NaN, whose argmax is token 0. load_checked refuses float16 for Gemma 3, naming
    the dtypes that work."""
    model = overflowing_gemma3(tmp_path / "g")
    ids = torch.tensor([2, 10, 11, 12])
    assert torch.isfinite(model(ids)).all()  # fp32: fine
    half = model.half()
    logits = half(ids, KVCache(half.config, torch.float16))
    # what --dtype float16 answered
    assert not torch.isfinite(logits).any() and int(logits[-1].argmax()) == 0
    _one_line_error(lambda: load_checked(tmp_path / "g", "cpu", torch.float16), "float16",
                    "bfloat16 or float32")
    M.load_model(tmp_path / "g", "cpu", torch.bfloat16)  # bfloat16 has float32's range
