"""
RULER's 11 synthetic tasks (Hsieh et al., arXiv 2404.06654), generated here, offline, seeded, as
the generator kvpress's RULER file was made with writes them (NVIDIA/RULER@e40fae1:
scripts/synthetic.yaml for the task settings, scripts/data/synthetic/constants.py for the
templates, answer prefixes and generation lengths, scripts/data/synthetic/{niah,
variable_tracking, common_words_extraction, freq_words_extraction}.py for the generators and their
sizing). Each sample is a row in kvpress's layout, split where
NVIDIA/kvpress:evaluation/benchmarks/ruler/create_huggingface_dataset.py splits RULER's text
(to_row); harness/ruler.py runs and scores them.

Sizing. kvpress's RULER-4K file was generated once, in Llama-3.1-8B's tokens (its generate.sh), and
every model reads the same samples. The default sizing ("ruler") does the same: counted with
Llama-3.1-8B's tokenizer (offline assets), the haystack grows by RULER's fixed steps (essay: 500
words; noise or needle lines: 25; vt: 10 noise lines; cwe: 10 words; fwe: target // 32 coded words
from target // 6) in one first draw per task and run (fwe's from RULER's own first vocabulary,
seed 42, whatever the run's: 2,218 coded words at 4K, as in kvpress's file), each sample then a
step smaller while it is too long; the text counted, and what is reserved for the generation (fwe: nothing), are each
script's. vt's solved example is made once per run, as RULER makes it. So a model reads about as
many of its own tokens as its tokenizer makes of Llama's: more than the target for some (cwe's
words cost Qwen3 about a third more). The other sizing ("model"; named "RULER-4K (model-token
sizing)") fills the target in the model's own tokens: context, question and answer prefix, each
encoded alone as the harness feeds them, plus the generation length, with the largest haystack that
fits (a bisection).

What differs from RULER, and why:
  * The essay haystack. RULER's is Paul Graham's essays, which are not offline; ours is the six Jane
    Austen novels of the offline assets (public domain, Debian r-cran-janeaustenr), text no gate
    here was trained on, read from its first word as RULER reads its essays (model sizing: from a
    seeded offset per sample).
  * Sentences for needle insertion are split by a regular expression (RULER: nltk's sent_tokenize).
  * The word lists are RULER's own: the noun, adjective and verb lists of PyPI `wonderwords` (2.2.0,
    MIT), read as files. A word needle is an adjective and a noun drawn apart (RULER: one draw from
    the list of all pairs; the same but for the few pairs spelt twice).
  * Random draws: each sample from its own generator, seeded by (task, seed, index), so any shard
    makes it alone (RULER: one stream per task). Where RULER shuffles with a new generator of the
    run's seed (niah's needles, cwe's and fwe's lists), so does this module.
  * A sample that does not fit at the smallest step is an error (RULER retries it forever).
  * The two QA tasks (qa_1: SQuAD, qa_2: HotpotQA) need those data sets, which are not offline: they
    are left out, and the average is over the 11 synthetic tasks ("RULER-4K, 11 tasks").
  * A chat template's own tokens are not counted (RULER's "base" template has none).
"""

import functools
import math
import random
import re
import string
import uuid
from pathlib import Path

from prompts import encode_text

# RULER's task list (scripts/synthetic.yaml) less the two QA tasks (not offline: see above)
NIAH = dict(  # name -> (haystack, key type, value type, keys, values per key, queried keys)
    niah_single_1=("repeat", "words", "numbers", 1, 1, 1),
    niah_single_2=("essay", "words", "numbers", 1, 1, 1),
    niah_single_3=("essay", "words", "uuids", 1, 1, 1),
    niah_multikey_1=("essay", "words", "numbers", 4, 1, 1),
    niah_multikey_2=("needle", "words", "numbers", 1, 1, 1),
    niah_multikey_3=("needle", "uuids", "uuids", 1, 1, 1),
    niah_multivalue=("essay", "words", "numbers", 1, 4, 1),
    niah_multiquery=("essay", "words", "numbers", 1, 1, 4),
)
TASKS = tuple(NIAH) + ("vt", "cwe", "fwe")
LEFT_OUT = ("qa_1", "qa_2")  # SQuAD and HotpotQA: data sets that are not offline
# tokens to generate (RULER's constants.py: tokens_to_generate per task family)
MAX_NEW = dict(niah=128, vt=30, cwe=120, fwe=50, qa=32)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 insertion depths, 0..100%


