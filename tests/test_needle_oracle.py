"""harness/needle_oracle.py: the needles' tokens are found in the prompt (checked by decoding them),
and its oracle scorer keeps exactly those positions whatever the other scorer says."""
import math
import random

import pytest
import torch

from gate import StreamingScorer
from harness import needle_oracle as O
from harness import ruler_tasks
from prompts import encode_text
from tests.assets import require_asset


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    require_asset("austen")
    return Tokenizer.from_file(str(require_asset("tokenizers", "gemma3", "tokenizer.json")))


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multivalue", "niah_multikey_1",
                                  "niah_multikey_3"])
def test_needle_positions_cover_the_answer_sentences(tok, task):
    row = ruler_tasks.make_row(task, 42, 0, 60, 4096)
    spans = O.needle_spans(row)
    n_values = ruler_tasks.NIAH[task][4] * ruler_tasks.NIAH[task][5]
    assert len(spans) == n_values  # one sentence per value asked, none of the distractors
    for s, e in spans:  # each a needle's sentence alone, never text between two needles
        assert row["context"][s:e].count("special magic") == 1
    system = [2]  # a BOS before the context, as a prompt without a chat template
    ids = system + encode_text(tok, row["context"])
    pos = O.needle_positions(tok, ids, row["context"], spans)
    text = tok.decode([ids[p] for p in pos])
    for value in row["answer"]:
        assert value in text
    # nothing beyond the sentences: each token picked overlaps one of them
    assert len(pos) < sum(len(encode_text(tok, row["context"][s:e])) + 2 for s, e in spans)


def test_force_keep_overrides_only_its_positions():
    inner = StreamingScorer(n_kv_heads=2)
    keep = {3, 7}
    s = O.ForceKeep(inner, keep)
    pos = torch.arange(2, 10)
    out = s.score(0, None, None, None, pos)
    ref = inner.score(0, None, None, None, pos)
    forced = torch.isin(pos, torch.tensor(sorted(keep)))
    assert torch.all(out[:, forced] == math.inf)
    assert torch.equal(out[:, ~forced], ref[:, ~forced])
    assert s.level == inner.level


def test_needle_spans_refuse_a_context_without_the_answer():
    row = ruler_tasks.make_row("niah_single_1", 42, 0, 30, 4096)
    row = dict(row, answer=[str(random.Random(0).randint(10**8, 10**9))])
    with pytest.raises(AssertionError):
        O.needle_spans(row)
