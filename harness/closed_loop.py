"""
The decode suite's closed-loop task (bench.py --suite decode --loop-seeds S): the model writes what
it must later use, then generates thousands of tokens of its own, then is asked for it; the answer
is scored against what the model itself wrote. Every token after the prompt is a decode step
through generate.decode_one, so the cache evicts (every 128 tokens, back to B per KV head) while
the model writes its list, its story and its answers.

One sample (a seed):
    prompt     asks for a numbered list of n things of a theme (--loop-items, default N_ITEMS),
               each with a secret code of four digits, then a long story about them (SmolLM2's
               chat turn; plain text for a base model); prefilled
    list       the harness writes each line, "{i}. {name} (code " (HEAD, the names drawn by the
               seed from the theme), CODE_DIGITS digits that the model samples (its own
               next-token distribution over the ten digit tokens, at CODE_TEMPERATURE) and ")\n".
               A sample whose list repeats a code is invalid: counted and reported, never asked
               (a repeated code could be answered without the item)
    story      the harness writes STORY, the model samples --loop-tokens tokens (end of text masked)
    questions  for every item, on its own copy of the cache the story left: "\n\nQ: What was the
               code of {name} in the list?\nA: {name} (code " (question(): the line's head without
               its number, which a pattern of codes could follow), answered greedily up to a line
               break or ANSWER_TOKENS tokens; right when the answer's first code-like word (ANSWER)
               is the code the model wrote, exactly
Sampling: generate.sample at TEMPERATURE and TOP_P (end of text masked) with a torch.Generator
seeded by the sample's seed, so every method starts from the same tokens (up to its first eviction
that changes a logit) and each is scored against its own list. The harness writes the lines' words
and only the digits are the model's: asked for a list, these small models write one in their own
shape or none, and left to write their codes they write patterns that follow the item's number
("2626-1", "2626-3", ... or "1062" ... "1069") or repeat one code (the benchmark's README).
"""
import copy
import random
import re
import time
from dataclasses import dataclass

import torch

import generate
from prompts import encode_prompt, encode_text

N_ITEMS = 8
TOKENS = 2000   # the story: the model's own tokens between its list and the questions
TEMPERATURE = 0.7
TOP_P = 0.9
CODE_DIGITS = 4
CODE_TEMPERATURE = 1.0  # the digits: the model's own distribution, untempered, so codes differ
ANSWER_TOKENS = 12
AROUND_STORY = 400  # positions besides the story (positions())
ANSWER = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")  # an answer's first code-like word
HEAD = "{i}. {name} (code "  # written by the harness; the model writes the digits after it
STORY = "\n\nNow the story.\n\n"
THEMES = {
    "fruits": ("Apple", "Banana", "Cherry", "Mango", "Peach", "Lemon", "Grape", "Plum", "Pear",
               "Melon", "Orange", "Kiwi"),
    "animals": ("Tiger", "Rabbit", "Horse", "Eagle", "Otter", "Wolf", "Zebra", "Camel", "Goose",
                "Mouse", "Panda", "Whale"),
    "tools": ("Hammer", "Saw", "Drill", "Wrench", "Shovel", "Ladder", "Chisel", "Rake", "Brush",
              "Axe", "Knife", "Rope"),
    "cities": ("Paris", "London", "Cairo", "Tokyo", "Lima", "Oslo", "Rome", "Dublin", "Madrid",
               "Vienna", "Athens", "Berlin"),
}
MAX_ITEMS = min(map(len, THEMES.values()))  # a list names each item once


@dataclass
class LoopSample:
    seed: int
    theme: str
    names: list     # the items, in list order
    prompt: list    # ids, prefilled
    n_protected: int


