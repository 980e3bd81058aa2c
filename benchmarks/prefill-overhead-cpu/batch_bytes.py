"""
KV bytes a batch (serving/batch.py) holds against the bytes of the rows it keeps, at B = 1, 4 and
8, after the batched-decode benchmark's work (bench.py --batch-sizes 1,4,8 --batch-length 512
--speed-decode 16: contexts of 75-100% of 512 tokens, a 4-token question, 16 decode steps), for the
full cache and Fast KVzip 0.3; beside them transformers' padded cache for the same tokens (B x the
longest sequence x every layer: an estimate, the measured one is in ../batch-cpu-quiet/). Works on the
code before the reserved answer rows (no begin_answer(max_new_tokens): nothing reserved) and after.

    python -m benchmarks.prefill-overhead-cpu.batch_bytes smollm2-135m-gguf

Run from the repository root; one JSON line per configuration.
"""
import copy
import inspect
import json
import sys

import torch

import generate
import model as M
from cache import Budget
from cli import resolve_model
from formats.gate_file import resolve_gate
from harness.quality import load_docs
from prompts import encode_prompt, prompt_format
from serving.batch import Batch

torch.set_num_threads(1)
name, steps, length = sys.argv[1], 16, 512
folder = resolve_model(name)
tok, model = M.load_tokenizer(folder), M.load_model(folder, "cpu", torch.float32)
cfg = model.config
system = encode_prompt(tok, prompt_format(cfg, name).system)
text = [t for _, d in load_docs(tok) for t in d]
lengths = [length - (length // 4) * i // 7 for i in range(8)]  # as bench.py
docs = [system + text[sum(lengths[:i]):sum(lengths[:i]) + m] for i, m in enumerate(lengths)]
question = [docs[0][-1]] * 4
reserve = "max_new_tokens" in inspect.signature(generate.begin_answer).parameters
gates = resolve_gate(None, cfg, name)
with torch.no_grad():
    for method, budget in (("full", 1.0), ("fastkvzip", 0.3)):
        pre = []
        for ids in docs:
            c = generate.make_cache(method, model, len(system), gates if method == "fastkvzip" else None)
            generate.prefill(model, c, ids, len(system), Budget(budget, 2048, 512))
            pre.append(c)
        for B in (1, 4, 8):
            batch, tokens = Batch(cfg), []
            for c in (copy.deepcopy(x) for x in pre[:B]):
                kw = dict(max_new_tokens=steps + 1) if reserve else {}
                tokens.append(int(generate.begin_answer(model, c, question, **kw).argmax()))
                batch.join(c)
            for _ in range(steps):
                tokens = generate.decode_batch(model, batch, tokens).argmax(-1).tolist()
            kept = sum(kv.n_rows * 2 * kv.head_dim * kv.k.element_size() for kv in batch.layers)
            L = max(len(d) + len(question) for d in docs[:B]) + steps
            hf = B * L * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
            print(json.dumps(dict(model=name, method=method, B=B, held_MiB=batch.nbytes / 2**20,
                                  kept_MiB=kept / 2**20, held_over_kept=batch.nbytes / kept,
                                  transformers_padded_MiB_est=hf / 2**20)), flush=True)
