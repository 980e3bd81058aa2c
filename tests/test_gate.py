"""gate.py (the gate and the scorers), its files (formats/gate_file.py) and the agreement metrics
against oracles: the literal formula of METHOD.md §1.4, the authors' file layout (§1.2, §2), a naive
SnapKV (§10), set arithmetic on the kept positions. Tiny random configs, CPU fp32 (bf16 where the
authors' files use it)."""
import math
import os
import re
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn as nn

from formats import gate_file
from formats.gate_file import GateError, load_gate, resolve_gate, save_gate
from gate import Gates, GateScorer, RandomScorer, SnapKVScorer, StreamingScorer
from teacher import agreement, kept_by_rule, pool_agreement
from tests.helpers import assert_close


def make_cfg(n_layers=3, hidden=32, H=2, G=3, layers=None, n_hidden_layers=None):
    """The fields of model.ModelConfig that formats/gate_file.py reads."""
    layers = list(range(n_layers)) if layers is None else layers
    return SimpleNamespace(hidden_size=hidden, num_key_value_heads=H, num_attention_heads=H * G,
                           group_size=G, compressed_layers=layers,
                           num_hidden_layers=n_hidden_layers or len(layers))


def random_gates(L=3, D=32, H=2, G=3, dim=8, sinks=5, dtype=torch.float32, seed=0, **kw):
    """Gates with every parameter random, including the ones that start at zero/one (k_base, b,
    norms)."""
    torch.manual_seed(seed)
    g = Gates(L, D, H, G, dim=dim, sinks=sinks, dtype=dtype, **kw)
    with torch.no_grad():
        g.k_base.normal_()
        g.b.copy_(torch.randn(L, H, G))
        g.q_norm.uniform_(0.5, 1.5), g.k_norm.uniform_(0.5, 1.5)
        g.q_bias.mul_(3)  # make the bias matter
    return g


def literal_gate(sd, hidden):
    """METHOD.md §1.4 written naively for one layer from the authors' state dict: projections in the
    stored dtype (nn.Linear), Qwen3RMSNorm (§1.3), then per head, token and group
    score_g = 1 / (1 + Σ_r exp(logit_base_r − logit)), logit = k·q/√D' + b, and the mean over G."""
    Wq, bq, Wk = sd["q_proj.weight"], sd["q_proj.bias"], sd["k_proj.weight"]
    H, _, G = sd["b"].shape
    S, Dp = sd["k_base"].shape[2:]
    N = hidden.shape[0]
    x = hidden.to(Wq.dtype)
    qa = nn.functional.linear(x, Wq, bq)  # (N, H·G·D')
    ka = nn.functional.linear(x, Wk)      # (N, H·D')

    def qwen3_rms_norm(v, w):
        vf = v.to(torch.float32)
        vf = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * vf.to(v.dtype)

    out = torch.zeros(H, N, dtype=torch.float64)
    for n in range(N):
        for h in range(H):
            k = qwen3_rms_norm(ka[n, h * Dp:(h + 1) * Dp], sd["k_norm.weight"])
            total = 0.0
            for g in range(G):
                c = (h * G + g) * Dp  # head-major q_proj rows
                q = qwen3_rms_norm(qa[n, c:c + Dp], sd["q_norm.weight"])
                logit = float(k @ q) / math.sqrt(Dp) + float(sd["b"][h, 0, g])
                base = [float(sd["k_base"][h, 0, r] @ q) / math.sqrt(Dp) for r in range(S)]
                total += 1 / (1 + sum(math.exp(t - logit) for t in base))
            out[h, n] = total / G
    return out


# -------------------------------------------------------------------------------------------------
# 1. the gate's math
# -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_equal_literal_formula(dtype):
    g = random_gates(dtype=dtype)
    hidden = torch.randn(g.n_layers, 7, g.hidden)
    batched = g(hidden)
    assert batched.shape == (3, 2, 7) and batched.dtype == torch.float32
    for l in range(g.n_layers):
        want = literal_gate(g.layer_state_dict(l), hidden[l])
        assert_close(g.score_layer(l, hidden[l]), want, atol=1e-6, name=f"score_layer({l}) {dtype}")
        assert_close(batched[l], want, atol=1e-6, name=f"forward[{l}] {dtype}")
        assert_close(batched[l], g.score_layer(l, hidden[l]), atol=1e-6,
                     name=f"batched vs per-layer {l}")


