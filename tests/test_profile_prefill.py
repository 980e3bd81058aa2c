"""harness/profile_prefill.py's FLOP count, against a naive count over every token and layer."""
from types import SimpleNamespace

from harness.profile_prefill import prefill_flops


def test_prefill_flops_counts_each_visible_pair_and_projection_once():
    windows = [3, None, 3]  # a sliding layer, a global one, a sliding one
    cfg = SimpleNamespace(hidden_size=8, head_dim=4, intermediate_size=12, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=3, vocab_size=50,
                          window=lambda layer: windows[layer])
    n, chunk, D, d, I, Hq, Hk = 10, 4, 8, 4, 12, 4, 2
    linear = attention = 0
    for i in range(n):  # token i sees keys 0..i, or its last W
        for w in windows:
            linear += 2 * (D * Hq * d + 2 * D * Hk * d + Hq * d * D + 3 * D * I)
            attention += Hq * 4 * d * (min(i + 1, w) if w else i + 1)
    linear += 3 * 2 * D * cfg.vocab_size  # one logit row per chunk: 3 chunks of <= 4
    f = prefill_flops(cfg, n, chunk, gated_layers=2, gate_dims=(6, 2))
    assert (f["linear"], f["attention"]) == (linear, attention)
    assert f["total"] == linear + attention and f["gate"] == n * 2 * 2 * D * (6 + 2)