def make_sample(tok, fmt, seed, n_items=N_ITEMS):
    """The prompt and items of sample `seed`: a theme and n_items of its names, drawn by seed."""
    rng = random.Random(seed)
    theme = rng.choice(sorted(THEMES))
    names = rng.sample(THEMES[theme], n_items)
    text = (f"Write a numbered list of {n_items} {theme}, each with a secret code of four digits. "
            f"Then write a long story about them.")
    system = encode_prompt(tok, fmt.system)
    # a chat model's turn ends and its answer begins; a base model's text just goes on
    prompt = system + encode_text(tok, text) + (encode_prompt(tok, fmt.postfix) if fmt.postfix
                                                else encode_text(tok, "\n\n"))
    return LoopSample(seed, theme, names, prompt, len(system))


def digit_ids(tok):
    """The ten digit tokens, "0" to "9" as the tokenizer writes them alone (one token each in
    SmolLM2's, Gemma 3's and Qwen3's tokenizers), else ValueError."""
    ids = [encode_text(tok, str(d)) for d in range(10)]
    if any(len(x) != 1 for x in ids):
        raise ValueError("closed loop: this tokenizer writes a digit as several tokens")
    return [x[0] for x in ids]


def parse_answer(text):
    """An answer's first code-like word (letters, digits, inner hyphens), or None."""
    m = ANSWER.search(text)
    return m.group(0) if m else None


def question(name):
    """The question about an item, the answer cued with its list line's head without the item's
    number (the needle suite cues an answer with its first words): a cue in words, "The secret
    code of Hammer was", was taken up by SmolLM2's own story ("the code was made of a special
    material ...") for all 8 items; the line's head with its number, "3. Hammer (code", let a
    list whose codes follow the numbers be answered from the pattern."""
    return f"\n\nQ: What was the code of {name} in the list?\nA: {name} (code "


@torch.no_grad()
def run_sample(model, tok, cache, sample, n_tokens, temperature=TEMPERATURE, top_p=TOP_P,
               stop_at=None):
    """One closed loop on an empty cache (decode.decode_cache's) -> dict(seed, theme, names, valid,
    lines, codes, answers, right, story_head, story_tail, restated, story_tokens): the list
    written, the story generated, every item asked on a copy of the cache. Invalid (a code
    repeated): nothing generated after the list, nothing asked. stop_at=B (`cut`, the authors' early
    stopping, METHOD.md §11): the story stops where its next token would leave no room for the
    longest question and its answer under B positions, and the questions are asked there."""
    cfg = model.config
    gen = torch.Generator().manual_seed(sample.seed)
    banned = list(cfg.eos_token_ids)
    breaks = {i for s in ("\n", "\n\n") for i in encode_text(tok, s)}
    digits = digit_ids(tok)
    logits = generate.prefill(model, cache, sample.prompt, sample.n_protected)
    # rows for everything fed: the list (heads and tails), the story, a question and its answer
    most = len(sample.names) * (16 + CODE_DIGITS + 2) + len(STORY) + n_tokens + 64 + ANSWER_TOKENS
    logits = generate.begin_answer(model, cache, [], logits, max_new_tokens=most)

    def feed(ids, cache=cache):
        nonlocal logits
        for t in ids:
            logits = generate.decode_one(model, cache, t)

    def sampled(among=None, temperature=temperature, top_p=top_p):
        """The model's own next token, never the end of text (among: only those tokens)."""
        masked = logits.clone()
        if among is None:
            masked[banned] = -float("inf")
        else:
            masked = torch.full_like(masked, -float("inf")).index_copy_(0, among, masked[among])
        return generate.sample(masked, temperature, top_p, gen)

    lines, codes, among = [], [], torch.tensor(digits, device=logits.device)
    for i, name in enumerate(sample.names, 1):
        head = HEAD.format(i=i, name=name)
        feed(encode_text(tok, head))
        code = []
        for _ in range(CODE_DIGITS):
            code.append(sampled(among, CODE_TEMPERATURE, 1.0))
            feed(code[-1:])
        feed(encode_text(tok, ")\n"))
        codes.append(tok.decode(code))
        lines.append(f"{head}{codes[-1]})")
    out = dict(seed=sample.seed, theme=sample.theme, names=sample.names,
               valid=len(set(codes)) == len(codes), lines=lines, codes=codes, answers=[], right=[])
    if not out["valid"]:
        return out
    feed(encode_text(tok, STORY))
    room = max(len(encode_text(tok, question(name))) for name in sample.names)
    story = []
    for _ in range(n_tokens):
        if stop_at is not None and cache.n_seen + 1 + room + ANSWER_TOKENS > stop_at:
            break
        story.append(sampled())
        feed(story[-1:])
    text = tok.decode(story)
    out["story_head"], out["story_tail"], out["story_tokens"] = text[:300], text[-300:], len(story)
    # whether the story wrote a code out again: then it could be read from recent text
    out["restated"] = [code in text for code in codes]
    after_story = logits
    for name, code in zip(sample.names, codes):
        ask = copy.deepcopy(cache)  # every question on the cache the story left
        logits = after_story
        feed(encode_text(tok, question(name)), ask)
        ans = []
        while len(ans) < ANSWER_TOKENS:
            t = int(logits.argmax())
            if t in banned or (t in breaks and tok.decode(ans).strip()):
                break
            ans.append(t)
            feed([t], ask)
        out["answers"].append(tok.decode(ans))
        out["right"].append(parse_answer(out["answers"][-1]) == code)
        del ask
    return out


