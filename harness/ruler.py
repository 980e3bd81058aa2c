"""
RULER (Hsieh et al., arXiv 2404.06654), the field's shared yardstick for KV compression as kvpress's
leaderboard runs it: 4K tokens, 13 tasks, `string_match` averaged over them. Its tasks are
synthetic; this module writes them here, offline, seeded, to a target length in the model's own
tokens, from RULER's published definitions (NVIDIA/RULER:scripts/synthetic.yaml for the task
settings, scripts/data/synthetic/constants.py for the templates, answer prefixes and generation
lengths, scripts/data/synthetic/{niah, variable_tracking, common_words_extraction,
freq_words_extraction}.py for the generators), in kvpress's dataset layout, and scores them as
kvpress does
(NVIDIA/kvpress:evaluation/benchmarks/ruler/calculate_metrics.py).

What differs from RULER, and why:
  * The essay haystack. RULER's is Paul Graham's essays, which are not offline; ours is the six Jane
    Austen novels of the offline assets (public domain, Debian r-cran-janeaustenr), text no gate
    here was trained on. Each sample reads it from a seeded offset (RULER always starts at the first
    essay).
  * Sentences for needle insertion are split by a regular expression (RULER: nltk's sent_tokenize).
  * The word lists are RULER's own: the noun, adjective and verb lists of PyPI `wonderwords` (2.2.0,
    MIT), read as files.
  * The two QA tasks (qa_1: SQuAD, qa_2: HotpotQA) need those data sets, which are not offline: they
    are left out, and the average is over the 11 synthetic tasks ("RULER-4K, 11 tasks").
  * Length: a sample's context + question + answer prefix, each encoded alone by the model's
    tokenizer (as the harness feeds them), plus its generation length, fit in the target (RULER
    counts the same with its template, `max_seq_length`); the haystack is the largest that fits (a
    bisection, where RULER steps by fixed increments). A chat template's own tokens are not counted.

kvpress's layout, one row per question: context, question, answer_prefix, answer (the list of
strings a prediction must contain; kvpress's RULER files name it `answer`, other data sets
`answers`: both are read), max_new_tokens, task. The question follows the compressed context; the
answer prefix starts the model's turn. Files in that layout (JSONL or parquet, e.g. kvpress's own
RULER-4K file) are read as they are (read_dataset), so a local copy of the leaderboard's file gives
its exact samples.
"""
import json
import random
import re
import string
import uuid
from pathlib import Path

COLUMNS = ("context", "question", "answer_prefix", "answer", "max_new_tokens", "task")

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


def suite_name(n_tokens, tasks):
    """How an average over `tasks` is named everywhere: "RULER-4K, 11 tasks" for the offline set
    at 4,096 tokens (kvpress's "RULER-4K" averages 13)."""
    size = f"{n_tokens // 1024}K" if n_tokens % 1024 == 0 else str(n_tokens)
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
        from tools import fetch_assets
        text = " ".join(p.read_text(encoding="utf-8") for p in fetch_assets.text_docs("austen"))
        _memo.append(text.split())
    return _memo[0]


# ---- 2. The generators: one sample of a task, its haystack of `size` words, lines or items -------

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


