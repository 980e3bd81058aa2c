"""
The decode suite of bench.py (--suite decode): what decode-time eviction keeps and loses, measured
through the path generation takes (METHOD.md §7): a short prompt prefilled, `begin_answer`, then
every later token a decode step, buffered, scored every 128 tokens and evicted back to a budget of
B tokens per KV head (`generate.py --decode-tokens-per-head B`).

Per document (a held-out Austen chapter: never in a bundled gate's training corpus, which is
Wikipedia, State of the Union addresses and the Python reference, offline/README.md), one stream:
    nll      long-text modelling: the NLL of every document token at a position >= B, relative to
             the full cache's on the same tokens (exp(NLL_full - NLL): 1 = lossless)
    recall   facts stated early in the stream (names with numbers, places with code words, in varied
             sentences) and asked again --decode-gaps tokens later in the same stream: accuracy of
             the answer tokens (argmax, teacher-forced), exact answers, and their NLL
    generation  (the last --decode-generations documents) a greedy generation of
             --decode-gen-tokens tokens (end of turn masked) after a prompt that states a fact,
             then the question about it: tokens until the first difference from the full cache's
             generation, and whether the answer is the same (and correct)
    loop     (--loop-seeds) the closed-loop task of harness/closed_loop.py: the model writes a list
             of codes, a long story, then is asked for each code, scored against what it wrote
Teacher forcing feeds the stream 128 tokens per forward, aligned with the decode buffer, then calls
cache.after_step(): tests/test_decode_suite.py proves it gives the logits and kept rows of
token-by-token decoding (generate.decode_one).

"cut" is the full-cache baseline of the authors' math runs, run as their code runs it
(Janghyun1230/FastKVzip:math/run.sh, the `--method fullkv --max_length` loop; METHOD.md §11): a
full cache whose sequence never holds more than B tokens, its answer forced in the room left
before B (math/run_math.py lines 72-122: the thinking stops at max_length - offset tokens, the
answer prompt is appended, the answer is generated up to max_length). In this suite's terms:
    recall   a probe whose answer ends before B is the full cache's; any later one is asked at the
             budget instead of at its gap: the stream up to B minus the probe's question and answer
             tokens, then its question, its answer teacher-forced (cut_probes)
    generation  the greedy generation stops where the prompt, the generation, the question and
             ANSWER_TOKENS fill B; the question is asked there and answered greedily (cut_generation)
    nll      no token past B is ever predicted: n/a
What maps and what does not: METHOD.md §11.

Each row runs a configuration, a method at a level and a local window, or the static split of
heads (harness/decode_config.py: METHOD[@LEVEL][/wN], e.g. fastkvzip@head/w8, rkv@global/w128,
split); a split's heads are ranked by the gate's pool teacher-forced on a stream (head_fill): the
run's calibration document, one more Austen chapter than --contexts that is never evaluated
(make_streams), or for split-self the evaluated stream itself.

Speed and memory (speed(): one long greedy generation per configuration, ms per decoded token and
the KV bytes held at each point of --speed-lengths, beside transformers' generate), bench.py's flags,
run and --merge are in harness/decode_suite.py; the report (tables, intervals, plots) in
harness/decode_report.py.
"""
import random
import time
from dataclasses import asdict, dataclass, field

import torch

import generate
from cache import EvictingCache
from formats.gate_file import resolve_gate
from gate import METHODS as SCORERS
from harness import closed_loop, decode_config
from harness.quality import OWNERS, TEXT_NAMES, answer_stops, load_docs, log, model_info
from prompts import encode_prompt, encode_text, prompt_format, question_ids

# the full cache, every method of gate.METHODS that evicts while decoding, and "cut", no cache of
# its own: the full cache whose answer is forced before it holds B tokens (module docstring)
METHODS = ("full",) + tuple(m for m, kind in SCORERS.items() if kind and kind.decode) + ("cut",)
BUDGETS = (256, 512, 1024, 2048)  # tokens per KV head
GAPS = (1024, 2048, 4096, 6000)  # recall: tokens between a fact and its question
LENGTH = 6600  # stream tokens: the facts (~300), the longest gap, room for sentence ends
PROMPT = 64  # document tokens prefilled before decoding starts ("a short prompt")
GEN_TOKENS = 2048
ANSWER_TOKENS = 12  # the final answer: a value and its full stop fit easily
FACT_START = 32  # the first fact this many tokens after the prompt, the others FACT_STEP apart
FACT_STEP = 64
SENTENCE_WAIT = 200  # a fact or probe waits at most this many tokens for a sentence end