def test_init_matches_nn_linear_default():
    """Per-layer nn.Linear default init in the authors' module order; k_base, b zeros; norms
    ones."""
    L, D, H, G, Dp = 2, 20, 2, 3, 4
    torch.manual_seed(0)
    g = Gates(L, D, H, G, dim=Dp, sinks=5)
    torch.manual_seed(0)
    for l in range(L):
        q_proj, k_proj = nn.Linear(D, H * G * Dp), nn.Linear(D, H * Dp, bias=False)
        assert torch.equal(g.q_weight[l], q_proj.weight) and torch.equal(g.q_bias[l], q_proj.bias)
        assert torch.equal(g.k_weight[l], k_proj.weight)
    assert not g.k_base.any() and not g.b.any() and (g.q_norm == 1).all() and (g.k_norm == 1).all()
    assert g.k_base.dtype == g.q_norm.dtype == torch.float32
    # at init the sinks are zeros: score = mean_g 1/(1 + S·exp(−q·k/√D'))  (METHOD.md §1.4)
    s = g.score_layer(0, torch.randn(5, D))
    assert ((s > 0) & (s < 1)).all()


# -------------------------------------------------------------------------------------------------
# 2-3. the authors' released .pt files
# -------------------------------------------------------------------------------------------------

def authors_state_dict(D, H, G, Dp=16, S=16, seed=0):
    """One layer exactly as the authors' `Weight.state_dict()` (METHOD.md §1.2): bf16 projections
    and b, fp32 norms and k_base, in their registration order."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)
    return OrderedDict([
        ("k_base", r(H, 1, S, Dp)),
        ("b", r(H, 1, G).bfloat16()),
        ("q_proj.weight", (r(H * G * Dp, D) / math.sqrt(D)).bfloat16()),
        ("q_proj.bias", (r(H * G * Dp) * 0.3).bfloat16()),
        ("k_proj.weight", (r(H * Dp, D) / math.sqrt(D)).bfloat16()),
        ("q_norm.weight", 1 + 0.2 * r(Dp)),
        ("k_norm.weight", 1 + 0.2 * r(Dp)),
    ])


def save_authors_file(path, module, legacy=False):
    L = len(module)
    torch.save({"module": module, "loss": np.random.rand(4, L),
                "acc": np.random.rand(4, L).astype(np.float32), "loss_train": np.random.rand(4, L),
                "acc_train": np.random.rand(4, L)},
               path, _use_new_zipfile_serialization=not legacy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_gate_travels_in_the_authors_layout(tmp_path, dtype):
    """Our file -> the authors' layout (save_gate to a .pt path) -> load_gate: the same tensors,
    dtypes and scores. The file is what the authors' loaders read (METHOD.md §2):
    torch.load(weights_only=True) with no allowed globals gives {"module": [state dicts in their key
    order], "loss", "acc"}, each layer loads into their Weight module's names and shapes
    (literal_gate), and the name carries G, D' and S."""
    cfg = make_cfg(3, 32, 2, 3)
    ours = random_gates(3, dtype=dtype, dim=16, sinks=16)
    save_gate(tmp_path / "mine.safetensors", ours, {"model": "m"})
    mine = load_gate(tmp_path / "mine.safetensors", cfg)
    name = gate_file.authors_file_name(mine)
    assert name == "q3_dim16_sink16.pt"
    save_gate(tmp_path / name, mine, curves=([[0.5, 0.4, 0.3]] * 2, [[0.9, 0.8, 0.7]] * 2))
    raw = torch.load(tmp_path / name, weights_only=True)  # no safe_globals: tensors only
    assert sorted(raw) == ["acc", "loss", "module"] and raw["loss"].shape == (2, 3)
    released = authors_state_dict(32, 2, 3)
    for l, sd in enumerate(raw["module"]):
        # the authors' key order, shapes and the fp32 norms / sinks
        assert list(sd) == list(released)
        assert all(sd[k].shape == released[k].shape for k in sd)
        assert (sd["k_base"].dtype == sd["q_norm.weight"].dtype == torch.float32
                and sd["q_proj.weight"].dtype == dtype)
    back = load_gate(tmp_path / name, cfg)
    assert (back.meta["format"] == "authors-pt" and back.meta["val_acc_final"]
            == pytest.approx([0.9, 0.8, 0.7]))
    hidden = torch.randn(7, 32)
    for l in range(3):
        assert torch.equal(back.score_layer(l, hidden), mine.score_layer(l, hidden))
        assert_close(back.score_layer(l, hidden), literal_gate(raw["module"][l], hidden),
                     atol=1e-2 if dtype == torch.bfloat16 else 1e-5, name=f"layer {l}")
        for key, t in back.layer_state_dict(l).items():
            assert (torch.equal(t, mine.layer_state_dict(l)[key])
                    and t.dtype == mine.layer_state_dict(l)[key].dtype)


