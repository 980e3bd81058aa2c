"""harness/kvpress_prompt.py and the RULER prompt modes: the ids a row is fed as equal sequences
built by hand from the literal strings kvpress's pipeline renders (Qwen3 hybrid, Gemma 3, a model
without a template), and kvpress's preprocess itself run with transformers' apply_chat_template on
the real templates; RULER rows split where kvpress's file splits them."""
import json
import re

import pytest

from cli import UsageError
from harness import ruler, ruler_tasks
from harness.kvpress_prompt import N_SINK, KvpressFormat, kvpress_format
from model import ModelConfig, chat_template, load_tokenizer
from prompts import prompt_format
from tests.assets import require_asset

# a context with leading whitespace (Gemma's template trims it) and the text of control tokens,
# which stays text
CONTEXT = ("  \nA special magic number is hidden within the following text.\n"
           "One of the special magic numbers for quiet-river is: 4711. <|im_end|><end_of_turn>\n")
ROW = dict(context=CONTEXT, question="What is the special magic number for quiet-river? ",
           answer_prefix="The special magic number for quiet-river is", answer=["4711"],
           max_new_tokens=8, task="niah_single_1")


def published(name):
    folder = require_asset("tokenizers", name)
    return folder, load_tokenizer(folder)


def fed(tok, fmt, row=ROW):
    """(context ids, n_protected, question ids) of one row, as the RULER run feeds them."""
    (sample,) = ruler.to_samples(tok, fmt, [row])
    (question,) = sample.questions
    return sample.ids, sample.n_protected, question.prompt


def pieces(tok, *parts):
    """Ids from literal pieces: a str is encoded as plain text, a 1-tuple names a control token."""
    ids = []
    for p in parts:
        ids += [tok.token_to_id(p[0])] if isinstance(p, tuple) else \
            tok.encode(p, add_special_tokens=False).ids
    return ids


def plain(tok, text):
    """Text with control-token look-alikes encoded as their characters (user text)."""
    was, tok.encode_special_tokens = tok.encode_special_tokens, True
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = was


def test_qwen3_hybrid_is_one_user_turn_with_the_empty_thought():
    folder, tok = published("qwen3")
    fmt = kvpress_format(ModelConfig.from_dict({"model_type": "qwen3"}), "Qwen/Qwen3-8B",
                         template=chat_template(folder))
    ids, n_protected, question = fed(tok, fmt)
    assert ids == [tok.token_to_id("<|im_start|>")] + plain(tok, "user\n" + CONTEXT)
    assert n_protected == N_SINK == 4
    assert question == pieces(tok, ROW["question"], ("<|im_end|>",), "\n", ("<|im_start|>",),
                              "assistant\n", ("<think>",), "\n\n", ("</think>",),
                              "\n\n" + ROW["answer_prefix"])
    # the template's name rule when its text is not at hand; Instruct-2507 has no thought
    cfg = ModelConfig.from_dict({"model_type": "qwen3"})
    assert kvpress_format(cfg, "qwen3-8b") == fmt
    assert "<think>" not in kvpress_format(cfg, "Qwen/Qwen3-4B-Instruct-2507").postfix


def test_gemma3_chat_trims_the_context_and_writes_no_system_turn():
    folder, tok = published("gemma3")
    fmt = kvpress_format(ModelConfig.from_dict({"model_type": "gemma3_text"}), "gemma3-12b",
                         template=chat_template(folder))
    ids, n_protected, question = fed(tok, fmt)
    assert ids == pieces(tok, ("<bos>",), ("<start_of_turn>",)) + plain(tok, "user\n"
                                                                       + CONTEXT.lstrip())
    assert n_protected == 4
    assert question == pieces(tok, ROW["question"], ("<end_of_turn>",), "\n", ("<start_of_turn>",),
                              "model\n" + ROW["answer_prefix"])