@dataclass
class DecodeExperiment:
    """What makes two runs' documents the same experiment (bench.py --suite decode's flags): runs
    are resumed or merged only if these, the model and the gate are equal."""
    methods: list           # "full" first
    budgets: list           # decode tokens per KV head
    contexts: int           # documents
    length: int             # stream tokens per document
    gaps: list              # recall distances
    prompt_tokens: int
    generations: int        # documents that also run a free generation
    gen_tokens: int
    gen_budgets: list       # the budgets the free generations run at (a CPU saving)
    seed: int
    chat: bool | None = None  # the free generation's prompt format
    device: str = "cpu"
    suite: str = "decode"
    loop: dict | None = None  # the closed-loop task's settings (loop_settings), None: not run
    # the streams' documents (quality.load_docs): "austen" or "prose" (a free generation's prompt
    # calls its excerpt "a story" either way)
    text: str = "austen"


# ---- 1. Streams: a document with facts stated early and asked for later --------------------------

NUMBER_NOUNS = ("locker", "ticket", "account", "cabin", "permit", "badge")
PLACES = ("north gate", "old mill", "boat house", "east tower", "wine cellar", "rose garden")
WORDS = ("marigold", "tangerine", "obsidian", "lantern", "juniper", "saffron", "harbour",
         "thimble", "walnut", "cobalt", "meadow", "falcon")
# how a fact is stated, and how it is asked again later: the same subject phrase, other sentences
INTROS = (" By the way, {s} is {v}.", " It was written down that {s} is {v}.",
          " Everyone was told that {s} is {v}.", " Note this well: {s} is {v}.")
PROBES = (" As was said long before, {s} is", " To recall it once more, {s} is",
          " Nobody had forgotten that {s} is", " It was still true that {s} is")


@dataclass
class Fact:
    subject: str  # "Colonel Brandt's locker number", "the code word for the north gate"
    value: str    # "48213", "juniper"