def test_kvpress_scores_our_exported_gate_as_we_do(tmp_path):
    """NVIDIA/kvpress's FastKVzipPress gate module (`FastKVzipGate` in kvpress 0.5, built and loaded
    as its load_fastkvzip does) on our exported file. kvpress 0.5.5 requires transformers < 5.3, so
    beside this project's pinned transformers it does not install: skipped then."""
    press = pytest.importorskip("kvpress.presses.fastkvzip_press")
    cfg = make_cfg(2, 32, 2, 3)
    ours = random_gates(2, dim=16, sinks=16)
    path = tmp_path / gate_file.authors_file_name(ours)
    save_gate(path, ours)
    module = torch.load(path, weights_only=True)["module"]
    hidden = torch.randn(11, 32)
    for l, sd in enumerate(module):
        w = press.FastKVzipGate(l, 32, 2, 3, torch.float32, output_dim=16, sink=16)
        w.load_state_dict(sd)
        with torch.no_grad():
            assert_close(w(hidden[None])[0], ours.score_layer(l, hidden), atol=1e-5,
                         name=f"layer {l}")
    assert load_gate(path, cfg).n_layers == 2


@pytest.mark.parametrize("legacy", [False, True])
def test_authors_file_loads_and_scores_like_the_state_dict(tmp_path, legacy):
    D, H, G = 48, 2, 4
    module = [authors_state_dict(D, H, G, seed=i) for i in range(3)]
    path = tmp_path / "q4_dim16_sink16.pt"
    save_authors_file(path, module, legacy)
    g = load_gate(path, make_cfg(3, D, H, G))
    assert (g.n_layers, g.hidden, g.n_kv_heads, g.group, g.dim, g.sinks) == (3, D, H, G, 16, 16)
    assert g.dtype == torch.bfloat16 and g.k_base.dtype == g.q_norm.dtype == torch.float32
    assert g.meta["format"] == "authors-pt" and len(g.meta["val_acc_final"]) == 3
    hidden = torch.randn(9, D)
    for l in range(3):
        assert_close(g.score_layer(l, hidden), literal_gate(module[l], hidden), atol=1e-6,
                     name=f"layer {l}")
        # the file round-trips exactly, dtypes included
        for key, t in g.layer_state_dict(l).items():
            assert torch.equal(t, module[l][key]) and t.dtype == module[l][key].dtype, key


def test_gemma3_file_maps_to_global_layers(tmp_path):
    """Gemma3 gates exist for the global layers only, indexed by global-layer order (METHOD.md §2,
    §9)."""
    D, H, G = 64, 1, 4
    cfg = make_cfg(hidden=D, H=H, G=G, layers=[5, 11, 17], n_hidden_layers=18)
    module = [authors_state_dict(D, H, G, seed=i) for i in range(3)]
    save_authors_file(tmp_path / "q4_dim16_sink16.pt", module)
    g = load_gate(tmp_path / "q4_dim16_sink16.pt", cfg)
    hidden = torch.randn(5, D)
    for i in range(3):  # gate i belongs to model layer cfg.compressed_layers[i]
        assert_close(g.score_layer(i, hidden), literal_gate(module[i], hidden), atol=1e-6,
                     name=f"global layer {i}")
    # one gate per model layer (18) does not fit a model with 3 compressed layers
    save_authors_file(tmp_path / "all.pt", [authors_state_dict(D, H, G, seed=i) for i in range(18)])
    with pytest.raises(GateError, match="18 layers.*3 layers"):
        load_gate(tmp_path / "all.pt", cfg)


def test_pickle_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "q4_dim16_sink16.pt"
    torch.save({"module": [authors_state_dict(32, 2, 3)], "loss": Payload()}, path)
    with pytest.raises(GateError, match=r"refusing.*system") as err:
        load_gate(path, make_cfg(1, 32, 2, 3))
    assert "\n" not in str(err.value)
    assert not marker.exists(), "the payload ran"
    # the payload is real: an unsafe load would have run it
    torch.load(path, weights_only=False)
    assert marker.exists()


# -------------------------------------------------------------------------------------------------
# 4. our format, fit checks, resolution
# -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_round_trip(tmp_path, dtype):
    g = random_gates(dtype=dtype)
    meta = {"model": "gemma3-270m-gguf", "layers": [0, 1, 2],
            "training": {"steps": 10, "val_acc": [0.9, 0.8, 0.7]}}
    path = tmp_path / "sub" / "gate.safetensors"
    save_gate(path, g, meta)
    assert os.listdir(path.parent) == ["gate.safetensors"]  # atomic: no temporary left behind
    h = load_gate(path, make_cfg())
    for name, p in g.named_parameters():
        q = getattr(h, name)
        assert q.dtype == p.dtype and torch.equal(q, p), name
    assert h.meta["training"] == meta["training"] and h.meta["model"] == "gemma3-270m-gguf"
    assert (h.meta["dim"], h.meta["sinks"], h.meta["group"], h.meta["n_kv_heads"],
            h.meta["hidden_size"]) == (8, 5, 3, 2, 32)
    x = torch.randn(3, 4, 32)
    assert torch.equal(g(x), h(x))
    assert load_gate(path, make_cfg(), dtype=torch.float32).dtype == torch.float32