def suite_name(n_tokens, tasks, sizing="ruler"):
    """How an average over `tasks` is named everywhere: "RULER-4K, 11 tasks" for the offline set
    at 4,096 tokens sized as RULER sizes kvpress's files (kvpress's "RULER-4K" averages 13);
    "RULER-4K (model-token sizing), 11 tasks" for samples sized in the model's own tokens."""
    size = f"{n_tokens // 1024}K" if n_tokens % 1024 == 0 else str(n_tokens)
    size += " (model-token sizing)" if sizing == "model" else ""
    return f"RULER-{size}, {len(tasks)} task{'s' * (len(tasks) != 1)}"


def family(task):
    return "niah" if task.startswith("niah") else task.split("_")[0]


# ---- 1. Offline sources: RULER's word lists, the essay haystack ----------------------------------

def word_lists(_memo={}):
    """wonderwords' nouns, adjectives and verbs (RULER's lists), each as in the package's files."""
    if not _memo:
        from importlib.util import find_spec
        spec = find_spec("wonderwords")  # its files only: importing the package reads them all
        if spec is None:
            raise RuntimeError("RULER's word lists come from PyPI wonderwords: "
                               "pip install -r requirements.txt")
        folder = Path(spec.submodule_search_locations[0]) / "assets"
        for kind in ("noun", "adjective", "verb"):
            text = (folder / f"{kind}list.txt").read_text(encoding="utf-8")
            _memo[kind] = [w.strip() for w in text.splitlines() if w.strip()]
    return _memo


def essay_words(_memo=[]):
    """The essay haystack as one stream of words: the six Austen novels of the offline assets, in
    file order, whitespace-normalized (RULER: its Paul Graham essays, split at whitespace)."""
    if not _memo:
        from offline import fetch_assets
        text = " ".join(p.read_text(encoding="utf-8") for p in fetch_assets.text_docs("austen"))
        _memo.append(text.split())
    return _memo[0]


# ---- 2. The generators: RULER's input text of one sample, its haystack of `size` words or lines --

# RULER's templates and answer prefixes (constants.py); prepare.py appends the prefix to the
# template ("base" model template: nothing around them), and each generator formats the whole
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
    "the special magic {type_needle_v} for {query} mentioned in the provided text?"
    " The special magic {type_needle_v} for {query} mentioned in the provided text are")
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
             "variables are assgined the value {query}, they are: ")  # (sic), RULER's
VT_TEMPLATE = (VT_HEAD + "{context}\nQuestion: Find all variables that are assigned the value "
               "{query} in the text above." + VT_PREFIX)
CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than "
            "others. Memorize the ones that appear most often.\n")
CWE_TEMPLATE = (CWE_HEAD + "{context}\nQuestion: What are the 10 most common words in the above "
                "list? Answer: The top 10 words that appear most often in the list are:")
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
    "text? Answer: According to the coded text above, the three most frequently appeared words "
    "are:")


def random_value(rng, kind):
    if kind == "numbers":  # seven digits
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":  # an adjective-noun pair, uniform over RULER's list of all pairs
        w = word_lists()
        return f"{rng.choice(w['adjective'])}-{rng.choice(w['noun'])}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def sentences(text):
    return [s for s in re.split(r'(?<=[.!?])\s+|(?<=[.!?]["\'])\s+', text.strip()) if s]


