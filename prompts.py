"""
The prompt formats and user text as token ids (METHOD.md §4.1).

A prompt is the authors' layout for the model's chat format (prompt_format: a system prompt before
the context, never evicted, and a postfix that closes the user turn), written out from
Janghyun1230/FastKVzip:prefill/model/template.py, or the bare BOS for a base model (METHOD.md §13).
User text is data: a context, a question, a --batch request or a training document is encoded with
the tokenizer's special tokens unparsed (encode_text), so its text "<|im_end|>" stays characters;
only a template's own control tokens become control ids (encode_prompt). question_ids writes the
turn that follows a compressed context; one_line ends a base model's one-line answer. check_ids
refuses ids that are no token of the model (generate.prefill and answer call it).
"""
import re
from dataclasses import dataclass

import torch

from kernels import ArgumentError
from model import ModelConfig, ModelError


def encode_text(tok, text: str) -> list[int]:
    """User text (a context, a question, a training document) -> token ids, never a control id: the
    text "<|im_end|>" or "<end_of_turn>" is encoded as the characters it is made of."""
    if not any(c in text for c in _plain_controls(tok)):
        # for this call only: the tokenizer object stays as tokenizers made it
        was, tok.encode_special_tokens = tok.encode_special_tokens, True
        try:
            return tok.encode(text, add_special_tokens=False).ids
        finally:
            tok.encode_special_tokens = was
    # Qwen3's <think> and </think> are added tokens not flagged special, which encode_special_tokens
    # still parses: such a text goes through the tokenizer's stages without its added vocabulary
    s = tok.normalizer.normalize_str(text) if tok.normalizer else text
    pieces = tok.pre_tokenizer.pre_tokenize_str(s) if tok.pre_tokenizer else [(s, None)]
    return [t.id for piece, _ in pieces for t in tok.model.tokenize(piece)]


def _plain_controls(tok) -> tuple[str, ...]:
    """The templates' control tokens that this tokenizer has as added tokens not flagged special."""
    if not hasattr(tok, "fastkvzip_plain_controls"):  # looked up once per tokenizer
        tok.fastkvzip_plain_controls = tuple(
            t.content for t in tok.get_added_tokens_decoder().values()
            if not t.special and t.content in CONTROL_TOKENS)
    return tok.fastkvzip_plain_controls


def encode_prompt(tok, template: str, **texts: str) -> list[int]:
    """A prompt -> token ids. The template's control tokens (<bos>, <|im_end|>, <think>: _CONTROL)
    become their ids; the text between them, with the user texts `texts` filled into its {name}
    fields after the split (so user text never makes a control id), is encoded by encode_text, as
    one encode of the whole string would. A tokenizer without one of the template's control tokens
    is another model's."""
    ids = []
    for i, piece in enumerate(_CONTROL.split(template)):  # text, control, text, ..., text
        if i % 2 == 0:
            ids += encode_text(tok, piece.format(**texts)) if piece else []
            continue
        control = tok.token_to_id(piece)
        if control is None:
            raise ModelError(f"the tokenizer has no {piece} token, which this model's prompt "
                             f"template writes: another model's tokenizer; put the model's own "
                             f"tokenizer.json in the folder")
        ids.append(control)
    return ids


@dataclass
class PromptFormat:
    # template prefix + task sentence: prepended to the context, never evicted (METHOD.md §4.4)
    system: str
    postfix: str  # end of the user turn + start of the model's turn


# METHOD.md §4.1 (Janghyun1230/FastKVzip:prefill/model/template.py), written out
_TASK = "Given the context, answer to the following question or request without explanation.\n\n"
_TASK_GSM = "Given the context, answer to the following reasoning question.\n\n"
_QWEN_PREFIX = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
_QWEN_POSTFIX = "<|im_end|>\n<|im_start|>assistant\n"
_QWEN_NO_THINK = "<think>\n\n</think>\n\n"  # an empty thought: hybrid Qwen3 answers directly
_GEMMA_PREFIX = "<bos><start_of_turn>user\nYou are a helpful assistant.\n\n"
_GEMMA_POSTFIX = "<end_of_turn>\n<start_of_turn>model\n"
_LLAMA3_PREFIX = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a "
                  "helpful assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n")
_LLAMA3_POSTFIX = "\n\n<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
# written by the template, not the tokenizer
_BOS_TEXT = {"gemma": "<bos>", "llama3": "<|begin_of_text|>"}
# a control token as the templates write it (the group keeps it in re.split's output)
_CONTROL = re.compile(r"(<[^<>\s{}]+>)")
# the control tokens the templates write: only they become control ids (encode_prompt), and
# formats/checkpoint.py refuses a tokenizer that puts one past the embedding
CONTROL_TOKENS = frozenset(_CONTROL.findall(
    _QWEN_PREFIX + _QWEN_POSTFIX + _QWEN_NO_THINK + _GEMMA_PREFIX + _GEMMA_POSTFIX + _LLAMA3_PREFIX
    + _LLAMA3_POSTFIX))


