"""Many sequences at once: a batch is more KV heads (METHOD.md §8).

`Batch` holds B sequences decoding together in one ragged cache per layer, and answers the model's
three calls (`positions`, `attend`, `advance`) as a single cache does; a member's layers are
`HeadSlice` views of its own heads while it belongs to the batch. `extend` and `pop_heads` are a
sequence joining and leaving one layer's storage. generate.decode runs requests through a Batch
(serving/scheduler.py makes one); the method's modules import none of this.
"""
import copy

import torch

from cache import EvictingCache, HeldBytes, KVCache, WindowKV, check_answering, new_layers
from kernels import ArgumentError, _ranges

# -------------------------------------------------------------------------------------------------
# One layer's storage: joining is a concatenation of heads, leaving a cut.
# The regions of a RaggedKV lie packed in head order (starts = cumsum(caps) - caps), so a run of
# heads is a run of rows, and every region keeps its rows and slack as it moves.

def extend(kv, other):
    """Append other's heads after kv's own (a sequence joins a batch): one copy of the rows. kv and
    other are layers of one kind, RaggedKV or WindowKV (a ring keeps each head's oldest row)."""
    assert (other.head_dim, other.dtype, type(other)) == (kv.head_dim, kv.dtype, type(kv)), \
        "unlike layers"
    window = isinstance(kv, WindowKV)
    ring = window and other.ring and (kv.ring or kv.n_heads == 0)
    # the old storage is alive until the copy ends
    kv.transient = max(kv.transient, kv.nbytes)
    kv.k, kv.v, kv.pos, kv.score = (torch.cat([a, b]) for a, b in zip(
        (kv.k, kv.v, kv.pos, kv.score), (other.k, other.v, other.pos, other.score)))
    kv.starts = torch.cat([kv.starts, other.starts + int(kv.caps.sum())])
    kv.lens, kv.caps = torch.cat([kv.lens, other.lens]), torch.cat([kv.caps, other.caps])
    kv.n_heads += other.n_heads
    if window:
        kv.first, kv.ring = torch.cat([kv.first, other.first]), ring


def pop_heads(kv, h0, n):
    """Remove heads h0 .. h0+n-1 from kv (a sequence leaves a batch) and return them as a layer of
    their own, holding its rows and no slack (its answer is over); the shared storage shrinks to
    what the others hold."""
    r0, r1 = int(kv.caps[:h0].sum()), int(kv.caps[:h0 + n].sum())  # their rows
    out = copy.copy(kv)  # same class and settings (a WindowKV's window and ring state)
    tensors = (kv.k, kv.v, kv.pos, kv.score)
    lens = kv.lens[h0:h0 + n].clone()
    rows = _ranges(kv.starts[h0:h0 + n], lens).to(kv.device)  # in order: a ring stays one
    out.k, out.v, out.pos, out.score = (x[rows] for x in tensors)
    out.lens, out.caps, out.starts = lens, lens.clone(), torch.cumsum(lens, 0) - lens
    out.n_heads, out.transient = n, 0
    kv.transient = max(kv.transient, kv.nbytes)
    kv.k, kv.v, kv.pos, kv.score = (torch.cat([x[:r0], x[r1:]]) for x in tensors)
    keep = torch.cat([torch.arange(h0), torch.arange(h0 + n, kv.n_heads)])
    kv.lens, kv.caps = kv.lens[keep], kv.caps[keep]
    kv.starts = torch.cumsum(kv.caps, 0) - kv.caps
    kv.n_heads -= n
    if isinstance(kv, WindowKV):
        first = kv.first
        out.first, kv.first = first[h0:h0 + n].clone(), torch.cat([first[:h0], first[h0 + n:]])
    return out


# -------------------------------------------------------------------------------------------------
# The batch: the model's three calls for B sequences, and each member's own eviction

def check_join(batch, cache):
    """Batch.join's cache, else an ArgumentError (with or without -O, where an empty one would
    decode from nothing at position 0): a cache of the batch's model and dtype, in no batch,
    prefilled, its answer begun (begin_answer: an EvictingCache then buffers what it decodes)."""
    if not isinstance(cache, KVCache) or cache in batch.members or \
            any(isinstance(kv, HeadSlice) for kv in cache.layers):
        what = "a member" if isinstance(cache, KVCache) else type(cache).__name__
        raise ArgumentError(f"Batch.join: give a cache.KVCache or EvictingCache that is in no "
                            f"batch yet (a member leaves one with Batch.leave), got {what}")
    if (cache.cfg, cache.dtype, cache.device) != (batch.cfg, batch.dtype, batch.device):
        raise ArgumentError(f"Batch.join: the cache is another model's or dtype's ({cache.dtype}, "
                            f"{cache.device}; the batch: {batch.dtype}, {batch.device})")
    check_answering("Batch.join", cache)