def make_fact(rng, i):
    """Fact i: even ones a name with a number, odd ones a place with a code word."""
    if i % 2 == 0:
        who, noun = OWNERS[(i // 2) % len(OWNERS)], rng.choice(NUMBER_NOUNS)
        return Fact(f"{who}'s {noun} number", "".join(rng.choice("123456789") for _ in range(5)))
    return Fact(f"the code word for the {PLACES[(i // 2) % len(PLACES)]}", rng.choice(WORDS))


@dataclass
class Stream:
    ids: list        # prompt ⊕ document with facts and probes
    n_prompt: int    # prefilled; every later token is a decode step
    n_protected: int  # the BOS text (never evicted)
    doc_pos: list    # positions of document tokens (the nll task's)
    probes: list     # [(gap, [answer positions], where the fact's statement ended)]
    doc: str
    # a probe's first answer position -> where its question begins (cut asks it elsewhere)
    questions: dict = field(default_factory=dict)


def make_stream(tok, name, doc, start, length, gaps, n_prompt, rng):
    """A stream of `length` tokens: start (the BOS text) ⊕ the document, with one fact per gap
    stated early (FACT_START, then every FACT_STEP tokens, at the next sentence end) and asked again
    `gap` tokens after its statement, again at a sentence end; None if the document ends first."""
    facts = [make_fact(rng, i) for i in range(len(gaps))]
    enc = lambda text: encode_text(tok, text)
    ids, doc_pos, probes, stated, questions = list(start), [], [], {}, {}
    # events: (stream position to wait for, kind, fact index)
    todo = [(len(start) + n_prompt + FACT_START + FACT_STEP * i, "intro", i)
            for i in range(len(facts))]
    waited = 0
    for t in doc:
        if len(ids) >= length:
            break
        due = min(todo) if todo else None
        if due and len(ids) >= due[0] and len(ids) >= len(start) + n_prompt:
            sentence = tok.decode(ids[-1:]).rstrip().endswith((".", "!", "?", '"'))
            waited += 1
            if sentence or waited > SENTENCE_WAIT:
                todo.remove(due)
                waited = 0
                _, kind, i = due
                f = facts[i]
                if kind == "intro":
                    ids += enc(rng.choice(INTROS).format(s=f.subject, v=f.value))
                    stated[i] = len(ids)
                    todo.append((len(ids) + gaps[i], "probe", i))
                else:
                    asked = len(ids)
                    ids += enc(rng.choice(PROBES).format(s=f.subject))
                    answer = enc(" " + f.value)
                    questions[len(ids)] = asked
                    probes.append((gaps[i], list(range(len(ids), len(ids) + len(answer))),
                                   stated[i]))
                    ids += answer + enc(".")
        doc_pos.append(len(ids))
        ids.append(t)
    if todo or len(ids) < length or max(p[-1] for _, p, _ in probes) >= length:
        return None
    return Stream(ids[:length], len(start) + n_prompt, len(start),
                  [p for p in doc_pos if p < length], sorted(probes), name, questions)


def make_streams(tok, fmt, exp):
    """exp.contexts streams, each from another document of exp.text long enough (an Austen chapter,
    or a held-out prose text: quality.prose_texts; shuffled by seed), and one more, the
    calibration document that ranks a split's heads, when exp.methods holds a split ranked on
    another document (the first exp.contexts streams are the same either way)."""
    docs = load_docs(tok, exp.text)
    random.Random(exp.seed).shuffle(docs)
    start = encode_prompt(tok, fmt.system)
    rng, out = random.Random(exp.seed), []
    for name, doc in docs:
        s = make_stream(tok, name, doc, start, exp.length, exp.gaps, exp.prompt_tokens, rng)
        if s is not None:
            out.append(s)
        if len(out) == exp.contexts + calibrates(exp):
            return out
    raise ValueError(f"only {len(out)} {TEXT_NAMES[exp.text]} hold a stream of {exp.length} tokens with "
                     f"gaps {exp.gaps}; ask fewer contexts or a shorter length")


def calibrates(exp):
    """Whether a configuration of exp ranks a split's heads on a document of its own."""
    return any(decode_config.parse(m).method == "split" for m in exp.methods)


# ---- 2. The decode path: teacher-forced and free -------------------------------------------------

def decode_cache(model, method, n_protected, budget, gates, seed, fill=None):
    """An empty cache as `generate.py --method M --decode-tokens-per-head B` makes it, for a
    method or a configuration (harness/decode_config.py: METHOD[@LEVEL][/wN], split); fill: a
    split's ranking of heads (head_fill)."""
    return decode_config.make_cache(model, method, n_protected, budget, gates, seed, fill)


class HeadFill:
    """teacher_force's each_block: the rows each compressed head holds after every block (after
    its eviction, if any) -> mean(): (L_c, H), summed in float64."""

    def __init__(self):
        self.total, self.blocks = 0, 0

    def __call__(self, cache):
        lens = [cache.layers[layer].lens.cpu() for layer in cache.compressed]
        self.total = self.total + torch.stack(lens).double()
        self.blocks += 1

    def mean(self):
        return self.total / self.blocks


def head_fill(model, gates, stream, budget, window):
    """How much the gate's pool at `budget` and `window` (fastkvzip@global/wN) fills each head of
    `stream`, teacher-forced: (L_c, H) mean rows held after each block (a split's ranking)."""
    fill = HeadFill()
    cache = decode_cache(model, decode_config.pool(window), stream.n_protected, budget, gates, 0)
    teacher_force(model, cache, stream.ids, stream.n_prompt, stream.n_protected, each_block=fill)
    return fill.mean()


@torch.no_grad()
def teacher_force(model, cache, ids, n_prompt, n_protected, block=True, each_block=None):
    """Prefill ids[:n_prompt], begin_answer, then feed the rest as decode steps -> (nll, hit): for
    every position p >= n_prompt, -log P(ids[p] | ids[:p]) and whether ids[p] was the argmax
    (float32 tensors of len(ids) - n_prompt). block: 128 tokens (the decode buffer) per forward,
    then cache.after_step() (the same logits and kept rows as token by token: the test); else
    generate.decode_one for each token. each_block(cache): called after each block's
    after_step."""
    logits = generate.prefill(model, cache, ids[:n_prompt], n_protected)
    logits = generate.begin_answer(model, cache, [], logits, max_new_tokens=len(ids) - n_prompt)
    nll, hit = [], []

    def score(logits, targets):  # (T, vocab), (T,)
        logp = torch.log_softmax(logits.float(), -1)
        nll.append(-logp.gather(1, targets[:, None])[:, 0].cpu())
        hit.append((logits.argmax(-1) == targets).float().cpu())

    score(logits[None], torch.tensor(ids[n_prompt:n_prompt + 1], device=logits.device))
    step = getattr(cache, "decode_buffer", 128) if block else 1
    evicting = isinstance(cache, EvictingCache)
    for i in range(n_prompt, len(ids) - 1, step):
        chunk = ids[i:min(i + step, len(ids) - 1)]
        if block:
            out = model(torch.tensor(chunk, device=cache.device), cache)  # (T, vocab)
            if evicting:  # the buffer is full exactly at a block's end: gate it, evict
                cache.after_step()
            if each_block is not None:
                each_block(cache)
        else:
            out = generate.decode_one(model, cache, chunk[0])[None]
        score(out, torch.tensor(ids[i + 1:i + 1 + len(chunk)], device=out.device))
    return torch.cat(nll), torch.cat(hit)


def masked_argmax(logits, banned):
    """Greedy, but never a token of `banned` (end of turn: the generation must go on)."""
    logits = logits.clone()
    logits[list(banned)] = -float("inf")
    return int(logits.argmax())


@torch.no_grad()
def free_generation(model, cache, prompt, n_protected, n_tokens, question, stops, banned):
    """Greedy generation through the decode path: prompt prefilled, n_tokens generated (banned ids
    masked), the question's ids fed as decode steps, then a greedy answer of at most
    ANSWER_TOKENS, ending at a stop id -> (generated ids, answer ids)."""
    logits = generate.prefill(model, cache, prompt, n_protected)
    # fed: the generation, the question, the answer but its last token (never fed back)
    logits = generate.begin_answer(model, cache, [], logits,
                                   max_new_tokens=n_tokens + len(question) + ANSWER_TOKENS + 1)
    out = []
    for _ in range(n_tokens):
        out.append(masked_argmax(logits, banned))
        logits = generate.decode_one(model, cache, out[-1])
    for t in question:
        logits = generate.decode_one(model, cache, t)
    answer = []
    while len(answer) < ANSWER_TOKENS:
        t = int(logits.argmax())
        if t in stops:
            break
        answer.append(t)
        logits = generate.decode_one(model, cache, t)
    return out, answer


def generation_task(tok, fmt, stream, fact, n_excerpt=160):
    """The free generation of a stream's document: the chat (or plain) prompt holds the start of
    the chapter and a fact, and asks for a long continuation -> (prompt ids, n_protected, question
    ids, the expected value)."""
    excerpt = tok.decode(stream.ids[stream.n_protected:stream.n_protected + n_excerpt])
    text = (f"Here is the beginning of a story:\n\n{excerpt}\n\nRemember this: {fact.subject} is "
            f"{fact.value}. Now continue the story at length.")
    system = encode_prompt(tok, fmt.system)
    prompt = system + encode_text(tok, text) + encode_prompt(tok, fmt.postfix)
    question = question_ids(tok, fmt, f"What is {fact.subject}?", f"{fact.subject} is")
    return prompt, len(system), question, fact.value


# ---- 3. One document: every configuration --------------------------------------------------------

def entry(nll, hit, ref, stream, budget):
    """One (method, budget) on one stream: the nll task's [NLL sum, tokens, the full cache's sum]
    over document tokens at positions >= budget; per probe [gap, tokens, argmax hits, NLL sum,
    the full cache's NLL sum]."""
    n0 = stream.n_prompt
    pos = torch.tensor([p for p in stream.doc_pos if p >= max(budget, n0)], dtype=torch.long) - n0
    out = dict(nll=[float(nll[pos].sum()), len(pos), float(ref[0][pos].sum())])
    at = lambda p: [x - n0 for x in p]  # answer positions -> indices of the forced tokens
    out["probes"] = [[gap, len(p), float(hit[at(p)].sum()), float(nll[at(p)].sum()),
                      float(ref[0][at(p)].sum())] for gap, p, _ in stream.probes]
    return out


def cut_probes(model, stream, budget, full):
    """cut at `budget` on a stream (module docstring): a probe whose answer ends before the budget
    is the full cache's (`full`, its entry); a later one is asked at the budget instead: the
    stream's first s tokens, s = budget - the probe's question and answer tokens (at least the
    prompt), then its question and answer, teacher-forced through a full cache -> the entry's
    probes (as entry's) and where each question began."""
    probes, asked = [], []
    for pr, (gap, pos, _) in zip(full["probes"], stream.probes):
        q = stream.questions[pos[0]]
        if pos[-1] < budget:  # the sequence up to the answer fits: the question at its gap
            probes.append(pr)
            asked.append(q)
            continue
        s = max(stream.n_prompt, budget - (pos[-1] + 1 - q))  # the answer's room, as their offset
        ids = stream.ids[:s] + stream.ids[q:pos[-1] + 1]
        nll, hit = teacher_force(model, decode_cache(model, "full", stream.n_protected, None,
                                                     None, 0), ids, stream.n_prompt,
                                 stream.n_protected)
        at = [s + p - q - stream.n_prompt for p in pos]  # the answer's forced tokens
        probes.append([gap, len(pos), float(hit[at].sum()), float(nll[at].sum()), pr[4]])
        asked.append(s)
    return probes, asked


def cut_generation(model, prompt, n_protected, budget, n_tokens, question, stops, banned):
    """cut's free generation (module docstring): greedy through a full cache for as many of the
    n_tokens as leave the question and ANSWER_TOKENS within `budget` positions, then the question
    and the answer -> (generated ids, answer ids)."""
    n = max(0, min(n_tokens, budget - len(prompt) - len(question) - ANSWER_TOKENS))
    return free_generation(model, decode_cache(model, "full", n_protected, None, None, 0),
                           prompt, n_protected, n, question, stops, banned)


def first_difference(out, ref):
    """Tokens of a generation before the first that differs from the full cache's (its length if
    none: a cut generation stops early)."""
    return next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(out))


def run(model, tok, exp, model_name, gate_file, shard=(0, 1), done=(), on_context=None,
        streams=None):
    """Every configuration of exp on every document of this shard (contexts c with c % n == k) but
    those in `done`; on_context(record) after each. streams: make_streams' (made here if None):
    the documents, then the calibration document if a split needs one."""
    cfg, _, device = model_info(model)
    fmt_plain = prompt_format(cfg, model_name, chat=False)
    fmt_gen = prompt_format(cfg, model_name, chat=exp.chat)
    gates = (resolve_gate(gate_file, cfg, model_name, device=device)
             if any(map(decode_config.needs_gate, exp.methods)) else None)
    streams = streams or make_streams(tok, fmt_plain, exp)
    streams, calibration = streams[:exp.contexts], streams[exp.contexts:]
    stops = answer_stops(cfg, tok)
    banned = set(cfg.eos_token_ids)
    scored = [decode_config.parse(m) for m in exp.methods if m not in ("full", "cut")]
    fills = {}  # a split's ranking by (the stream ranked on, budget, window): head_fill's

    def fill(conf, budget, c):
        if conf.method not in decode_config.SPLIT:
            return None
        on = c if conf.method == "split-self" else "calibration"
        if (on, budget, conf.window) not in fills:
            fills[on, budget, conf.window] = head_fill(
                model, gates, streams[c] if on == c else calibration[0], budget, conf.window)
        return fills[on, budget, conf.window]
    k_shard, n_shard = shard
    todo = [c for c in range(len(streams)) if c % n_shard == k_shard and c not in done]
    t_start = time.perf_counter()
    for n_done, c in enumerate(todo, 1):
        stream, t0 = streams[c], time.perf_counter()
        rng = random.Random(exp.seed * 1000 + c)
        gen = c >= len(streams) - exp.generations  # the last documents: the others report sooner
        task = generation_task(tok, fmt_gen, stream, make_fact(rng, c)) if gen else None
        ref = teacher_force(model, decode_cache(model, "full", stream.n_protected, None, None, 0),
                            stream.ids, stream.n_prompt, stream.n_protected)
        entries = {"full": entry(*ref, ref, stream, 0)}
        ref_gen = None
        if gen:
            prompt, n_prot, question, value = task
            out, ans = free_generation(model, decode_cache(model, "full", n_prot, None, None, 0),
                                       prompt, n_prot, exp.gen_tokens, question, stops, banned)
            ref_gen = dict(out=out, answer=ans)
            entries["full"]["gen"] = dict(first_diff=len(out), same=True,
                                          correct=value in tok.decode(ans))
        log(f"decode doc {c + 1}/{len(streams)} ({stream.doc}): full cache done in "
            f"{time.perf_counter() - t0:.0f} s")
        for conf in scored:
            method = conf.name
            for budget in exp.budgets:
                t1 = time.perf_counter()
                cache = decode_cache(model, conf, stream.n_protected, budget, gates,
                                     exp.seed + c, fill(conf, budget, c))
                # the gate's pool on this stream: split-self's ranking, not computed again
                held = HeadFill() if conf == decode_config.pool(conf.window) else None
                e = entries[f"{method}@{budget}"] = entry(
                    *teacher_force(model, cache, stream.ids, stream.n_prompt, stream.n_protected,
                                   each_block=held), ref, stream, budget)
                e["kept_nbytes"], e["nbytes"] = cache.kept_nbytes, cache.nbytes
                if held is not None:
                    fills.setdefault((c, budget, conf.window), held.mean())
                del cache
                if gen and budget in exp.gen_budgets:
                    cache = decode_cache(model, conf, n_prot, budget, gates, exp.seed + c,
                                         fill(conf, budget, c))
                    out, ans = free_generation(model, cache, prompt, n_prot, exp.gen_tokens,
                                               question, stops, banned)
                    e["gen"] = dict(first_diff=first_difference(out, ref_gen["out"]),
                                    same=ans == ref_gen["answer"],
                                    correct=value in tok.decode(ans))
                    del cache
                log(f"decode doc {c + 1}: {method}@{budget} in {time.perf_counter() - t1:.0f} s")
        for budget in exp.budgets if "cut" in exp.methods else ():
            t1 = time.perf_counter()
            probes, asked = cut_probes(model, stream, budget, entries["full"])
            e = entries[f"cut@{budget}"] = dict(nll=None, probes=probes, asked_at=asked)
            if gen and budget in exp.gen_budgets:
                out, ans = cut_generation(model, prompt, n_prot, budget, exp.gen_tokens, question,
                                          stops, banned)
                e["gen"] = dict(first_diff=first_difference(out, ref_gen["out"]),
                                same=ans == ref_gen["answer"], correct=value in tok.decode(ans),
                                stopped=len(out) < exp.gen_tokens, generated=len(out))
            log(f"decode doc {c + 1}: cut@{budget} in {time.perf_counter() - t1:.0f} s")
        for key, samples in loop_samples(model, tok, fmt_gen, exp, c, len(streams), gates,
                                         lambda conf, budget: fill(conf, budget, c)).items():
            entries[key]["loop"] = samples
        record = dict(context=c, doc=stream.doc, n_tokens=len(stream.ids),
                      seconds=time.perf_counter() - t0, entries=entries)
        if gen:
            record["generation"] = dict(expected=value, full_answer=tok.decode(ref_gen["answer"]),
                                        full_text=tok.decode(ref_gen["out"][:200]))
        left = len(todo) - n_done
        log(f"decode doc {c + 1}/{len(streams)}: done in {record['seconds'] / 60:.1f} min; {left} "
            f"left, eta {(time.perf_counter() - t_start) / n_done * left / 60:.0f} min")
        if on_context:
            on_context(record)


def loop_settings(seeds, tokens, budgets, items=closed_loop.N_ITEMS):
    """DecodeExperiment.loop: the closed-loop task's settings (harness/closed_loop.py), None for
    no seeds."""
    return None if not seeds else dict(
        seeds=seeds, tokens=tokens, budgets=budgets, items=items,
        temperature=closed_loop.TEMPERATURE, top_p=closed_loop.TOP_P,
        code_digits=closed_loop.CODE_DIGITS, code_temperature=closed_loop.CODE_TEMPERATURE)


def loop_samples(model, tok, fmt, exp, c, n_docs, gates, fill=lambda conf, budget: None):
    """The closed-loop samples document c runs (its share of exp.loop's seeds), every configuration
    at every loop budget, each cache as the document's (decode_cache; fill: a split's ranking)
    -> {entry key: [samples]}; {} when it runs none."""
    seeds = closed_loop.document_seeds(exp.loop["seeds"], c, n_docs) if exp.loop else []
    if not seeds:
        return {}
    confs = {conf.name: conf for conf in map(decode_config.parse, exp.methods)
             if conf.name != "full"}
    configs = [("full", None)] + [(name, b) for name in confs for b in exp.loop["budgets"]]

    def new_cache(name, budget, n_protected, seed):
        conf = confs.get(name, name)
        return decode_cache(model, conf, n_protected, budget, gates, seed,
                            None if name == "full" else fill(conf, budget))
    return closed_loop.run_document(model, tok, fmt, [exp.seed * 1000 + s for s in seeds],
                                    configs, exp.loop["tokens"], new_cache, log,
                                    exp.loop["items"])


def run_key(exp, config):
    """What makes two runs' documents the same experiment (resume, merge); a run without the
    closed loop, or on Austen, has the key it had before either option existed (its folder
    resumes)."""
    key = dict(asdict(exp), model=config["model"]["sha256"], gate=config["gate"]["sha256"])
    if key["loop"] is None:
        del key["loop"]
    if key["text"] == "austen":
        del key["text"]
    return key