def test_cut_offsets_move_each_head_at_the_cut_and_nothing_else(tmp_path):
    """A calibrated gate (METHOD.md §13.17): cut_scores is sigmoid(logit(s) + o) per head, written
    literally, +inf stays; without offsets it is the scores themselves. The offsets travel in our
    format (their tensor named, the hash moved) and an uncalibrated gate's file holds none (its
    hash as before offsets existed); the authors' .pt layout refuses them."""
    g = random_gates()
    s = torch.rand(3, 2, 7) * 0.98 + 0.01
    s[0, 1, 3] = math.inf
    assert g.cut_scores(s) is s and GateScorer(g).cut_scores(s) is s
    plain = gate_file.gate_sha256(g)
    assert all("cut_offset" not in g.layer_state_dict(li) for li in range(3))
    o = torch.tensor([[1.5, -2.0], [0.0, 3.0], [-0.5, 0.25]])
    g.cut_offset.copy_(o)
    got = GateScorer(g).cut_scores(s)
    for l, h, i in np.ndindex(3, 2, 7):
        p = float(s[l, h, i])
        want = p if math.isinf(p) else 1 / (1 + math.exp(-(math.log(p / (1 - p)) + float(o[l, h]))))
        assert got[l, h, i].item() == pytest.approx(want, rel=1e-12), (l, h, i)
    assert got.dtype == torch.float64
    assert torch.equal(got[1:].argsort(-1), s[1:].argsort(-1))  # the order inside each head
    x = torch.randn(3, 5, 32)
    path = tmp_path / "cal.safetensors"
    save_gate(path, g, {"layers": [0, 1, 2]})
    h = load_gate(path, make_cfg())
    assert torch.equal(h.cut_offset, o) and torch.equal(h(x), g(x))
    assert h.meta["tensors_sha256"] == gate_file.gate_sha256(g) != plain
    with pytest.raises(GateError, match="no place for a calibrated gate's cut offsets"):
        save_gate(tmp_path / "q3_dim8_sink5.pt", g)
    assert not (tmp_path / "q3_dim8_sink5.pt").exists()
    tensors = safetensors.torch.load_file(path)
    for name, bad, says in (("layers.1.cut_offset", torch.zeros(3), r"layer 1: cut_offset is "
                             r"float32 \(3,\), expected float32 \(2,\)"),
                            ("layers.2.cut_offset", None, "layer 2: cut_offset is missing"),
                            ("layers.0.cut_offset", torch.tensor([0.0, math.nan]),
                             "layer 0 cut_offset holds NaN or inf")):
        t = dict(tensors)
        if bad is None:
            del t[name]
        else:
            t[name] = bad
        safetensors.torch.save_file(t, tmp_path / "bad.safetensors")
        with pytest.raises(GateError, match=says) as err:
            load_gate(tmp_path / "bad.safetensors", make_cfg())
        assert "\n" not in str(err.value)


def test_gate_that_does_not_fit_is_refused(tmp_path):
    save_gate(tmp_path / "g.safetensors", random_gates(), {"layers": [0, 1, 2]})
    with pytest.raises(GateError) as err:
        load_gate(tmp_path / "g.safetensors", make_cfg(hidden=48))
    msg = str(err.value)
    assert "hidden 32" in msg and "hidden 48" in msg and "\n" not in msg
    with pytest.raises(GateError, match="G=3.*G=4"):
        load_gate(tmp_path / "g.safetensors", make_cfg(G=4))
    with pytest.raises(GateError, match=r"layers \[0, 1, 2\].*\[3, 4, 5\]"):
        load_gate(tmp_path / "g.safetensors", make_cfg(layers=[3, 4, 5]))
    save_authors_file(tmp_path / "q4_dim16_sink8.pt", [authors_state_dict(32, 2, 3)])
    with pytest.raises(GateError, match="sink8"):
        load_gate(tmp_path / "q4_dim16_sink8.pt", make_cfg(1, 32, 2, 3))
    bad = authors_state_dict(32, 2, 3)
    bad["k_proj.weight"] = bad["k_proj.weight"].flatten()
    save_authors_file(tmp_path / "bad.pt", [bad])
    with pytest.raises(GateError, match="k_proj.weight"):
        load_gate(tmp_path / "bad.pt", make_cfg(1, 32, 2, 3))
    (tmp_path / "junk.safetensors").write_bytes(b"not a gate at all")
    with pytest.raises(GateError):
        load_gate(tmp_path / "junk.safetensors", make_cfg())
    with pytest.raises(GateError, match="not found"):
        load_gate(tmp_path / "missing.safetensors", make_cfg())
    with pytest.raises(GateError, match="is a folder"):
        load_gate(tmp_path, make_cfg())


