"""
Where a CPU decode step spends its time: ours (full cache, and Fast KVzip at a budget) beside
transformers on the same checkpoint and the same context, with torch's profiler over a few greedy
decode steps.

    python -m harness.profile_decode                    # Gemma 3 270M, 8K-token context, 16 steps, 2 threads
    python -m harness.profile_decode --length 2048 --steps 32

(run from the repository root: `-m` puts it on the import path.)

Prints, for each of the three: ms per decode step, the share of it the vocabulary projection
(lm_head) alone takes, and the top operators by self time. Memory traffic is the usual
limit of one-token decode on a CPU: each step reads every weight once, so the script also prints the
bytes read per step (weights, lm_head's share, KV) that bound how much a smaller cache can speed
decode up.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import generate
from cache import Budget, EvictingCache
from cli import add_model, add_threads, resolve_model
from formats.checkpoint import load_checked, read_tokenizer
from formats.gate_file import resolve_gate
from harness.quality import load_docs
from harness.speed import load_peer, peer_prefill
from prompts import encode_prompt, prompt_format


def prefill_ours(model, method, budget, ids, n_protected, args):
    gates = resolve_gate(None, model.config, args.model) if method == "fastkvzip" else None
    cache = generate.make_cache(method, model, n_protected, gates)  # fastkvzip: the bundled gate
    logits = generate.prefill(model, cache, ids, n_protected,
                              Budget(budget, args.chunk, args.window))
    if isinstance(cache, EvictingCache):
        cache.start_decoding()  # as generate.answer
    return lambda token: generate.decode_one(model, cache, token), logits, cache.nbytes


def lm_head_ms(weight, repeats=20):
    """One token through the vocabulary projection alone (the same F.linear both models call)."""
    h = torch.randn(1, weight.shape[1])
    torch.nn.functional.linear(h, weight)
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(h, weight)
    return (time.perf_counter() - t0) / repeats * 1e3


@torch.no_grad()
def profile_decode(name, step, logits, kv_bytes, weight_bytes, head_ms, args):
    token = int(logits.argmax())
    for _ in range(2):  # warm up
        token = int(step(token).argmax())
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with record_function("decode_step"):
                token = int(step(token).argmax())
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"\n== {name}: {ms:.1f} ms per decode step under the profiler ({1e3 / ms:.1f} tok/s); "
          f"KV held {kv_bytes / 2**20:.1f} MiB; bytes read per step "
          f"~{(weight_bytes + kv_bytes) / 2**20:.0f} MiB, of which lm_head "
          f"{args.head_bytes / 2**20:.0f} MiB; lm_head alone {head_ms:.1f} ms = {head_ms / ms:.0%} "
          "of the step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    add_threads(p, default=2)
    p.add_argument("--rows", type=int, default=12)
    args = p.parse_args()
    if (not 0 < args.budget <= 1 or min(args.length, args.steps, args.chunk) < 1
        or args.window < 0):
        p.error("--budget must be in (0, 1]; --length, --steps and --chunk >= 1; "
                "--window >= 0")
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    tok, model = read_tokenizer(folder), load_checked(folder, "cpu", torch.float32)
    fmt = prompt_format(model.config, args.model)
    system = encode_prompt(tok, fmt.system)
    ids = system + [t for _, d in load_docs(tok) for t in d][:args.length]
    if len(ids) - len(system) < args.length:
        p.error(f"--length {args.length}: the evaluation text holds only "
                f"{len(ids) - len(system)} tokens")
    weight = model.lm_head.weight.detach()
    args.head_bytes = weight.nbytes
    # what one decode step reads: every matrix once, the embedding table only as lm_head (one row
    # otherwise)
    weight_bytes = sum(t.nbytes for n, t in model.named_parameters(remove_duplicate=False)
                       if not n.endswith("embed_tokens.weight"))
    head_ms = lm_head_ms(weight)
    for method, budget in (("full", 1.0), ("fastkvzip", args.budget)):
        step, logits, kv = prefill_ours(model, method, budget, ids, len(system), args)
        profile_decode(f"ours, {method} at {budget:g}", step, logits, kv, weight_bytes, head_ms,
                       args)
    peer = load_peer(folder)
    if peer is not None:
        forward, logits, kv = peer_prefill(peer, ids, args.chunk)
        step = lambda token: forward([token])
        profile_decode(f"transformers {peer.version}, full", step, logits, kv, weight_bytes,
                       head_ms, args)


if __name__ == "__main__":
    main()
