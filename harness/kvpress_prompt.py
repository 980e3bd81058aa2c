"""
kvpress's prompt, written out for each chat layout, so that a RULER row reaches the model as
kvpress's leaderboard feeds it (NVIDIA/kvpress:kvpress/pipeline.py,
KVPressTextGenerationPipeline.preprocess):

  * with a chat template: ONE user turn holding the context, rendered with the model's template
    (add_generation_prompt, enable_thinking=False) and cut right after the context. What comes
    before the cut (the template's opening, any default system turn it writes, the context) is the
    context, compressed as a whole, template tokens included; each question is fed as
    question + the rest of the text (end of turn, the model's header, Qwen3's empty thought) +
    answer prefix.
  * without one: the tokenizer's BOS text + context; each question as question + "\\n" + answer
    prefix.

Nothing is protected from eviction but what kvpress's presses keep themselves: the first N_SINK
tokens (FastKVzipPress.n_sink, KVzipPress.n_sink). FastKVzipPress also keeps the context's last 2%
(window_ratio), which is the eviction window here too (cache.plan_prefill, a context shorter than
one prefill chunk).

There is no jinja at run time: each layout below is what the model's template writes for that one
turn, checked against transformers' apply_chat_template on the real templates
(tests/test_ruler_prompt.py). One difference is kept on purpose: kvpress's tokenizer call turns the
text of a control token inside the context ("<|im_end|>") into the control id; here user text stays
text (prompts.encode_text).
"""
import re
from dataclasses import dataclass

from model import ModelConfig
from prompts import PromptFormat, encode_prompt, uses_chat

N_SINK = 4  # kvpress's FastKVzipPress and KVzipPress keep the first 4 tokens: attention sinks

# the tokenizer's bos_token, which kvpress writes before a context without a chat template
# (Qwen's tokenizers have none)
BOS_TEXT = {"gemma": "<bos>", "llama3": "<|begin_of_text|>"}
# Llama 3.1's template always opens with a system turn dated by its fallback date_string (3.2's
# writes the day's date, strftime_now: kvpress's prompt for it changes daily; this one does not)
LLAMA31_SYSTEM = ("<|start_header_id|>system<|end_header_id|>\n\n"
                  "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>")
# a ChatML template's default system turn, written when the messages bring none: SmolLM2's "You are
# a helpful AI assistant named SmolLM, ...", Qwen2.5's "You are Qwen, ..." (Qwen3's has none); the
# template writes "\n" as a character or as jinja's escape
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^'\"<>{}\\]+)<\|im_end\|>")


@dataclass
class KvpressFormat(PromptFormat):
    """kvpress's layout. system: what the template writes before the context, compressed with it
    (not a protected system prompt); postfix: what follows each question, before the answer
    prefix (also the end of KVzip's repeat instruction, as in kvpress's KVzipPress)."""
    trim: bool = False  # the template strips the context's leading whitespace (jinja's `| trim`)


def default_system(template: str) -> str | None:
    """The default system message a ChatML template writes out, or None."""
    m = _DEFAULT_SYSTEM.search(template)
    return m and m.group(1)


def kvpress_format(cfg: ModelConfig, name: str, chat: bool | None = None,
                   template: str | None = None) -> KvpressFormat:
    """kvpress's layout for this model. chat: as prompts.uses_chat (--chat / --no-chat; a base
    model has no template). template: the tokenizer's chat template text (model.chat_template),
    read for what templates of one layout do differently (a default system turn, Qwen3's
    enable_thinking, Llama 3.0's missing system turn); None or "": judged by `name` as
    prompts.prompt_format judges it."""
    if not uses_chat(cfg, chat):
        return KvpressFormat(BOS_TEXT.get(cfg.chat_format, ""), "\n")
    if cfg.chat_format == "gemma":  # {{ bos_token }}; a system turn only when one is given
        return KvpressFormat("<bos><start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n",
                             trim=True)
    if cfg.chat_format == "llama3":
        system = LLAMA31_SYSTEM if not template or "Cutting Knowledge Date" in template else ""
        return KvpressFormat(
            "<|begin_of_text|>" + system + "<|start_header_id|>user<|end_header_id|>\n\n",
            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", trim=True)
    default = default_system(template or "")
    system = "" if default is None else f"<|im_start|>system\n{default}<|im_end|>\n"
    # hybrid Qwen3: enable_thinking=False writes an empty thought (Qwen3-*-Instruct-2507: no switch)
    thinks = ("enable_thinking" in template if template else
              cfg.arch == "qwen3" and "instruct" not in str(name).lower())
    return KvpressFormat(system + "<|im_start|>user\n",
                         "<|im_end|>\n<|im_start|>assistant\n" + "<think>\n\n</think>\n\n" * thinks)


def context_ids(tok, fmt: KvpressFormat, context: str) -> list[int]:
    """What kvpress compresses: the template's opening and the context, encoded as one text (the
    opening's last text and the context's first characters may share a token, as in kvpress);
    control ids only where the template writes them."""
    return encode_prompt(tok, fmt.system + "{context}",
                         context=context.lstrip() if fmt.trim else context)