def niah(rng, seed, offset, size, haystack, k_type, v_type, n_keys, n_values, n_queries):
    """Needles "One of the special magic numbers for <key> is: <value>." in a haystack of `size`
    repeated noise sentences, essay words (needles at RULER's depths, between sentences), or other
    needles. The essay's words are its first, as RULER's, or (offset) from a seeded offset."""
    n_keys = max(n_keys, n_queries)
    keys, values, needles = [], [], []
    for _ in range(n_keys):
        keys.append(random_value(rng, k_type))
        values.append([random_value(rng, v_type) for _ in range(n_values)])
        needles += [NEEDLE.format(v=v_type, key=keys[-1], value=v) for v in values[-1]]
    random.Random(seed).shuffle(needles)  # RULER's: a new generator of the run's seed each time
    if haystack == "essay":
        words = essay_words()
        start = rng.randrange(len(words) // 2) if offset else 0  # room for a 128K context after it
        sents = sentences(" ".join(words[start:start + size]))
        at = [0] + sorted(int(len(sents) * (d / 100)) for d in rng.sample(DEPTHS, len(needles)))
        at.append(len(sents))
        parts = []  # RULER's joins: two needles at one depth leave an empty part (two spaces)
        for i in range(1, len(at)):
            parts.append(" ".join(sents[at[i - 1]:at[i]]))
            parts += needles[i - 1:i]
        context = " ".join(parts)
    else:
        lines = ([NOISE] * size if haystack == "repeat" else
                 [NEEDLE.format(v=v_type, key=random_value(rng, k_type),
                                value=random_value(rng, v_type)) for _ in range(size)])
        for i, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(i, needle)
        context = "\n".join(lines)
    asked = rng.sample(range(n_keys), n_queries)
    answer = [v for i in asked for v in values[i]]
    query = ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]] if n_queries > 1 \
        else keys[asked[0]]
    template = NIAH_TEMPLATE
    if n_queries * n_values == 1:  # RULER's singular wording, by these replacements
        for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(a, b)
        v_type = v_type[:-1]
    return template.format(type_needle_v=v_type, context=context, query=query), answer


def vt(rng, size, example=False, hops=4):
    """Variable tracking (multi-hop): one chain VAR A = 12345, VAR B = VAR A, ... (hops + 1
    variables) among `size` noise lines. RULER's solved example (example=True) has 3-letter names
    and its template's whitespace collapsed, its last word ("above.") dropped."""
    names = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=3 if example else 5))
        names += [name] * (name not in names)
    value = str(rng.randint(10000, 99998))  # numpy's randint(10000, 99999): upper bound excluded
    chain = [f"VAR {names[0]} = {value}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    lines = [NOISE + "\n"] * size
    if len(lines) <= len(chain):  # too few lines for the chain: RULER cuts them into sentences
        lines = [s + "." if s.strip() else s for s in (NOISE + "\n").split(".")] * size
    for j, pos in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
        lines.insert(pos + j, chain[j])
    context = " ".join(lines).replace(". \n", ".\n")
    template = VT_TEMPLATE
    if example:
        cut = template.index(VT_PREFIX[:10])
        template = " ".join(template[:cut].split()[:-1]) + template[cut:]
    return template.format(context=context, query=value, num_v=hops + 1), names


def cwe_words(seed):
    """RULER's vocabulary of cwe: wonderwords' nouns, adjectives and verbs, sorted, shuffled by the
    run's seed."""
    w = word_lists()
    words = sorted(set(w["noun"] + w["adjective"] + w["verb"]))
    random.Random(seed).shuffle(words)
    return words


def numbered(words):
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def cwe(rng, seed, size, target, n_common=10):
    """Common words extraction (aggregation): `size` distinct words in a numbered list, the first
    10 repeated often, the rest rarely; a solved example of 40 words first. RULER's repeats: 30 and
    3 (example 10 and 3) from 4K tokens on, 6 and 1 (example 3 and 1) below."""
    words = cwe_words(seed)
    repeats, example = ((30, 3), (40, 10, 3)) if target >= 4096 else ((6, 1), (20, 3, 1))

    def listed(n_words, common, rare):
        chosen = rng.sample(words, n_words)
        items = chosen[:n_common] * common + chosen[n_common:] * rare
        random.Random(seed).shuffle(items)  # RULER's: a new generator of the run's seed each time
        return numbered(items), chosen[:n_common]

    ex_context, ex_answer = listed(*example)
    context, answer = listed(size, *repeats)
    # the example's answer follows its prefix without a space, as RULER writes it
    return (CWE_TEMPLATE.format(context=ex_context) + numbered(ex_answer) + "\n"
            + CWE_TEMPLATE.format(context=context)), answer


def zeta(alpha, n=1000):
    """Riemann zeta(alpha), alpha > 1 (RULER: scipy's): the first n terms summed exactly (fsum) plus
    the tail's Euler-Maclaurin terms."""
    tail = n ** (1 - alpha) / (alpha - 1) - 0.5 * n ** -alpha + alpha * n ** (-alpha - 1) / 12
    return math.fsum([k ** -alpha for k in range(1, n + 1)] + [tail])


def fwe_vocab(rng, seed, target, word_len=6):
    """fwe's coded words: target // 50 distinct random 6-letter words, sorted, shuffled by the run's
    seed; the first is "..." (noise)."""
    n = max(5, target // 50)  # at least the noise and the three answers
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=word_len)) for _ in range(n)]
    while len(set(vocab)) < n:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=word_len)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."
    return vocab


