"""
The scorer's share of the time, measured from outside the method: the method's path holds no
clock and no synchronize (copied into an engine, a synchronize per layer would serialize the GPU),
so the command line and the harness wrap the scorer for the runs they time.
"""
import time

import torch


def time_scorer(scorer, device="cpu"):
    """Wrap scorer.score (and rescore, a decode-time baseline's) on this instance so that
    scorer.seconds counts the seconds its calls take (its type stays: a saved cache records the
    scorer's class, formats/cache_file.py); -> scorer. On a GPU the clock first waits for the work
    queued before the call (the layer's own, which is not the scorer's), then for the call's own."""
    cuda = torch.device(device).type == "cuda"

    def timed(method):
        def call(*args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = method(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            scorer.seconds += time.perf_counter() - t0
            return out
        return call

    scorer.seconds = 0.0
    for name in ("score", "rescore"):
        if hasattr(scorer, name):
            setattr(scorer, name, timed(getattr(scorer, name)))
    return scorer


class TokenClock:
    """Decode speed measured from outside the method (its decode loop holds no clock), from the
    tokens as they arrive: the seconds from each answer's first token to its last, over the
    forwards between them (its tokens after the first). A token arrives as a Python int, so on a
    GPU the work that made it is done by then."""

    def __init__(self):
        self.seconds, self.steps, self.last = 0.0, 0, None

    def new_answer(self):
        """The next token is an answer's first (it comes from the question's forward)."""
        self.last = None

    def token(self, _=None):
        """A token arrived (generate.answer's on_token passes it; its value is not needed)."""
        now = time.perf_counter()
        if self.last is not None:
            self.seconds += now - self.last
            self.steps += 1
        self.last = now

    @property
    def tokens_per_s(self):
        return self.steps / self.seconds if self.steps else None