class Batch(HeldBytes):
    """B sequences decoding together, one token each per forward.

    Every layer's storage is ONE RaggedKV (a WindowKV ring in sliding layers) holding the KV heads
    of all members: member b owns heads b*H .. b*H + H-1, each with its own rows, positions and
    length (the layout of an engine's per-head block table), so one attention call per layer serves
    the whole batch. Each member is an ordinary cache (KVCache or EvictingCache) that prefilled
    alone, with its own budget plan: join() moves its rows into the shared storage, leave() moves
    them back out and frees them there. While it is a member, a cache's layers are HeadSlice views
    of its own heads, so its decode-time eviction (EvictingCache.after_step) runs unchanged, on its
    rows only.

    The model calls attend / positions / advance as on a single cache: its T query rows are the B
    members' newest tokens, in join order.
    """

    def __init__(self, cfg, dtype=torch.float32, device="cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.layers = new_layers(cfg, 0, dtype, self.device)
        self.members = []
        self.peak_nbytes = 0

    def _track_peak(self):
        transient = max(kv.transient for kv in self.layers)
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes + transient)
        for kv in self.layers:
            kv.transient = 0

    def join(self, cache):
        """Add a cache that has just run a forward alone (its last logits are the member's next
        sample)."""
        check_join(self, cache)
        for layer, kv in enumerate(cache.layers):
            extend(self.layers[layer], kv)
        self.members.append(cache)
        cache.layers = [HeadSlice(self, cache, layer) for layer in range(len(self.layers))]
        self._track_peak()

    def leave(self, cache):
        """Take a member's rows out of the shared storage, back into a cache of its own."""
        if cache not in self.members:
            raise ArgumentError("Batch.leave: the cache is not a member of this batch")
        H = self.cfg.num_key_value_heads
        h0 = self.members.index(cache) * H
        cache.layers = [pop_heads(kv, h0, H) for kv in self.layers]
        self.members.remove(cache)

    def positions(self, T):
        assert T == len(self.members), \
            f"a batch forward takes one token per member ({len(self.members)}), got {T}"
        return torch.tensor([m.n_seen for m in self.members], device=self.device)

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        """q (B, Hq, d), k/v (B, H, d): one new token per member -> (B, Hq, d), one attention
        call."""
        B, Hq, d = q.shape
        H = k.shape[1]
        for b, m in enumerate(self.members):
            if isinstance(m, EvictingCache):
                assert m.decoding, "a batch only decodes: prefill each member alone first"
                m.buffer_decoded(layer, hidden[b:b + 1], q[b:b + 1])
        kv = self.layers[layer]
        # (B*H, 1): every head of member b at its position
        pos = self.positions(B).repeat_interleave(H)[:, None]
        # score +inf, as any decoded token
        kv.append(k.reshape(1, B * H, d), v.reshape(1, B * H, d), pos)
        self._track_peak()
        out = kv.attend(q.reshape(1, B * Hq, d), scale, window)  # query head (b*H + h)*G + g
        if isinstance(kv, WindowKV):
            kv.wrap()
        return out.view(B, Hq, d)

    def advance(self, T):
        for m in self.members:
            m.advance(1)

    def after_step(self):
        """Each member's decode-time eviction (every 128 of its tokens), on its own heads."""
        for m in self.members:
            if isinstance(m, EvictingCache):
                m.after_step()
        self._track_peak()


class HeadSlice:
    """Member `cache`'s heads of a Batch's layer `layer`, seen as a RaggedKV of H heads: what an
    EvictingCache reads and changes during decoding (scores, positions, keep_rows) lands on those
    rows."""

    def __init__(self, batch, cache, layer):
        self.batch, self.cache, self.layer = batch, cache, layer

    @property
    def kv(self):
        return self.batch.layers[self.layer]

    @property
    def heads(self):
        H = self.batch.cfg.num_key_value_heads
        h0 = self.batch.members.index(self.cache) * H
        return slice(h0, h0 + H)

    n_heads = property(lambda self: self.batch.cfg.num_key_value_heads)
    head_dim = property(lambda self: self.kv.head_dim)
    lens = property(lambda self: self.kv.lens[self.heads])
    starts = property(lambda self: self.kv.starts[self.heads])
    n_rows = property(lambda self: int(self.lens.sum()))
    # this member's share of the storage; the shared storage's re-layouts are the batch's to count
    nbytes = property(lambda self: int(self.kv.caps[self.heads].sum()) * 2 * self.head_dim
                      * self.kv.k.element_size())
    kept_nbytes = property(lambda self: self.n_rows * 2 * self.head_dim * self.kv.k.element_size())
    transient = property(lambda self: 0, lambda self, value: None)

    def head_pos(self, h):
        return self.kv.head_pos(self.heads.start + h)

    def head_score(self, h):
        return self.kv.head_score(self.heads.start + h)

    def set_tail_scores(self, score):
        self.kv.set_tail_scores(score, self.heads.start)

    def head_keys(self, h):
        return self.kv.head_keys(self.heads.start + h)

    def keep_rows(self, mask, room=0):
        """mask over this member's used rows, head after head; the other members keep all."""
        kv = self.kv
        assert mask.numel() == self.n_rows, "one mask entry per used row of the member's heads"
        everything = torch.ones(kv.n_rows, dtype=torch.bool, device=mask.device)
        first = int(kv.lens[:self.heads.start].sum())  # the member's rows follow the heads before
        everything[first:first + mask.numel()] = mask
        kv.keep_rows(everything, room)

    def reserve(self, n):
        need = torch.zeros(self.kv.n_heads, dtype=torch.long)
        need[self.heads] = n
        self.kv.reserve(need)


def batch_for(model, batch_size):
    """An empty Batch in the model's dtype and device for batch_size requests at once, None for one
    (generate.decode then answers on the request's own cache)."""
    emb = model.model.embed_tokens.weight
    return Batch(model.config, emb.dtype, emb.device) if batch_size > 1 else None
