"""harness/layer_swap.py: each compressed layer of a swap cache is that layer of the kvzip or
fastkvzip method's own cache (the benchmark's path, quality.prefill_from_capture), so all-teacher IS
KVzip and all-gate IS Fast KVzip, answers included. A tiny random Gemma3 with two global
(compressed) layers."""
import torch

import bench
import gate
import model as M
from formats.gate_file import load_gate, save_gate
from gate import GateScorer
from harness import layer_swap, quality
from prompts import prompt_format
from teacher import KVzipTeacher, kept_by_rule
from tests.helpers import tiny_checkpoint, tiny_tokenizer
from tests.test_bench import same_cache


def test_swap_caches_are_the_methods_own_caches(tmp_path):
    folder = (tiny_checkpoint("gemma3", tmp_path / "tiny", max_position_embeddings=2048,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention", "full_attention"]))
    tiny_tokenizer(folder)
    model, tok = M.load_model(folder, "cpu", torch.float32), M.load_tokenizer(folder)
    cfg = model.config
    assert cfg.compressed_layers == [1, 3]
    fmt = prompt_format(cfg, "gemma3")
    torch.manual_seed(0)
    gate_file = str(tmp_path / "gate.safetensors")
    save_gate(gate_file, gate.Gates(2, cfg.hidden_size, cfg.num_key_value_heads, cfg.group_size),
              {"note": "random"})
    args = bench.parse_args(["--gate", gate_file])
    # a sample in the benchmark's shape (Austen needs a real tokenizer, which a tiny vocabulary
    # cannot hold)
    g = torch.Generator().manual_seed(1)
    rnd = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()
    sample = quality.Sample(ids=[cfg.bos_token_id] + rnd(300), n_protected=1, doc="random",
                            questions=[
                                quality.Question("passkey", rnd(6), tok.decode(rnd(1)), 4),
                                quality.Question("kv", rnd(6), tok.decode(rnd(1)), 4)],
        probes=dict(nll_next=(rnd(1), rnd(12)), nll_repeat=(rnd(8), rnd(12))))
    teacher, stops = KVzipTeacher(model, tok, fmt), quality.answer_stops(cfg, tok)
    budget, p = 0.4, sample.n_protected
    with torch.no_grad():
        full, scores = layer_swap.capture(model, sample, teacher,
                                          GateScorer(load_gate(gate_file, cfg)),
                                          args.chunk_size)
        keep = {s: kept_by_rule(x, budget, args.chunk_size, args.window)[0]
                for s, x in scores.items()}
        assert not torch.equal(keep["T"],
                               keep["G"]), "teacher and gate must keep different sets here"
        # the oracle: each method's cache, made by the benchmark from its own capture
        ref_full, logits, tscores = quality.capture_prefill(model, sample.ids, args.chunk_size,
                                                            teacher, p)
        methods = {}
        for s, method in (("T", "kvzip"), ("G", "fastkvzip")):
            methods[s] = quality.method_cache(model, method, "global", p, args.model, args.gate, 0,
                                              tscores)
            quality.prefill_from_capture(model, ref_full, logits, methods[s], method, sample,
                                         budget, args.chunk_size, args.window)
        for combo in ("TT", "GG", "TG", "GT"):
            swap = layer_swap.swap_cache(full, p, scores, keep, combo)
            for l, (layer, s) in enumerate(zip(cfg.compressed_layers, combo)):
                a, b = swap.layers[layer], methods[s].layers[layer]
                for h in range(a.n_heads):
                    assert torch.equal(a.head_pos(h), b.head_pos(h)), (combo, layer, h)
            if combo[0] == combo[1]:
                # every layer: positions, keys and values bit for bit
                same_cache(swap, methods[combo[0]])
        entries = layer_swap.swap_context(model, tok, sample, full, scores, [budget],
                                          args.chunk_size, args.window, stops)
        ref = quality.evaluate(model, tok, ref_full, sample, stops)
        for s in "TG":
            m = methods[s]
            want = quality.entry(sample, quality.evaluate(model, tok, m, sample, stops), ref,
                                 m.kept_fraction_per_layer(p, len(sample.ids)), m.nbytes)
            got = entries[f"{s * 2}@{budget:g}"]
            assert (got["tally"] == want["tally"] and got["kept"] == want["kept"] and got["nbytes"]
                    == want["nbytes"])
    assert set(entries) == {"full@1"} | {f"{c}@0.4" for c in ("TT", "TG", "GT", "GG")}
