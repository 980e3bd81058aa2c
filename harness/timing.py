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