# RULER@e40fae1's seed (scripts/data/prepare.py: --random_seed 42, chunk 0), that of kvpress's files
FWE_SEED = 42
# what generated fwe samples' run keys record (harness/ruler.py run_key): runs made before fwe's
# budget was RULER's drew it from the run's seed, and hold other fwe samples
FWE_BUDGET = f"RULER's first draw, seed {FWE_SEED}"


def fwe(vocab, seed, size, alpha=2.0):
    """Frequent words extraction (aggregation): `size` x k^-alpha / zeta(alpha) copies of the k-th
    coded word (Zipf, alpha 2), shuffled; the answer is the three most frequent after the noise."""
    z = zeta(alpha)
    text = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k ** -alpha / z))]
    random.Random(seed).shuffle(text)  # RULER's: a new generator of the run's seed each time
    return FWE_TEMPLATE.format(context=" ".join(text)), vocab[1:4]


def build(task, rng, seed, size, target, offset=False):
    """One draw of `task` with a haystack of `size` -> (RULER's input text, answer); offset: the
    essay from a seeded offset."""
    if task in NIAH:
        return niah(rng, seed, offset, size, *NIAH[task])
    if task == "vt":
        return vt(rng, size)
    if task == "cwe":
        return cwe(rng, seed, size, target)
    if task == "fwe":
        return fwe(fwe_vocab(rng, seed, target), seed, size)
    raise ValueError(f"unknown RULER task {task!r}; tasks are {', '.join(TASKS)}")


# kvpress's split of RULER's input text (create_huggingface_dataset.py): the context ends at the
# last question, the question at the answer prefix's first word
QUESTION = dict(niah=re.compile(r"What (?:is|are all) the special magic"),
                vt=re.compile(r"Question: Find all variables that are assigned the value"),
                cwe=re.compile(r"Question: What are the 10 most common words in the above list\?"),
                fwe=re.compile(r"Question: Do not provide any explanation\."))
ANSWER = dict(niah=re.compile(r"The special magic"), vt=re.compile(r"Answer:"),
              cwe=re.compile(r"Answer:"), fwe=re.compile(r"Answer:"))


def to_row(task, text, answer):
    """RULER's input text and answer -> a row in kvpress's layout (context + question + answer
    prefix is the text, character for character)."""
    f = family(task)
    i = list(QUESTION[f].finditer(text))[-1].start()
    j = ANSWER[f].search(text, i).start()
    return dict(context=text[:i], question=text[i:j], answer_prefix=text[j:], answer=answer,
                max_new_tokens=MAX_NEW[f], task=task)


# ---- 3. Samples to a target length: RULER's sizing (Llama-3.1 tokens, fixed steps) or the model's

SIZINGS = ("ruler", "model")


def llama_tokenizer(_memo=[]):
    """Llama-3.1-8B's tokenizer (offline assets): kvpress's RULER files are sized in its tokens for
    every model (its generate.sh)."""
    if not _memo:
        from tokenizers import Tokenizer

        from offline import fetch_assets
        _memo.append(Tokenizer.from_file(str(fetch_assets.tokenizer_file("llama3_1"))))
    return _memo[0]


def ruler_count(text):
    """RULER's count: the text's tokens, no special ones (transformers' tokenize(); RULER's texts
    hold no control-token text, so encode_text counts the same)."""
    return len(encode_text(llama_tokenizer(), text))


def steps(task, target):
    """RULER's fixed steps of a task's haystack: (first size, step)."""
    if task in NIAH:
        essay = NIAH[task][0] == "essay"
        step = 500 if essay else 25 if target >= 4096 else 5
        return step, step
    if task == "fwe":
        return target // 6, target // 32
    return 10, 10  # vt: noise lines; cwe: words