@pytest.mark.parametrize("first_bytes", [b"\x80", b"PK"])
def test_safetensors_gate_whose_header_length_looks_like_torch_save_loads(tmp_path, first_bytes):
    """The header length is the file's first 8 bytes (little-endian): with some metadata lengths it
    starts with pickle's protocol byte 0x80 or zip's "PK", which a first-bytes sniffer takes for
    torch.save output."""
    g, path = random_gates(), tmp_path / "gate.safetensors"
    target, modulus = int.from_bytes(first_bytes, "little"), 256 ** len(first_bytes)
    pad = 0
    # the header grows with the metadata, padded to a multiple of 8 (as target is)
    for _ in range(3):
        save_gate(path, g, {"command": "x" * pad})
        n = int.from_bytes(path.read_bytes()[:8], "little")
        if n % modulus == target:
            break
        pad += (target - n) % modulus
    assert path.read_bytes().startswith(first_bytes)
    h = load_gate(path, make_cfg())
    assert torch.equal(h.q_weight, g.q_weight) and h.meta["command"] == "x" * pad


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gate_with_non_finite_weights_is_refused(tmp_path, bad):
    g = random_gates()
    with torch.no_grad():
        g.k_base[1, 0, 2, 3] = bad
    save_gate(tmp_path / "g.safetensors", g)
    with pytest.raises(GateError, match=r"layer 1 k_base holds NaN or inf") as err:
        load_gate(tmp_path / "g.safetensors", make_cfg())
    assert "\n" not in str(err.value)
    sd = authors_state_dict(32, 2, 3)
    sd["q_proj.bias"][5] = bad
    save_authors_file(tmp_path / "q4_dim16_sink16.pt", [sd])
    with pytest.raises(GateError, match=r"layer 0 q_proj.bias holds NaN or inf"):
        load_gate(tmp_path / "q4_dim16_sink16.pt", make_cfg(1, 32, 2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how,words", [
    ("all zeros", "layer 0 head 0 gives every token the same score"),
    ("every weight x1e30", "gives every token the same score"),  # the norms overflow to 0
    ("b x1e30", "gives every token the same score (1)"),  # each head its own constant: 0 or 1
    ("k_base x1e30", "gives every token the same score (0)"),  # the sinks swamp the own key
    ("one head's b x1e30", "layer 2 head 1 gives every token the same score"),
])
def test_gate_whose_scores_cannot_rank_is_refused(tmp_path, dtype, how, words):
    """Finite weights whose scores are the same for every token: eviction would silently go by
    position. The probe runs in the file's dtype (bf16 for released gates)."""
    g = random_gates(dtype=dtype)
    with torch.no_grad():
        if how == "all zeros":
            for p in g.parameters():
                p.zero_()
        elif how == "every weight x1e30":
            for p in g.parameters():
                p.mul_(1e30)
        elif how == "b x1e30":
            g.b.copy_(torch.ones_like(g.b) * 1e30)
        elif how == "k_base x1e30":
            g.k_base.mul_(1e30)
        else:
            g.b[2, 1] = 1e30
    for name in ("g.safetensors", "q3_dim8_sink5.pt"):
        save_gate(tmp_path / name, g)
        with pytest.raises(GateError) as err:
            load_gate(tmp_path / name, make_cfg())
        line = str(err.value)
        assert words in line and "cannot rank" in line and "\n" not in line, line


def test_gates_that_rank_load_and_leave_the_random_state_alone(tmp_path):
    """The probe of check_ranks passes what ranks: a freshly initialised Gates (k_base = b = 0), the
    tests' random gates in every gate dtype, the authors' layout, and the bundled gates; it draws
    from its own generator."""
    fresh = Gates(3, 32, 2, 3)
    save_gate(tmp_path / "fresh.safetensors", fresh)
    before = torch.random.get_rng_state()
    load_gate(tmp_path / "fresh.safetensors", make_cfg())
    assert torch.equal(torch.random.get_rng_state(), before)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        save_gate(tmp_path / "r.safetensors", random_gates(dtype=dtype))
        assert load_gate(tmp_path / "r.safetensors", make_cfg()).dtype == dtype
    save_authors_file(tmp_path / "q3_dim16_sink16.pt", [authors_state_dict(32, 2, 3)] * 2)
    load_gate(tmp_path / "q3_dim16_sink16.pt", make_cfg(2, 32, 2, 3))
    for path in sorted(gate_file.GATES_DIR.glob("*.safetensors")):
        meta = gate_file.gate_metadata(path)
        cfg = make_cfg(meta["n_layers"], meta["hidden_size"], meta["n_kv_heads"], meta["group"],
                       layers=meta.get("layers"))
        for dtype in (None, torch.bfloat16):
            load_gate(path, cfg, dtype=dtype)