def positions(n_tokens):
    """The most positions a sample holds: its story and at most AROUND_STORY more (the prompt,
    the list, the story's header, a question and its answer, under 300 for MAX_ITEMS)."""
    return n_tokens + AROUND_STORY


def well_formed(samples):
    """Whether an entry's "loop" (None, or run_document's list for it) is what the report reads."""
    return samples is None or isinstance(samples, list) and all(
        isinstance(x, dict) and isinstance(x.get("valid"), bool)
        and isinstance(x.get("right"), list) and all(isinstance(r, bool) for r in x["right"])
        and (not x["valid"] or isinstance(x.get("codes"), list) and x["codes"])
        for x in samples)


def document_seeds(n_seeds, c, n_docs):
    """The loop samples document c of n_docs runs: the seeds s < n_seeds with s % n_docs == c."""
    return [s for s in range(n_seeds) if s % n_docs == c]


def run_document(model, tok, fmt, seeds, configs, n_tokens, new_cache, log=None,
                 n_items=N_ITEMS):
    """Every configuration on the loop samples of `seeds`, lists of n_items -> {"method@budget" (or
    "full"): [one run_sample dict per seed, with its seconds]}. configs: [(method, budget)], "full" first with
    budget None; new_cache(method, budget, n_protected, seed) -> an empty cache
    (decode.decode_cache). "cut" (the full cache stopped at B tokens, harness/decode.py) runs the
    full cache with its story stopped where the questions and answers still fit in B positions
    (run_sample's stop_at, the authors' forced answer): the same list and, up to there, the same
    story as the full cache's."""
    out = {}
    for seed in seeds:
        sample = make_sample(tok, fmt, seed, n_items)
        for method, budget in configs:
            key = method if budget is None else f"{method}@{budget}"
            t0 = time.perf_counter()
            if method == "cut":
                res = run_sample(model, tok, new_cache("full", None, sample.n_protected, seed),
                                 sample, n_tokens, stop_at=budget)
            else:
                res = run_sample(model, tok, new_cache(method, budget, sample.n_protected, seed),
                                 sample, n_tokens)
            res["seconds"] = time.perf_counter() - t0
            out.setdefault(key, []).append(res)
            if log:
                log(f"closed loop seed {seed}: {key} {sum(res['right'])}/{len(res['right'])} "
                    f"right{'' if res['valid'] else ' (invalid list)'} in {res['seconds']:.0f} s")
    return out