def first_text(task, text, answer):
    """The text RULER tokenizes when it searches a task's haystack size: the input and the answer,
    written as each script writes them (vt: the Python list as it prints)."""
    if task == "vt":
        return text + f" {answer}"
    if task == "cwe":
        return text + " " + numbered(answer)
    return text + " ".join(answer)  # niah: no space between the prefix and the answer


def grow(draw, count, target, step, reserve, most=None):
    """RULER's search of niah, vt and cwe: the haystack grows by `step` from `step`, one draw each,
    until the input and its answer (first_text) with the reserved tokens exceed the target; then
    one step back."""
    size, total = step, 0
    while total + reserve < target:
        total = count(draw(size))
        if total + reserve > target:
            size -= step
            break
        size += step
        if most is not None and size > most:
            return most
    return size


class TooShort(ValueError):
    """A target too short for a task's smallest sample, which takes `need` tokens (the draw that
    failed: another draw may take a few more or fewer, least_target)."""

    def __init__(self, task, target, need):
        super().__init__(f"RULER {task}: {target} tokens are too few for its smallest sample, "
                         f"which takes {need}")
        self.task, self.target, self.need = task, target, need


def least_target(tok, task, seed, sizing, need):
    """The least target, from a TooShort's `need` up, at which sample 0 of `task` is made (what a
    run checks before it starts); up in steps of 1% of the target, as long as it fails."""
    target = need
    for _ in range(200):  # 1% steps: past 7x the estimate, which a draw never misses by
        try:
            make_sample(tok, task, target, seed, 0, sizing)
            return target
        except TooShort as e:
            target = max(target + max(1, target // 100), e.need)
    raise ValueError(f"RULER {task}: no target from {need} tokens fits its smallest sample")


def shrink(draw, count, target, size, step, reserve, what):
    """RULER's per-sample loop: draw at `size`, and again a step smaller while the input with the
    reserved tokens is longer than the target -> (text, answer, tokens counted, size). RULER
    retries the smallest size forever; here it is an error (TooShort for a task's sample)."""
    while True:
        text, answer = draw(size)
        length = count(text) + reserve
        if length <= target:
            return text, answer, length, size
        if size <= step and what in TASKS:
            raise TooShort(what, target, length)
        if size <= step:  # vt's example: its 500 tokens are RULER's, not a flag's
            raise ValueError(f"RULER {what}: RULER's {target} tokens are too few for it in this "
                             f"tokenizer's tokens (it takes {length} at its smallest); use "
                             "--ruler-sizing ruler")
        size -= step


@functools.lru_cache(maxsize=None)
def vt_example(seed, tok=None):
    """RULER's solved example of vt, made once for all samples of a run: its noise grows by 5 lines
    while the example fits 500 tokens with the 30 vt generates, as a sample of its own; then
    written with its answer and two line breaks. Counted in Llama-3.1 tokens, or in tok's."""
    count = ruler_count if tok is None else lambda s: len(encode_text(tok, s))
    rng = random.Random(f"ruler vt example {seed}")
    draw = lambda n: vt(rng, n, example=True)
    size = max(5, grow(lambda n: first_text("vt", *draw(n)), count, 500, 5, MAX_NEW["vt"]))
    text, answer, _, _ = shrink(draw, count, 500, size, 5, MAX_NEW["vt"], "vt's example")
    return text + " " + " ".join(answer) + "\n\n"


@functools.lru_cache(maxsize=None)
def haystack_size(task, target, seed):
    """The haystack size of every sample of `task` (each may shrink: shrink), found once per run
    as RULER finds it, by a first draw of its own (grow; fwe: its own search)."""
    first, step = steps(task, target)
    reserve = 0 if task == "fwe" else MAX_NEW[family(task)]  # fwe reserves none (RULER's script)
    reserve += ruler_count(vt_example(seed)) if task == "vt" else 0
    rng = random.Random(f"ruler {task} {seed} {target} first draw")
    if task == "fwe":  # from target // 6 words up while the input is under the target; one back
        # from RULER's first vocabulary, whatever the samples' seed: its script draws it first
        # from the global `random` seeded FWE_SEED, so kvpress's file holds 2,218 coded words
        # at 4K in every sample (freq_words_extraction.py, sys_kwext)
        vocab = fwe_vocab(random.Random(FWE_SEED), FWE_SEED, target)
        size = first
        while ruler_count(fwe(vocab, FWE_SEED, size)[0]) < target:
            size += step
        return size - step
    most = len(cwe_words(seed)) if task == "cwe" else None
    size = grow(lambda n: first_text(task, *build(task, rng, seed, n, target)), ruler_count,
                target, step, reserve, most)
    if size < step:  # the smallest haystack's draw, with its answer, took more than the target
        draw = build(task, random.Random(f"ruler {task} {seed} {target} least"), seed, step, target)
        raise TooShort(task, target, ruler_count(first_text(task, *draw)) + reserve)
    return size


def ruler_sample(task, target, seed, index):
    """Sample `index` of `task` as RULER makes it for kvpress's files: the run's haystack size,
    a step smaller while the sample (input + its generation length, fwe's without) is longer than
    the target in Llama-3.1 tokens."""
    size, (_, step) = haystack_size(task, target, seed), steps(task, target)
    rng = random.Random(f"ruler {task} {seed} {index}")  # each sample alone: any shard makes it
    reserve = MAX_NEW[family(task)]
    if task == "fwe":  # its vocabulary once per sample, its text shortened until it fits
        vocab = fwe_vocab(rng, seed, target)
        text, answer = fwe(vocab, seed, size)
        while ruler_count(text) > target and size > step:
            size -= step
            text, answer = fwe(vocab, seed, size)
        length = ruler_count(text) + reserve
    else:
        example = vt_example(seed) if task == "vt" else ""
        reserve += ruler_count(example)  # RULER counts it apart, added
        draw = lambda n: build(task, rng, seed, n, target)
        text, answer, length, size = shrink(draw, ruler_count, target, size, step, reserve, task)
        if example:  # before the input, as RULER inserts it
            text = " " + example + "\n\n" + text
    return dict(to_row(task, text, answer), length=length, haystack=size)


def n_tokens(tok, row):
    """What a row costs in the model's tokens: context, question and answer prefix, each encoded
    alone, and the tokens it may generate."""
    enc = lambda s: len(encode_text(tok, s))
    pieces = (row["context"], row["question"], row["answer_prefix"])
    return sum(enc(x) for x in pieces) + row["max_new_tokens"]


def make_row(task, seed, index, size, target, example=""):
    """Sample `index` of `task` with a haystack of `size` (model sizing); example: vt's."""
    rng = random.Random(f"ruler {task} {seed} {index}")  # each sample alone: any shard makes it
    text, answer = build(task, rng, seed, size, target, offset=True)
    return to_row(task, " " + example + "\n\n" + text if example else text, answer)


def model_sample(tok, task, target, seed, index):
    """One sample of `task` whose n_tokens (the model's tokens) is at most `target`, with the
    largest haystack that fits (bisection over its size: the sample's random draws are the same at
    every size tried)."""
    example = vt_example(seed, tok) if task == "vt" else ""
    row = lambda size: make_row(task, seed, index, size, target, example)
    fits = lambda size: n_tokens(tok, row(size)) <= target
    lo = hi = 11 if task == "cwe" else 5  # the least haystack: cwe's 10 common words and one more
    if not fits(lo):
        raise TooShort(task, target, n_tokens(tok, row(lo)))
    while fits(hi):
        lo, hi = hi, 2 * hi
        if hi > 10**7:
            raise ValueError(f"RULER {task}: no haystack fills {target} tokens")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    r = row(lo)
    return dict(r, length=n_tokens(tok, r), haystack=lo)


def make_sample(tok, task, target, seed=42, index=0, sizing="ruler"):
    """Sample `index` of `task` at `target` tokens, in kvpress's layout plus `length` (the tokens
    counted) and `haystack` (its size). sizing "ruler": as RULER sizes kvpress's files
    (ruler_sample; tok is not used); "model": the largest haystack that fits in tok's tokens."""
    if sizing == "model":
        return model_sample(tok, task, target, seed, index)
    assert sizing == "ruler", sizing
    return ruler_sample(task, target, seed, index)


def make_samples(tok, target, n_per_task, seed=42, tasks=TASKS, sizing="ruler"):
    """n_per_task samples of each task (make_sample); sample 0 of every task first, then sample 1,
    ...: a run stopped early has covered every task."""
    return [make_sample(tok, task, target, seed, i, sizing) for i in range(n_per_task)
            for task in tasks]