def test_no_template_is_bos_and_context_then_a_newline_before_the_prefix():
    from offline import models
    folder = models.ensure_offline_model()  # Gemma 3 base: its tokenizer has no template
    cfg, tok = ModelConfig.from_json(folder), load_tokenizer(folder)
    assert cfg.chat_template is False
    ids, n_protected, question = fed(tok, kvpress_format(cfg, str(folder)))
    assert ids == [tok.token_to_id("<bos>")] + plain(tok, CONTEXT) and n_protected == 4
    assert question == pieces(tok, ROW["question"] + "\n" + ROW["answer_prefix"])
    # SmolLM2 read as plain text (--no-chat): a ChatML tokenizer has no BOS text to write
    smol = models.ensure_offline_model(models.SMOLLM2)
    tok = load_tokenizer(smol)
    ids, _, question = fed(tok, kvpress_format(ModelConfig.from_json(smol), "x", chat=False))
    assert ids == plain(tok, CONTEXT)
    assert question == pieces(tok, ROW["question"] + "\n" + ROW["answer_prefix"])


def kvpress_preprocess(hf, context, question, prefix):
    """kvpress's pipeline preprocess, run with transformers (its logic restated): the context in
    one user turn cut at a separator after it, or BOS + context and "\\n" without a template."""
    if hf.chat_template is None:
        context, suffix = (hf.bos_token or "") + context, "\n"
    else:
        cut = "#" * (len(context) + 10)
        text = hf.apply_chat_template([{"role": "user", "content": context + cut}],
                                      add_generation_prompt=True, tokenize=False,
                                      enable_thinking=False)
        context, suffix = text.split(cut)
    encode = lambda s: hf.encode(s, add_special_tokens=False)
    return encode(context), encode(question + suffix + prefix)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "smollm2", "gemma3-base", "llama3_1"])
def test_same_ids_as_kvpress_with_transformers_templates(name):
    transformers = pytest.importorskip("transformers")
    from offline import models
    if name in ("smollm2", "gemma3-base"):  # the offline models' folders, read as bench reads them
        folder = models.ensure_offline_model(models.SMOLLM2 if name == "smollm2" else models.NAME)
        cfg = ModelConfig.from_json(folder)
    else:
        folder = require_asset("tokenizers", name)
        cfg = ModelConfig.from_dict({"model_type": dict(qwen3="qwen3", gemma3="gemma3_text",
                                                        llama3_1="llama")[name]})
    template = chat_template(folder) or None
    config = json.loads((folder / "tokenizer_config.json").read_text())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                              chat_template=template,
                                              bos_token=config.get("bos_token"))
    tok = load_tokenizer(folder)
    fmt = kvpress_format(cfg, str(folder), template=template)
    # kvpress's tokenizer call would turn "<|im_end|>" in the context into a control id: not here
    row = dict(ROW, context=CONTEXT.replace("<|im_end|><end_of_turn>", ""))
    ids, _, question = fed(tok, fmt, row)
    if name == "smollm2":  # its template writes a default system turn
        assert fmt.system.startswith("<|im_start|>system\nYou are a helpful AI assistant named "
                                     "SmolLM, trained by Hugging Face<|im_end|>\n")
    assert (ids, question) == kvpress_preprocess(hf, row["context"], row["question"],
                                                 row["answer_prefix"])


def test_llama3_layouts():
    cfg = ModelConfig.from_dict({"model_type": "llama"})
    f31 = kvpress_format(cfg, "llama3.1-8b", template="... Cutting Knowledge Date ...")
    assert f31.system == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                          "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
                          "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n")
    assert f31.postfix == "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n" and f31.trim
    f30 = kvpress_format(cfg, "x", template="{{ bos_token }}<|start_header_id|>...")
    assert f30.system == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    assert kvpress_format(cfg, "x", chat=False) == KvpressFormat("<|begin_of_text|>", "\n")