def test_zip_bomb_gate_is_refused_before_torch_load(tmp_path, monkeypatch):
    """torch.save writes a zip: a released-looking .pt of ~5 MB whose last tensor's record is
    1 GiB of deflated zeros (torch.load would unpack all of it: 1 GB of memory) is refused from the
    zip's declared sizes, before torch.load is called; the same file before the swap loads."""
    import zipfile
    src, path = tmp_path / "plain.pt", tmp_path / "q3_dim16_sink16.pt"
    save_authors_file(src, [authors_state_dict(32, 2, 3)])
    cfg = make_cfg(1, 32, 2, 3)
    assert load_gate(src, cfg).n_layers == 1
    with zipfile.ZipFile(src) as zin:
        records = [n for n in zin.namelist() if re.search(r"/data/\d+$", n)]
        last = max(records, key=lambda n: int(n.rsplit("/", 1)[1]))
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zout:
            for name in zin.namelist():
                if name != last:
                    zout.writestr(name, zin.read(name), zipfile.ZIP_STORED)
                    continue
                chunk = bytes(16 << 20)
                with zout.open(name, "w", force_zip64=True) as f:
                    for _ in range(64):  # 1 GiB of zeros, 16 MiB at a time
                        f.write(chunk)
    assert path.stat().st_size < 8 << 20
    calls = []

    def no_load(*a, **k):  # never unpack the bomb, not even on the code before the check
        calls.append(a)
        raise RuntimeError("torch.load called")

    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(GateError) as err:
        load_gate(path, cfg)
    line = str(err.value)
    assert ("unpacks to 1,024 MiB" in line and "at most 64 MiB" in line and "\n" not in line
            and not calls), line


def test_resolve_gate(tmp_path, monkeypatch):
    cfg = make_cfg(1, 32, 2, 4)
    monkeypatch.setattr(gate_file, "GATES_DIR", tmp_path / "gates")
    # explicit path
    save_gate(tmp_path / "mine.safetensors", random_gates(1, G=4), {})
    assert resolve_gate(tmp_path / "mine.safetensors", cfg, "whatever").n_layers == 1
    # bundled gate for the default model, found from its folder name
    save_gate(tmp_path / "gates" / "gemma3-270m-gguf.safetensors", random_gates(1, G=4), {})
    assert resolve_gate(
        None, cfg, "/root/.cache/fastkvzip/gemma3-270m-gguf").meta["source"].endswith(
            "gemma3-270m-gguf.safetensors")
    # a released model: downloaded from the authors' repo under their file name
    asked = []

    def fake_download(repo_id, filename, repo_type):
        asked.append((repo_id, filename))
        path = tmp_path / "q4_dim16_sink16.pt"
        save_authors_file(path, [authors_state_dict(32, 2, 4)])
        return str(path)

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert resolve_gate("", cfg, "Qwen/Qwen3-8B").dtype == torch.bfloat16
    assert asked == [("Jang-Hyun/Fast-KVzip", "qwen3-8b/q4_dim16_sink16.pt")]

    def offline(**kw):
        raise OSError("no network\nsecond line")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(GateError, match="train_gate.py --model Qwen/Qwen3-8B") as err:
        resolve_gate(None, cfg, "Qwen/Qwen3-8B")
    assert "\n" not in str(err.value)
    with pytest.raises(GateError, match="train_gate.py --model my/model.*--gate"):
        resolve_gate(None, cfg, "my/model")


@pytest.mark.parametrize("alias,file,dims", [
    ("qwen2.5-7b-1m", "qwen2.5-7b-instruct-1m/q7_dim16_sink16.pt", (28, 3584, 28, 4)),
    ("qwen2.5-14b-1m", "qwen2.5-14b-instruct-1m/q5_dim16_sink16.pt", (48, 5120, 40, 8))])