def niah(rng, size, haystack, k_type, v_type, n_keys, n_values, n_queries):
    """Needles "One of the special magic numbers for <key> is: <value>." in a haystack of repeated
    noise sentences, of the essay (needles at RULER's depths, between sentences), or of other
    needles."""
    n_keys = max(n_keys, n_queries)
    keys, values, needles = [], [], []
    for _ in range(n_keys):
        keys.append(random_value(rng, k_type))
        values.append([random_value(rng, v_type) for _ in range(n_values)])
        needles += [NEEDLE.format(v=v_type, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if haystack == "essay":
        words = essay_words()
        start = rng.randrange(len(words) // 2)  # room for any haystack of a 128K context after it
        sents = sentences(" ".join(words[start:start + size]))
        at = sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for pos, needle in zip(at, needles):
            parts += sents[last:pos] + [needle]
            last = pos
        context = " ".join(parts + sents[last:])
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
    if n_queries * n_values == 1:  # RULER's singular wording
        v = v_type[:-1]
        head = (f"A special magic {v} is hidden within the following text. "
                f"Make sure to memorize it. I will quiz you about the {v} afterwards.\n")
        question = f"What is the special magic {v} for {query} mentioned in the provided text?"
        prefix = f" The special magic {v} for {query} mentioned in the provided text is"
    else:
        v = v_type
        head = (f"Some special magic {v} are hidden within the following text. "
                f"Make sure to memorize it. I will quiz you about the {v} afterwards.\n")
        question = f"What are all the special magic {v} for {query} mentioned in the provided text?"
        prefix = f" The special magic {v} for {query} mentioned in the provided text are"
    return head + context + "\n", question, prefix, answer


VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def vt_parts(rng, size, hops, name_len):
    """One chain VAR A = 12345, VAR B = VAR A, ... (hops + 1 variables) among `size` noise lines."""
    names = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        names += [name] * (name not in names)
    value = str(rng.randint(10000, 99998))  # numpy's randint(10000, 99999): upper bound excluded
    chain = [f"VAR {names[0]} = {value}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    lines = [NOISE + "\n"] * size
    for j, pos in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
        lines.insert(pos + j, chain[j])
    context = " ".join(lines).replace(". \n", ".\n")
    question = ("Question: Find all variables that are assigned the value "
                f"{value} in the text above.")
    prefix = (" Answer: According to the chain(s) of variable assignment in the text above, "
              f"{hops + 1} variables are assgined the value {value}, they are: ")  # (sic), RULER's
    return context, question, prefix, names


def vt(rng, size, hops=4, example_size=5):
    """Variable tracking (multi-hop). RULER puts one solved example first: a short chain of 3-letter
    names, its template on one line (whitespace collapsed), with its answer."""
    ex_ctx, ex_q, ex_prefix, ex_answer = vt_parts(rng, example_size, hops, 3)
    example = " ".join((VT_HEAD + ex_ctx + "\n" + ex_q).split()) + ex_prefix + " ".join(ex_answer)
    context, question, prefix, answer = vt_parts(rng, size, hops, 5)
    return example + "\n\n" + VT_HEAD + context + "\n", question, prefix, answer


CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than "
            "others. Memorize the ones that appear most often.\n")
CWE_Q = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"


def cwe_words(seed):
    w = word_lists()
    words = sorted(set(w["noun"] + w["adjective"] + w["verb"]))
    random.Random(seed).shuffle(words)
    return words


def cwe(rng, size, target, n_common=10):
    """Common words extraction (aggregation): 10 + `size` distinct words, 10 repeated often, the
    rest rarely, in a numbered list; a solved example first. RULER's repeats: 30 and 3 (example 10
    and 3) from 4K tokens on, 6 and 1 (example 3 and 1) below."""
    words = cwe_words(0)
    common_r, rare_r, ex = (30, 3, (40, 10, 3)) if target >= 4096 else (6, 1, (20, 3, 1))

    def numbered(n_words, c, r):
        chosen = rng.sample(words, n_words)
        items = chosen[:n_common] * c + chosen[n_common:] * r
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), chosen[:n_common]

    ex_ctx, ex_answer = numbered(*ex)
    example = CWE_HEAD + ex_ctx + "\n" + CWE_Q + CWE_PREFIX + " " + \
        " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer))
    context, answer = numbered(n_common + size, common_r, rare_r)
    return example + "\n" + CWE_HEAD + context + "\n", CWE_Q, CWE_PREFIX, answer


def zeta(alpha):
    """Riemann zeta(alpha), alpha > 1: the sum to 10^5 plus the tail's Euler-Maclaurin terms."""
    n = 10**5
    tail = n ** (1 - alpha) / (alpha - 1) - 0.5 * n ** -alpha
    return sum(k ** -alpha for k in range(1, n + 1)) + tail


def fwe(rng, size, target, alpha=2.0, word_len=6):
    """Frequent words extraction (aggregation): coded 6-letter words drawn with Zipf frequencies
    (alpha 2), from a vocabulary of target // 50 words; the most frequent one is "..." (noise), the
    answer is the next three."""
    vocab_size = max(5, target // 50)
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_len)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."
    z = zeta(alpha)
    text = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k ** -alpha / z))]
    rng.shuffle(text)
    head = ("Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. ")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
    prefix = (" Answer: According to the coded text above, "
              "the three most frequently appeared words are:")
    return head + " ".join(text) + "\n", question, prefix, vocab[1:4]


def build(task, rng, size, target):
    if task in NIAH:
        return niah(rng, size, *NIAH[task])
    if task == "vt":
        return vt(rng, size)
    if task == "cwe":
        return cwe(rng, size, target)
    if task == "fwe":
        return fwe(rng, size, target)
    raise ValueError(f"unknown RULER task {task!r}; tasks are {', '.join(TASKS)}")


# ---- 3. Samples to a target length in the model's tokens -----------------------------------------