# kvpress's RULER file: the question starts at the last question pattern, the answer prefix at the
# first answer pattern after it (NVIDIA/kvpress:evaluation/benchmarks/ruler/
# create_huggingface_dataset.py, restated)
QUESTION_AT = dict(niah=r"What (?:is|are all) the special magic",
                   vt=r"Question: Find all variables that are assigned the value",
                   cwe=r"Question: What are the 10 most common words in the above list\?",
                   fwe=r"Question: Do not provide any explanation\.")
ANSWER_AT = dict(niah="The special magic", vt="Answer:", cwe="Answer:", fwe="Answer:")


@pytest.mark.parametrize("task", ruler_tasks.TASKS)
def test_generated_rows_split_as_kvpress_splits_them(task):
    require_asset("austen")
    row = ruler_tasks.make_row(task, 0, 0, 5, 4096)
    text = row["context"] + row["question"] + row["answer_prefix"]
    family = ruler_tasks.family(task)
    at = list(re.finditer(QUESTION_AT[family], text))[-1].start()
    qa = text[at:]
    cut = re.search(ANSWER_AT[family], qa).start()
    assert (text[:at], qa[:cut], qa[cut:]) == (row["context"], row["question"],
                                               row["answer_prefix"])
    assert row["question"].endswith(" ") and not row["answer_prefix"].startswith(" ")


def test_check_fit_counts_what_is_fed_and_the_key_names_the_prompt():
    folder, tok = published("qwen3")
    cfg = ModelConfig.from_dict({"model_type": "qwen3"})
    kv = kvpress_format(cfg, "Qwen/Qwen3-8B", template=chat_template(folder))
    harness = prompt_format(cfg, "Qwen/Qwen3-8B")
    for fmt in (kv, harness):
        ids, _, question = fed(tok, fmt)
        n = len(ids) + len(question) + ROW["max_new_tokens"]
        ruler.check_fit(tok, fmt, [("row 1", ROW)], n)
        with pytest.raises(ruler.DatasetError, match=f"= {n} tokens"):
            ruler.check_fit(tok, fmt, [("row 1", ROW)], n - 1)
    # the harness's layout protects its whole system prompt, kvpress's only the sink tokens
    assert fed(tok, harness)[1] > 20 and fed(tok, kv)[1] == 4

    from harness.quality import Experiment
    exp = Experiment(["full"], [0.5], [], [4096], 1, 0, 0, 0, 0, 0, 16384, 4096, 0,
                     suite="ruler", ruler_tasks=("fwe",))
    config = dict(model=dict(sha256="m"), gate=dict(sha256="g"))
    keys = [ruler.run_key(Experiment(**dict(vars(exp), ruler_prompt=p)), config)
            for p in ("kvpress", "harness")]
    assert keys[0]["prompt"] == "kvpress" and keys[0] != keys[1]


def test_generated_samples_longer_than_the_models_positions_are_refused():
    """RULER's sizing counts Llama-3.1's tokens: a model whose tokenizer makes more of the same text
    (cwe costs Qwen3 about 5.2K tokens at --lengths 4096) must be told before, or as, it runs."""
    folder, tok = published("qwen3")
    require_asset("austen")
    cfg = ModelConfig.from_dict({"model_type": "qwen3"})
    fmt = kvpress_format(cfg, "Qwen/Qwen3-8B", template=chat_template(folder))
    row = ruler.sample_at(tok, [4096], 1, 42, ["cwe"], 0)
    ids, _ = ruler.context_ids(tok, fmt, row["context"])
    n = len(ids) + len(ruler.turn_ids(tok, fmt, row)) + row["max_new_tokens"]
    assert n > 4096  # the point of the check: the target is in another tokenizer's tokens
    ruler.check_generated(tok, fmt, [4096], ["cwe"], 42, "ruler", n)
    with pytest.raises(UsageError, match=f"RULER cwe at --lengths 4096: .* = {n} tokens exceeds "
                       f"the model's maximum of {n - 1}; lower --lengths"):
        ruler.check_generated(tok, fmt, [4096], ["cwe"], 42, "ruler", n - 1)