def test_released_qwen25_gates_load(tmp_path, monkeypatch, alias, file, dims):
    """The authors' Qwen2.5-*-Instruct-1M gates (METHOD.md §2): the file name their loader asks for,
    and a file in their exact layout at the real sizes (one gate per layer, 28 or 48; every layer
    holds the same tensors, which torch.save stores once) loads and scores as the literal
    formula."""
    import huggingface_hub

    import model as M
    L, D, Hq, H = dims
    cfg = M.ModelConfig.from_dict({"model_type": "qwen2", "num_hidden_layers": L, "hidden_size": D,
                                   "num_attention_heads": Hq, "num_key_value_heads": H})
    asked, sd = [], authors_state_dict(D, H, Hq // H)

    def fake_download(repo_id, filename, repo_type):
        asked.append((repo_id, filename))
        save_authors_file(tmp_path / "gate.pt", [sd] * L)
        return str(tmp_path / "gate.pt")

    monkeypatch.setattr(gate_file, "GATES_DIR", tmp_path / "no-bundled-gates")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    g = resolve_gate(None, cfg, alias)
    assert asked == [("Jang-Hyun/Fast-KVzip", file)]
    assert ((g.n_layers, g.hidden, g.n_kv_heads, g.group, g.dim, g.sinks)
            == (L, D, H, Hq // H, 16, 16))
    hidden = torch.randn(5, D)
    assert_close(g.score_layer(L - 1, hidden), literal_gate(sd, hidden), atol=1e-6,
                 name=f"{alias} layer {L - 1}")


# -------------------------------------------------------------------------------------------------
# 5. scorers
# -------------------------------------------------------------------------------------------------

def chunk(T=40, H=2, G=3, d=8, D=32, start=0, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(T, D), torch.randn(T, H * G, d), torch.randn(T, H, d),
            torch.arange(start, start + T))


def naive_snapkv(q, k, sinks, w, scale):
    """METHOD.md §10 one number at a time: group-max logits, softmax over [sinks ⊕ chunk keys], mean
    over the last w queries, drop sinks, max over a ±3 neighbourhood; the window gets the head's max
    + 1."""
    T, Hq, _ = q.shape
    H = k.shape[1]
    G = Hq // H
    keys = torch.cat([sinks, k])
    ns, K = sinks.shape[0], keys.shape[0]
    out = torch.zeros(H, T, dtype=torch.float64)
    for h in range(H):
        acc = [0.0] * K
        for i in range(T - w, T):
            logits = [max(float(q[i, h * G + g] @ keys[j, h]) * scale for g in range(G))
                      for j in range(K)]
            z = sum(math.exp(x - max(logits)) for x in logits)
            for j in range(K):
                acc[j] += math.exp(logits[j] - max(logits)) / z / w
        acc = acc[ns:]
        for t in range(T):
            out[h, t] = max(acc[max(0, t - 3):t + 4])
        out[h, T - w:] = out[h].max() + 1
    return out


def test_snapkv_matches_naive():
    s = SnapKVScorer()
    hidden, q, k, pos = chunk(T=40)  # first chunk, sequence < 1000 tokens: window 16, no sinks
    got = s.score(0, hidden, q, k, pos)
    assert got.shape == (2, 40) and got.dtype == torch.float32
    assert_close(got, naive_snapkv(q, k, k[:0], 16, 1 / math.sqrt(8)), atol=1e-5,
                 name="first chunk")
    first_keys = k[:4].clone()
    hidden, q, k, pos = chunk(T=40, start=1200, seed=1)  # later chunk: sink keys, window 32
    got = s.score(0, hidden, q, k, pos)
    assert_close(got, naive_snapkv(q, k, first_keys, 32, 1 / math.sqrt(8)), atol=1e-5,
                 name="later chunk")
    # no first chunk seen for layer 3: no sinks
    got = SnapKVScorer(scale=0.1).score(3, hidden, q, k, pos)
    assert_close(got, naive_snapkv(q, k, k[:0], 32, 0.1), atol=1e-5, name="custom scale")
    with pytest.raises(AssertionError, match="no decoding form"):
        s.score(0, hidden, None, None, pos)


def test_scorer_shapes_and_orders():
    hidden, q, k, pos = chunk(T=12, start=100)
    g = random_gates(L=2, D=32, H=2, G=3)
    gs = GateScorer(g).score(1, hidden, q, k, pos)
    assert (gs.shape == (2, 12) and gs.dtype == torch.float32
            and torch.equal(gs, g.score_layer(1, hidden).detach()))
    assert torch.equal(GateScorer(g).score(1, hidden, None, None, pos), gs)  # decoding: no q/k
    st = StreamingScorer().score(0, hidden, q, k, pos)
    assert st.shape == (2, 12) and st.dtype == torch.float32
    assert (st.diff(dim=-1) > 0).all()  # later = more important: the most recent survive
    assert torch.equal(StreamingScorer(n_kv_heads=2).score(0, hidden, None, None, pos), st)
    r1 = RandomScorer(seed=1).score(0, hidden, q, k, pos)
    assert r1.shape == (2, 12) and r1.dtype == torch.float32 and ((r1 >= 0) & (r1 < 1)).all()
    assert torch.equal(r1, RandomScorer(seed=1).score(0, hidden, q, k, pos))
    assert not torch.equal(r1, RandomScorer(seed=2).score(0, hidden, q, k, pos))


def test_agreement_counts_equal_a_naive_count():
    """teacher.agreement against literal set arithmetic on the kept positions, and Spearman against
    ranks computed by sorting Python lists."""
    torch.manual_seed(7)
    L, H, n = 3, 2, 60
    student, teacher = torch.rand(L, H, n), torch.rand(L, H, n)
    teacher[1] = student[1] + 0.1 * torch.rand(H, n)  # one layer that agrees closely
    is_digit = torch.rand(n) < 0.3
    a = agreement(student, teacher, is_digit, budgets=(0.5,), chunk_size=1000, window=0)
    p = pool_agreement([a, a], budgets=(0.5,))

    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0] * len(xs)
        for rank, i in enumerate(order):
            r[i] = rank
        return r

    ks, w = kept_by_rule(student, 0.5, 1000, 0)
    kt, _ = kept_by_rule(teacher, 0.5, 1000, 0)
    assert w == 1  # 2% of 60 tokens
    for l in range(L):
        rs, rt = ranks(student[l].flatten().tolist()), ranks(teacher[l].flatten().tolist())
        m = (len(rs) - 1) / 2
        cov = sum((x - m) * (y - m) for x, y in zip(rs, rt))
        var = sum((x - m) ** 2 for x in rs)
        assert a["spearman"][l] == pytest.approx(cov / var, abs=1e-12)
        seg = range(n - w)
        T = {(h, i) for h in range(H) for i in seg if kt[l, h, i]}
        S = {(h, i) for h in range(H) for i in seg if ks[l, h, i]}
        D = {(h, i) for h in range(H) for i in seg if is_digit[i]}
        assert p["overlap@0.5"][l] == pytest.approx(len(T & S) / len(T))
        assert p["chance@0.5"][l] == pytest.approx(len(S) / (H * len(seg)))
        assert p["kept_teacher@0.5"][l] == pytest.approx(len(T) / (H * len(seg)))
        assert p["digits_student@0.5"][l] == pytest.approx(len(S & D) / len(D))
        assert p["digits_teacher@0.5"][l] == pytest.approx(len(T & D) / len(D))
    assert a["spearman"][1] > 0.9 > max(abs(a["spearman"][0]), abs(a["spearman"][2]))


# -------------------------------------------------------------------------------------------------
# odd gate files: one GateError line each, before any model work
# -------------------------------------------------------------------------------------------------

def write_raw_gate(path, layers, meta):
    """A safetensors gate written by hand: tensors layers.<i>.<key>, `meta` (any JSON) as its
    metadata."""
    import json

    from safetensors.torch import save_file
    save_file({f"layers.{i}.{k}": t.contiguous() for i, sd in enumerate(layers)
               for k, t in sd.items()}, str(path),
              metadata={"format": "pt", "fastkvzip": json.dumps(meta)})


@pytest.mark.parametrize("case,words", [
    ("int32 q_proj", "q_proj.weight is int32; a gate holds float32, bfloat16 or float16"),
    ("bool k_base", "k_base is bool"),
    ("float64 everywhere", "is float64"),
    ("zero-size q_norm", "D' > 0"),
    ("layers is a number", "\"layers\" must be a list of layer ids, got 5"),
    ("metadata is a list", "metadata is a JSON list, not an object"),
])
def test_odd_gate_files_are_one_line_errors(tmp_path, case, words):
    sd = {k: v.clone() for k, v in authors_state_dict(32, 2, 3).items()}
    meta = {}
    if case == "int32 q_proj":
        sd["q_proj.weight"] = sd["q_proj.weight"].to(torch.int32)
    elif case == "bool k_base":
        sd["k_base"] = sd["k_base"] > 0
    elif case == "float64 everywhere":
        sd = {k: v.double() for k, v in sd.items()}
    elif case == "zero-size q_norm":
        sd["q_norm.weight"] = torch.zeros(0)
    elif case == "layers is a number":
        meta = {"layers": 5}
    elif case == "metadata is a list":
        meta = [1, 2]
    write_raw_gate(tmp_path / "g.safetensors", [sd], meta)
    with pytest.raises(GateError) as err:
        load_gate(tmp_path / "g.safetensors", make_cfg(1, 32, 2, 3))
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_empty_and_unreadable_gates_say_so(tmp_path):
    """/dev/null exists and is empty (not "not found"); a gate inside a folder that cannot be read
    is a GateError, not pathlib's PermissionError."""
    from tests.helpers import no_access
    with pytest.raises(GateError, match=r"gate /dev/null is empty"):
        load_gate("/dev/null", make_cfg())
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(GateError, match=r"empty.safetensors is empty \(0 bytes\)"):
        load_gate(tmp_path / "empty.safetensors", make_cfg())
    (tmp_path / "locked").mkdir()
    save_gate(tmp_path / "locked" / "g.safetensors", random_gates())
    with no_access(tmp_path / "locked", 0o000), pytest.raises(
        GateError, match=r"cannot read gate .*Permission denied"):
        load_gate(tmp_path / "locked" / "g.safetensors", make_cfg())