def uses_chat(cfg: ModelConfig, chat: bool | None = None) -> bool:
    """Whether prompts are wrapped in the model's chat template: `chat` when given (--chat /
    --no-chat), else yes, except for a base model, whose tokenizer has no template (the offline
    default, METHOD.md §13.10), whatever name it was given by."""
    return chat if chat is not None else cfg.chat_template is not False


def prompt_format(cfg: ModelConfig, name: str, chat: bool | None = None, thinking: bool = False,
                  task: str = "") -> PromptFormat:
    """The official prompt layout for the model's chat format (cfg.chat_format: the layout its
    tokenizer's template writes, e.g. ChatML for SmolLM2, a Llama). The authors' ChatML prompt is
    their Qwen one; `name` (alias, repo id or folder) tells hybrid Qwen3 ("instruct" not in it) from
    Qwen3 Instruct. Without the chat template (chat False, or None for a base model, see uses_chat):
    just the BOS text. task starting "gsm": the reasoning sentence."""
    if not uses_chat(cfg, chat):
        return PromptFormat(_BOS_TEXT.get(cfg.chat_format, ""), "")
    sentence = _TASK_GSM if task.startswith("gsm") else _TASK
    if cfg.chat_format == "gemma":
        return PromptFormat(_GEMMA_PREFIX + sentence, _GEMMA_POSTFIX)
    if cfg.chat_format == "llama3":
        return PromptFormat(_LLAMA3_PREFIX + sentence, _LLAMA3_POSTFIX)
    # Qwen3-*-Instruct-2507: no switch
    hybrid = cfg.arch == "qwen3" and "instruct" not in str(name).lower()
    return PromptFormat(_QWEN_PREFIX + sentence,
                        _QWEN_POSTFIX + ("" if thinking or not hybrid else _QWEN_NO_THINK))


def question_ids(tok, fmt: PromptFormat, question: str, cue: str = "") -> list[int]:
    """The turn that follows a (compressed) context, as ids: "\\n\\nQ: {question}" (METHOD.md §11),
    then the chat postfix, or for a base model (no turn to end) "\\nA:", so that it answers rather
    than goes on with the text. cue: text the answer starts with (after the postfix / "\\nA: ")."""
    template = "\n\nQ: {question}" + (fmt.postfix + "{cue}" if fmt.postfix else
                                        "\nA:" + (" {cue}" if cue else ""))
    return encode_prompt(tok, template, question=question, cue=cue)


def line_break_ids(tok):
    """The ids of "\n" and "\n\n", each where it is one token:
    where a base model's one-line answer ends."""
    ids = [encode_text(tok, s) for s in ("\n", "\n\n")]
    return {i[0] for i in ids if len(i) == 1}


def one_line(tok):
    """decode()'s ends_line for a base model's one-line answer: (answer so far, next token) -> it
    ends at the first line break after text. Line breaks and spaces before any text are part of the
    answer, not its end: a model that first writes "\\n" goes on to say its answer (taken for the
    end, they gave empty answers)."""
    breaks = line_break_ids(tok)
    return lambda out, token: token in breaks and bool(tok.decode(out).strip())


def check_ids(call, ids, vocab_size):
    """Token ids the embedding holds: integers in [0, vocab_size) (else torch's "index out of
    range in self" deep in the forward)."""
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):  # text, ragged lists, None
        t = None
    if t is not None and t.numel() == 0:
        raise ArgumentError(f"{call}: ids is empty; give the prompt's ids (system prompt ⊕ "
                            f"context)")
    if t is None or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
        raise ArgumentError(f"{call}: ids must be a list of token ids (integers), got "
                            f"{_show(ids)}")
    outside = ((t < 0) | (t >= vocab_size)).nonzero()
    if len(outside):
        i = int(outside[0])
        raise ArgumentError(f"{call}: id {int(t[i])} at position {i} is no token of the model "
                            f"(its ids are 0 to {vocab_size - 1})")


def _show(ids):
    """A few ids of a list, for a message."""
    ids = ids.tolist() if torch.is_tensor(ids) else ids
    if not isinstance(ids, (list, tuple)) or len(ids) <= 6:
        return repr(ids)[:60]
    return f"[{', '.join(map(repr, ids[:3]))}, ... {ids[-1]!r}]"