def n_tokens(tok, row):
    """What a row costs in the model's tokens: context, question and answer prefix, each encoded
    alone, and the tokens it may generate."""
    from model import encode_text  # user text: never a control id
    enc = lambda s: len(encode_text(tok, s))
    pieces = (row["context"], row["question"], row["answer_prefix"])
    return sum(enc(x) for x in pieces) + row["max_new_tokens"]


def make_row(task, seed, index, size, target):
    rng = random.Random(f"ruler {task} {seed} {index}")  # each sample alone: any shard makes it
    context, question, prefix, answer = build(task, rng, size, target)
    return dict(context=context, question=question, answer_prefix=prefix, answer=answer,
                max_new_tokens=MAX_NEW[family(task)], task=task)


def make_sample(tok, task, target, seed=42, index=0):
    """One sample of `task` whose n_tokens is at most `target`, with the largest haystack that fits
    (bisection over its size: the sample's random draws are the same at every size tried)."""
    fits = lambda size: n_tokens(tok, make_row(task, seed, index, size, target)) <= target
    lo = hi = 5  # the least haystack every task can take (the chain of vt has 5 lines to place)
    if not fits(lo):
        raise ValueError(f"RULER {task}: {target} tokens are too few for its smallest sample")
    while fits(hi):
        lo, hi = hi, 2 * hi
        if hi > 10**7:
            raise ValueError(f"RULER {task}: no haystack fills {target} tokens")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    row = make_row(task, seed, index, lo, target)
    row["length"] = n_tokens(tok, row)
    return row


def make_samples(tok, target, n_per_task, seed=42, tasks=TASKS):
    """n_per_task samples of each task, in kvpress's layout (plus `length`: the tokens counted)."""
    return [make_sample(tok, task, target, seed, i) for task in tasks for i in range(n_per_task)]


# ---- 4. kvpress's dataset layout: JSONL or parquet, read as it is --------------------------------

def read_dataset(path):
    """Rows of a JSONL or parquet file in kvpress's layout -> dicts with COLUMNS (answer as a list
    of strings; `answers`, as in kvpress's other data sets, is read as answer; other columns are
    left). Raises ValueError naming what is missing."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        rows = pq.read_table(path).to_pylist()
    else:
        lines = path.read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    out = []
    for i, r in enumerate(rows):
        if "answer" not in r and "answers" in r:
            r = dict(r, answer=r["answers"])
        missing = [c for c in COLUMNS if c not in r and c != "answer_prefix"]
        if missing:
            raise ValueError(f"{path}: row {i} lacks {', '.join(missing)} (kvpress's layout: "
                             f"{', '.join(COLUMNS)})")
        answer = r["answer"]
        answer = [answer] if isinstance(answer, str) else [str(a) for a in answer]
        out.append(dict(context=r["context"], question=r["question"],
                        answer_prefix=r.get("answer_prefix") or "", answer=answer,
                        max_new_tokens=int(r["max_new_tokens"]), task=str(r["task"])))
    return out


def write_dataset(rows, path):
    """rows (dicts with at least COLUMNS) -> JSONL, or parquet when path ends in .parquet."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist([{c: r[c] for c in COLUMNS} for r in rows]), path)
    else:
        text = "".join(json.dumps({c: r[c] for c in COLUMNS}) + "\n" for r in rows)
        path.write_text(text, encoding="utf-8")


# ---- 5. Scores, as kvpress computes them ---------------------------------------------------------

CONTROL = re.compile(r"[\x00-\x1f]")


def clean(prediction):
    """kvpress's cleaning of a prediction: stripped, control characters (newlines too) removed."""
    return CONTROL.sub("", prediction.strip()).strip()


def match_all(prediction, answer):
    """One sample's string_match_all: the share of the answer's strings found in the prediction
    (case-insensitive)."""
    p = clean(prediction).lower()
    return sum(a.lower() in p for a in answer) / len(answer)


def match_part(prediction, answer):
    """One sample's string_match_part: 1 if any of the answer's strings is in the prediction."""
    p = clean(prediction).lower()
    return float(any(a.lower() in p for a in answer))


def metric(task):
    """kvpress's choice: string_match_part for the QA tasks, string_match_all for every other."""
    return match_part if task.split("_")[0] == "qa" else match_all


def string_match(task, predictions, answers):
    """A task's score as kvpress reports it: its samples' mean match x 100, rounded to 2 places."""
    f = metric(task)
    return round(100 * sum(f(p, a) for p, a in zip(predictions, answers)) / len(predictions), 2)
