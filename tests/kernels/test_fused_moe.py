"""kernels/fused_moe.py (routing, the token→expert sort and the experts in fixed shapes) against its torch
references, across token counts, expert counts, top-k and widths. Without a GPU the kernels run under the
interpreter (fp32 and fp16); the test_gpu_* cases need CUDA (bf16, the Qwen3-30B-A3B block, a CUDA graph)."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.kernels.fused_moe import (align_reference, fused_moe, fused_moe_reference,  # noqa: E402
                                          fused_moe_routed, fused_moe_routed_reference, moe_align, moe_route)
from ddtree_lab.kernels.moe_layout import route_grouped_reference, route_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def make_block(T, E, H, I, dtype, seed, device=DEVICE, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    router = torch.randn(E, H, generator=g) * scale / H ** 0.5 * 3
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w_down = torch.randn(E, H, I, generator=g) / I ** 0.5
    return [t.to(device, dtype) for t in (x, router, w_gate_up, w_down)]


def check_align(ids, E):
    got, want = moe_align(ids, E), align_reference(ids, E)
    counts, slot_expert, slot_start, sorted_pairs = got
    assert torch.equal(counts, want[0]) and torch.equal(slot_expert, want[1])
    assert torch.equal(sorted_pairs, want[3])
    valid = want[1] >= 0
    assert torch.equal(slot_start[valid], want[2][valid])
    # the slots hold exactly the touched experts, ascending, then -1
    touched = (counts > 0).nonzero().flatten().int()
    assert torch.equal(slot_expert[: touched.numel()], touched) and bool((slot_expert[touched.numel():] == -1).all())


SHAPES = [  # (T, E, top_k, hidden, width)
    (1, 8, 2, 64, 32), (3, 8, 2, 64, 32), (17, 16, 4, 48, 40), (65, 8, 3, 64, 32),
    (3, 6, 6, 32, 16),   # top_k = E: every token touches every expert
    (17, 40, 1, 32, 24),  # E not a power of two, top-1
]


@pytest.mark.parametrize("T,E,k,H,I", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_reference(T, E, k, H, I, dtype, renormalize):
    x, router, w_gate_up, w_down = make_block(T, E, H, I, dtype, seed=T * 31 + E)
    out, counts = fused_moe(x, router, w_gate_up, w_down, k, renormalize)
    want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, k, renormalize)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert out.dtype == dtype and out.shape == (T, H)
    assert torch.allclose(out.float(), want.float(), atol=tol, rtol=tol), (out.float() - want.float()).abs().max()
    assert torch.equal(counts, want_counts) and int(counts.sum()) == T * k
    logits = F.linear(x, router)
    weights, ids = moe_route(logits, k, renormalize)
    want_w, want_ids = route_reference(logits, k, renormalize)
    assert torch.equal(ids.long(), want_ids) and torch.allclose(weights, want_w, atol=1e-6)
    check_align(ids, E)


@pytest.mark.parametrize("T,E,k,H,I", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_routed_entry_with_the_kernels_own_routing_is_fused_moe(T, E, k, H, I, dtype):
    """fused_moe_routed on the routing fused_moe computes gives fused_moe's output bit for bit (the same expert
    launches), and its reference is fused_moe_reference's second half."""
    x, router, w_gate_up, w_down = make_block(T, E, H, I, dtype, seed=T * 13 + E)
    weights, ids = moe_route(F.linear(x, router), k, True)
    out, counts = fused_moe_routed(x, weights, ids, w_gate_up, w_down)
    want, want_counts = fused_moe(x, router, w_gate_up, w_down, k, True)
    assert torch.equal(out, want) and torch.equal(counts, want_counts)
    ref = fused_moe_routed_reference(x, *route_reference(F.linear(x, router), k, True), w_gate_up, w_down)
    full = fused_moe_reference(x, router, w_gate_up, w_down, k, True)
    assert torch.equal(ref[0], full[0]) and torch.equal(ref[1], full[1])


@pytest.mark.parametrize("T", [1, 3, 17, 40])
@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_routed_entry_takes_grouped_routing(T, scaling):
    """DeepSeek-V3's routing from torch (sigmoid scores, correction bias, groups, scaling; int64 ids, weights not
    summing to 1) through the expert kernels, against the reference; a given counts buffer is filled."""
    E, k, H, I = 16, 4, 64, 32
    x, _, w_gate_up, w_down = make_block(T, E, H, I, torch.float32, seed=T)
    g = torch.Generator().manual_seed(T + 100)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE)
    weights, ids = route_grouped_reference(logits, bias, k, 4, 2, "sigmoid", True, scaling)
    buf = torch.full((E,), 5, dtype=torch.int32, device=DEVICE)
    out, counts = fused_moe_routed(x, weights, ids, w_gate_up, w_down, counts=buf)
    want, want_counts = fused_moe_routed_reference(x, weights, ids, w_gate_up, w_down)
    assert ids.dtype == torch.int64 and counts.data_ptr() == buf.data_ptr() and torch.equal(counts, want_counts)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5), (out - want).abs().max()


def test_route_ties_take_the_lower_expert_and_renormalise():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0],    # a three-way tie for the top
                           [0.0, 0.0, 0.0, 0.0, 0.0],    # all equal: experts 0, 1
                           [-9.0, 2.0, 5.0, 2.0, -1.0]], device=DEVICE)
    weights, ids = moe_route(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1], [2, 1]] == route_reference(logits, 2, True)[1].tolist()
    assert torch.allclose(weights.sum(-1), torch.ones(3, device=DEVICE))
    raw, _ = moe_route(logits, 2, False)
    assert torch.allclose(raw[2], torch.softmax(logits[2], -1)[[2, 1]])


def test_align_skewed_routing_and_counts_buffer():
    """Every token to the same few experts: slots past them stay -1, and the counts land in the given buffer."""
    T, k, E = 33, 2, 16
    ids = torch.tensor([[5, 9]] * 20 + [[9, 0]] * 13, dtype=torch.int32, device=DEVICE)
    check_align(ids, E)
    buf = torch.full((E,), 77, dtype=torch.int32, device=DEVICE)
    counts, slot_expert, _, _ = moe_align(ids, E, buf)
    assert counts.data_ptr() == buf.data_ptr()
    assert buf[[0, 5, 9]].tolist() == [13, 20, 33] and int(buf.sum()) == T * k
    assert slot_expert[:4].tolist() == [0, 5, 9, -1] and bool((slot_expert[3:] == -1).all())


@pytest.mark.parametrize("T,k,E", [(1, 1, 4), (200, 3, 40), (257, 8, 128)])
def test_align_over_many_chunks(T, k, E):
    """Pairs counted and placed chunk by chunk (each chunk offset by the earlier chunks' pairs of each
    expert) give the one stable sort of the reference, whatever the chunk count and a top_k not a power of 2."""
    g = torch.Generator().manual_seed(T + k)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int().to(DEVICE)
    check_align(ids, E)


def test_counts_buffer_is_refreshed_each_call():
    x, router, w_gate_up, w_down = make_block(5, 8, 32, 16, torch.float32, seed=3)
    buf = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    fused_moe(x, router, w_gate_up, w_down, 2, True, counts=buf)
    first = buf.clone()
    fused_moe(x[:1], router, w_gate_up, w_down, 2, True, counts=buf)
    assert int(first.sum()) == 10 and int(buf.sum()) == 2 and int((buf > 0).sum()) == 2


def test_forced_small_tiles_loop_over_tokens_and_columns():
    """BLOCK_M below an expert's token count: an expert's tokens span several row blocks (one program each)."""
    x, router, w_gate_up, w_down = make_block(40, 4, 48, 40, torch.float32, seed=8, scale=0.1)
    cfg = dict(BLOCK_M=16, BLOCK_N_UP=16, BLOCK_N_DOWN=16, BLOCK_K_UP=16, BLOCK_K_DOWN=16)
    out, counts = fused_moe(x, router, w_gate_up, w_down, 2, True, config=cfg)
    want, _ = fused_moe_reference(x, router, w_gate_up, w_down, 2, True)
    assert int(counts.max()) > 16 and torch.allclose(out, want, atol=1e-5)


def test_crowded_experts_fill_every_row_block():
    """Every token routes to the same experts (alike tokens, as in a tree): each expert's tokens span
    several row blocks, and the grid bound `moe_layout.row_blocks` still covers them."""
    x, router, w_gate_up, w_down = make_block(40, 4, 48, 40, torch.float32, seed=9, scale=0.1)
    x = x[:1].expand(40, -1).contiguous() + 1e-3 * x  # near-identical tokens: the same top-2 experts
    cfg = dict(BLOCK_M=16, BLOCK_N_UP=16, BLOCK_N_DOWN=16, BLOCK_K_UP=16, BLOCK_K_DOWN=16)
    out, counts = fused_moe(x, router, w_gate_up, w_down, 2, True, config=cfg)
    want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, 2, True)
    assert sorted(counts.tolist()) == [0, 0, 40, 40] and torch.equal(counts, want_counts)
    assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("splits,H", [(2, 64), (3, 64), (5, 48), (8, 32)])  # 5 of 48 at K steps of 16: three
def test_split_k_gate_up_sums_its_pieces(splits, H):
    """The gate-up's K walk split (SPLIT_K_UP): partial sums added in order by `_silu_mul_kernel`, then SiLU·mul,
    the same block as unsplit; experts held elsewhere still add nothing."""
    x, router, w_gate_up, w_down = make_block(3, 8, H, 40, torch.float32, seed=splits + H)
    cfg = dict(BLOCK_K_UP=16, SPLIT_K_UP=splits)
    out, counts = fused_moe(x, router, w_gate_up, w_down, 2, True, config=cfg)
    want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, 2, True)
    assert torch.equal(counts, want_counts) and torch.allclose(out, want, atol=1e-5)
    weights, ids = route_reference(F.linear(x, router), 2, True)
    ids = torch.where(ids >= 4, 8, ids)  # experts 4-7 another rank's
    out, _ = fused_moe_routed(x, weights, ids, w_gate_up[:4], w_down[:4], config=cfg, elsewhere=True)
    want, _ = fused_moe_routed_reference(x, weights, ids, w_gate_up[:4], w_down[:4], elsewhere=True)
    assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("splits,I", [(2, 40), (3, 48), (4, 32)])  # 2 of 40 at steps of 16: 2 steps and 1
def test_split_k_down_sums_its_pieces(splits, I):
    """The down's walk over I split (the SPLIT_K_DOWN override): each split's partial sums land in y[split] and the
    combine adds them in order, pair by pair: the unsplit block to rounding; experts held elsewhere add nothing."""
    x, router, w_gate_up, w_down = make_block(3, 8, 64, I, torch.float32, seed=splits + I)
    cfg = dict(BLOCK_K_DOWN=16, SPLIT_K_DOWN=splits)
    one, _ = fused_moe(x, router, w_gate_up, w_down, 2, True, config=dict(BLOCK_K_DOWN=16))
    out, counts = fused_moe(x, router, w_gate_up, w_down, 2, True, config=cfg)
    want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, 2, True)
    assert torch.equal(counts, want_counts) and torch.allclose(out, want, atol=1e-5)
    assert torch.allclose(out, one, atol=1e-6)
    weights, ids = route_reference(F.linear(x, router), 2, True)
    ids = torch.where(ids >= 4, 8, ids)  # experts 4-7 another rank's
    out, _ = fused_moe_routed(x, weights, ids, w_gate_up[:4], w_down[:4], config=cfg, elsewhere=True)
    want, _ = fused_moe_routed_reference(x, weights, ids, w_gate_up[:4], w_down[:4], elsewhere=True)
    assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("T,I,split", [(1, 48, 1), (1, 48, 3), (5, 40, 2), (40, 32, 1)])
def test_the_grid_with_its_column_tiles_first_changes_no_bit(T, I, split):
    """COLS_FIRST swaps the expert kernels' first two grid axes (column tiles first, so the programs of a live
    slot launch one after another); every program computes what it did, so the output is the same bits, the
    K splits and experts held elsewhere included."""
    x, router, w_gate_up, w_down = make_block(T, 8, 64, I, torch.float32, seed=T + I)
    base = dict(BLOCK_K_UP=16, BLOCK_K_DOWN=16, SPLIT_K_UP=split, SPLIT_K_DOWN=split)
    want, want_counts = fused_moe(x, router, w_gate_up, w_down, 2, True, config=base)
    got, counts = fused_moe(x, router, w_gate_up, w_down, 2, True, config=dict(base, COLS_FIRST=1))
    assert torch.equal(got, want) and torch.equal(counts, want_counts)
    weights, ids = route_reference(F.linear(x, router), 2, True)
    ids = torch.where(ids >= 4, 8, ids)  # experts 4-7 another rank's
    want, _ = fused_moe_routed(x, weights, ids, w_gate_up[:4], w_down[:4], config=base, elsewhere=True)
    got, _ = fused_moe_routed(x, weights, ids, w_gate_up[:4], w_down[:4], config=dict(base, COLS_FIRST=1),
                              elsewhere=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("T,I,split,cols_first", [(1, 48, 3, 0), (1, 48, 3, 1), (2, 40, 2, 1), (5, 40, 4, 0)])
def test_the_last_split_to_finish_sums_the_splits_to_the_same_bits(monkeypatch, T, I, split, cols_first):
    """LAST_SPLIT_SUMS: each gate-up tile's last split to arrive (its count in `_arrivals`) adds the splits'
    partials in order and applies SiLU·mul, so `_silu_mul_kernel` does not launch and the block is the same bits
    as with it; the counts are back at zero after every call, so the next call (a graph's replay) starts clean."""
    from ddtree_lab.kernels import fused_moe as fm

    x, router, w_gate_up, w_down = make_block(T, 8, 64, I, torch.float32, seed=T + I + split)
    base = dict(BLOCK_K_UP=16, SPLIT_K_UP=split, COLS_FIRST=cols_first)
    want, want_counts = fused_moe(x, router, w_gate_up, w_down, 2, True, config=base)
    weights, ids = route_reference(F.linear(x, router), 2, True)
    ids = torch.where(ids >= 4, 8, ids)  # experts 4-7 another rank's
    want_ep, _ = fused_moe_routed(x, weights, ids, w_gate_up[:4], w_down[:4], config=base, elsewhere=True)

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("the splits' own launch ran")

    monkeypatch.setattr(fm, "_silu_mul_kernel", NotLaunched())
    for _ in range(2):  # the second call finds the counts the first left
        got, counts = fused_moe(x, router, w_gate_up, w_down, 2, True, config=dict(base, LAST_SPLIT_SUMS=1))
        assert torch.equal(got, want) and torch.equal(counts, want_counts)
        assert not fm._ARRIVALS[x.device].any()
        got, _ = fused_moe_routed(x, weights, ids, w_gate_up[:4], w_down[:4], config=dict(base, LAST_SPLIT_SUMS=1),
                                  elsewhere=True)
        assert torch.equal(got, want_ep) and not fm._ARRIVALS[x.device].any()


def test_column_tiles_go_first_for_an_expert_parallel_call_of_one_block_an_expert_unless_told():
    from ddtree_lab.kernels.fused_moe import columns_first

    assert columns_first({}, one_block=True, expert_parallel=True)
    assert not columns_first({}, one_block=False, expert_parallel=True)  # an expert's blocks stay side by side
    assert not columns_first({}, one_block=True, expert_parallel=False)  # untimed there: the order it had
    assert not columns_first({"COLS_FIRST": False}, one_block=True, expert_parallel=True)
    assert columns_first({"COLS_FIRST": True}, one_block=False, expert_parallel=False)


def test_launch_splits_k_for_an_ar_step_on_a_long_hidden_only(monkeypatch):
    """An AR step of a Kimi layer (K 7,168: 56 steps of 128) splits into pieces of SPLIT_K_STEPS steps; a tree's
    tokens, or a short K (Qwen3-30B-A3B's 2,048), keep one walk."""
    import ddtree_lab.kernels.fused_moe as fm

    monkeypatch.setattr(fm, "_interpret", lambda: False)
    monkeypatch.setattr(fm, "_sm_count", lambda device: 132)
    kimi = fm.launch_config(1, 8, 384, 7168, 2048, "cuda", 2, int4=True)
    assert kimi["SPLIT_K_UP"] == 56 // fm.SPLIT_K_STEPS and fm._k_splits(7168, 128, kimi["SPLIT_K_UP"]) == (7, 1024)
    assert fm.launch_config(2, 8, 384, 7168, 2048, "cuda", 2, int4=True)["SPLIT_K_UP"] == 7
    assert fm.launch_config(3, 8, 384, 7168, 2048, "cuda", 2, int4=True)["SPLIT_K_UP"] == 1
    assert fm.launch_config(1, 8, 128, 2048, 768, "cuda", 2)["SPLIT_K_UP"] == 1
    assert fm._k_splits(100, 16, 3) == (3, 48)  # 7 steps: 3, 3 and 1
    assert fm._k_splits(48, 16, 5) == (3, 16)   # no more splits than steps


def test_launch_gives_an_int4_gate_up_one_width_at_every_size(monkeypatch):
    """INT4 gate-up tiles are INT4_BLOCK_N_UP columns wide for an AR step and a tree alike, on a full layer and a
    TP8 rank's narrow one (never shrunk for programs); bf16 keeps the width that gives two programs an SM, and the
    down projection too."""
    import ddtree_lab.kernels.fused_moe as fm

    monkeypatch.setattr(fm, "_interpret", lambda: False)
    monkeypatch.setattr(fm, "_sm_count", lambda device: 132)
    for T in (1, 9, 129, 1025):
        for I in (2048, 256):
            int4 = fm.launch_config(T, 8, 384, 7168, I, "cuda", 2, int4=True)
            bf16 = fm.launch_config(T, 8, 384, 7168, I, "cuda", 2)
            assert int4["BLOCK_N_UP"] == fm.INT4_BLOCK_N_UP
            assert int4["BLOCK_N_DOWN"] == bf16["BLOCK_N_DOWN"]
    assert fm.launch_config(1, 8, 384, 7168, 256, "cuda", 2)["BLOCK_N_UP"] == 16  # 8 slots: narrow bf16 tiles
    assert fm.launch_config(129, 8, 384, 7168, 2048, "cuda", 2)["BLOCK_N_UP"] == 64


# ----------------------------------------------------------------------------- GPU only

@gpu
@pytest.mark.parametrize("T", [1, 8, 65, 1025])
def test_gpu_qwen3_30b_a3b_block_bf16(T):
    x, router, w_gate_up, w_down = make_block(T, 128, 2048, 768, torch.bfloat16, seed=T)
    out, counts = fused_moe(x, router, w_gate_up, w_down, 8, True)
    want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, 8, True)
    assert torch.equal(counts, want_counts)
    err = (out.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 2e-2, err


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_dtypes_match_reference(dtype):
    x, router, w_gate_up, w_down = make_block(65, 64, 512, 256, dtype, seed=1)
    out, _ = fused_moe(x, router, w_gate_up, w_down, 4, False)
    want, _ = fused_moe_reference(x, router, w_gate_up, w_down, 4, False)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    assert (out.float() - want.float()).abs().max() / want.float().abs().max() < tol


@gpu
def test_gpu_cuda_graph_replays_new_routing():
    """One capture serves any routing of the same T: nothing is sized from the device's values."""
    T, E = 17, 64
    x, router, w_gate_up, w_down = make_block(T, E, 256, 128, torch.bfloat16, seed=2)
    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_moe(static_x, router, w_gate_up, w_down, 4, True, counts=counts)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = fused_moe(static_x, router, w_gate_up, w_down, 4, True, counts=counts)
    for seed in range(3):
        static_x.copy_(torch.randn(T, 256, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
        g.replay()
        want, want_counts = fused_moe(static_x, router, w_gate_up, w_down, 4, True)
        assert torch.equal(out, want) and torch.equal(counts, want_counts)


def test_bench_smoke_runs_the_logic_path(tmp_path):
    """`python -m ddtree_lab.bench.fused_moe --smoke`: tiny shapes, every column filled but the GPU's floor."""
    import json

    from ddtree_lab.bench import fused_moe as bench_fused_moe

    out = tmp_path / "fused_moe.json"
    rows = bench_fused_moe.main(["--smoke", "--tokens", "1", "5", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [r["T"] for r in saved["rows"]] == [1, 5] == [r["T"] for r in rows] and saved["smoke"]
    # what names the run: the command that repeats it, the commit and the sources' digest
    assert saved["command"] == f"python -m ddtree_lab.bench.fused_moe --smoke --tokens 1 5 --out {out}"
    assert saved["commit"] and len(saved["source_sha256"]) == 64
    for r in rows:
        assert r["counts_equal_reference"] and r["max_abs_diff"] < 1e-5 and r["triton_us"] > 0 and r["torch_us"] > 0
        assert 2 <= r["experts_touched"] <= min(8, 2 * r["T"]) and r["floor_us"] is None



def test_bench_int4_runs_beside_the_dense_kernel_on_the_same_experts(tmp_path):
    """`--int4 G`: INT4 experts timed beside their dequantized bf16 copy; the INT4 block equals the dense kernel
    on the dequantized values, and the INT4 floor counts packed words and scales (9/16 of fp16's bytes at G 32)."""
    from ddtree_lab.bench import fused_moe as bench_fused_moe

    rows = bench_fused_moe.main(["--smoke", "--int4", "32", "--tokens", "1", "5"])
    for r in rows:
        assert r["counts_equal_reference"] and r["max_abs_diff"] < 1e-4 and r["bf16_us"] > 0
        assert r["int4_speedup"] == pytest.approx(r["bf16_us"] / r["triton_us"]) and r["torch_us"] is None
    assert bench_fused_moe.block_shape("kimi-k2.6-tp8-rank") == dict(experts=384, top_k=8, hidden=7168, width=256,
                                                                    layers=60)
    assert bench_fused_moe.block_shape("kimi-k2.6-ep8-rank") == dict(experts=48, top_k=8, hidden=7168, width=2048,
                                                                    layers=60, all_experts=384)
    with pytest.raises(ValueError, match="not an MoE shape"):
        bench_fused_moe.block_shape("qwen3-8b")


@pytest.mark.parametrize("int4", [0, 32])
def test_bench_of_an_expert_parallel_share_routes_over_every_expert_and_runs_its_own(int4, tmp_path):
    """A share's bench (`all_experts`, as an EP rank's shape gives): tokens route over all the experts, the stack
    runs the pairs it holds (the rest marked held elsewhere), and the row counts them: pairs_here equals the
    routing's own count, the experts touched are the stack's, the floor has no router in it."""
    from ddtree_lab.bench import fused_moe as bench_fused_moe
    from ddtree_lab.kernels.moe_layout import route_reference

    shape = dict(experts=4, all_experts=16, top_k=2, hidden=64, width=32, layers=1)
    rows = bench_fused_moe.bench_fused_moe([1, 6], **shape, dtype=torch.float32, device=DEVICE, reps=1,
                                           progress=False, int4_group=int4)
    for r in rows:
        x, router, *_ = bench_fused_moe.block_inputs(r["T"], 4, 64, 32, torch.float32, DEVICE, 0.0, seed=r["T"],
                                                     int4_group=int4, router_experts=16)
        _, ids = route_reference(F.linear(x, router), 2, True)
        here = ids[ids < 4]
        assert r["pairs_here"] == here.numel() and r["experts_touched"] == here.unique().numel()
        assert r["counts_equal_reference"] and r["max_abs_diff"] < 1e-4 and r["torch_us"] is None
        if not int4:  # the touched experts' weights and x in and out: no router [16, 64]
            assert r["touched_bytes"] == bench_fused_moe.touched_bytes(torch.ones(r["experts_touched"]), r["T"], 0,
                                                                       64, 32, 4)
    assert any(r["pairs_here"] < 2 * r["T"] for r in rows)  # some pairs went elsewhere


@pytest.mark.parametrize("T,k,E", [(1, 8, 49), (2, 8, 385), (2, 3, 24), (17, 3, 24), (300, 2, 40)])
def test_given_ids_sorted_in_one_program_equal_the_three_launches(T, k, E):
    """moe_align's one-program path (given ids, AR's step) against its counted-scanned-placed path and the
    reference, bit for bit. E = 49 and 385 are an expert-parallel share's sorts (48 or 384 experts here, plus
    one that stands for the pairs held elsewhere)."""
    from ddtree_lab.kernels.fused_moe import moe_align

    g = torch.Generator().manual_seed(T * E + k)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int().to(DEVICE)
    fused, apart = moe_align(ids, E, fuse=True), moe_align(ids, E, fuse=False)
    valid = apart[1] >= 0
    for i, (a, b) in enumerate(zip(fused, apart)):
        assert torch.equal(a[valid] if i == 2 else a, b[valid] if i == 2 else b), i
    check_align(ids, E)


@pytest.mark.parametrize("T", [1, 2, 17, 65, 300])  # 300: several chunks of routing, counting and placing
def test_routing_inside_the_align_program_equals_its_own_launch(T):
    from ddtree_lab.kernels.fused_moe import moe_route_align

    E, k = 24, 3
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    fused = moe_route_align(logits, k, True, fuse=True)
    apart = moe_route_align(logits, k, True, fuse=False)
    valid = apart[3] >= 0
    for i, (a, b) in enumerate(zip(fused, apart)):
        assert torch.equal(a[valid] if i == 4 else a, b[valid] if i == 4 else b), i
    check_align(fused[1], E)


def test_bench_times_a_baseline_kernel_side_by_side(tmp_path):
    """`--baseline FILE`: another copy of the kernel module, run on the same inputs; a copy of this one gives
    the same bits. A missing file is refused with one line."""
    import shutil

    from ddtree_lab.bench import fused_moe as bench_fused_moe
    from ddtree_lab.bench import load_kernel_file
    from ddtree_lab.kernels import declared_route
    from ddtree_lab.kernels import fused_moe as kernel

    load_kernel_file(declared_route.__file__, "declared_route_from_its_folder")
    copy = tmp_path / "fused_moe_copy.py"
    shutil.copy(kernel.__file__, copy)
    rows = bench_fused_moe.main(["--smoke", "--tokens", "3", "--baseline", str(copy)])
    assert rows[0]["equal_to_baseline"] and rows[0]["baseline_us"] > 0 and rows[0]["over_baseline"] > 0
    # INT4 experts too: the copy's lone-file imports resolve to this checkout's modules, so the Int4Weights it is
    # handed are of the class it checks for, even after a load from kernels/ itself (above: the routing bench's
    # baseline) put that folder's files in sys.modules as lone modules
    rows = bench_fused_moe.main(["--smoke", "--int4", "32", "--tokens", "3", "--baseline", str(copy)])
    assert rows[0]["equal_to_baseline"]
    with pytest.raises(SystemExit):
        bench_fused_moe.main(["--smoke", "--baseline", str(tmp_path / "missing.py")])


def test_each_expert_kernel_takes_its_own_stage_count_and_register_cap(monkeypatch):
    """STAGES_UP / STAGES_DOWN and MAXNREG_UP / MAXNREG_DOWN reach their own kernel's launch only; unset, both take
    the config's num_stages and no cap."""
    from ddtree_lab.kernels import fused_moe as fm

    launched = {}

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched[self.name] = {k: kw.get(k) for k in ("num_stages", "num_warps", "maxnreg")}
                return self.kernel[grid](*args, **kw)
            return launch

    for name in ("_gate_up_kernel", "_down_kernel"):
        monkeypatch.setattr(fm, name, Recorder(name, getattr(fm, name)))
    x, router, w_gate_up, w_down = make_block(3, 8, 64, 32, torch.float32, seed=1)
    fused_moe(x, router, w_gate_up, w_down, 2, True, config=dict(num_stages=2, STAGES_DOWN=5, MAXNREG_UP=96))
    assert launched["_gate_up_kernel"] == dict(num_stages=2, num_warps=4, maxnreg=96)
    assert launched["_down_kernel"] == dict(num_stages=5, num_warps=4, maxnreg=None)
    fused_moe(x, router, w_gate_up, w_down, 2, True, config=dict(num_stages=2))
    assert launched["_gate_up_kernel"]["num_stages"] == launched["_down_kernel"]["num_stages"] == 2


def test_bench_sweeps_launch_overrides_on_the_same_inputs():
    """`--sweep`: each group of overrides timed on the row's own inputs, its output compared with the row's; a
    key the launch does not take is refused in one line."""
    from ddtree_lab.bench import fused_moe as bench_fused_moe

    rows = bench_fused_moe.main(["--smoke", "--int4", "32", "--tokens", "3", "--sweep",
                                 "BLOCK_N_UP=16,BLOCK_N_DOWN=16", "BLOCK_M=32", "MAXNREG_UP=96,MAXNREG_DOWN=80",
                                 "STAGES_DOWN=5"])
    sweep = rows[0]["sweep"]
    assert [c["config"] for c in sweep] == [dict(BLOCK_N_UP=16, BLOCK_N_DOWN=16), dict(BLOCK_M=32),
                                            dict(MAXNREG_UP=96, MAXNREG_DOWN=80), dict(STAGES_DOWN=5)]
    assert all(c["us"] > 0 and isinstance(c["equal"], bool) for c in sweep)
    # a register cap changes where values live, loads ahead when they arrive: never a bit of the result
    assert sweep[2]["equal"] and sweep[3]["equal"]
    with pytest.raises(SystemExit):
        bench_fused_moe.main(["--smoke", "--sweep", "BLOCK_N_UP=16,warps=2"])


@pytest.mark.parametrize("T,E,k,held", [(1, 8, 2, 4), (5, 8, 2, 2), (17, 16, 4, 4), (40, 12, 3, 6)])
def test_pairs_held_elsewhere_add_nothing(T, E, k, held):
    """Expert parallelism: ranks holding E/held slices of the experts each compute the pairs routed to theirs
    (the others passed as id `held`, one past the last); the ranks' outputs sum to the whole block's, each rank's
    counts are the whole block's at its experts plus the pairs sent elsewhere, and rank by rank the kernels equal
    the reference."""
    H, I = 64, 32
    x, _, w_gate_up, w_down = make_block(T, E, H, I, torch.float32, seed=T * 7 + E)
    g = torch.Generator().manual_seed(T + E)
    weights, ids = route_grouped_reference(torch.randn(T, E, generator=g).to(DEVICE), torch.zeros(E, device=DEVICE),
                                           k, 1, 1, "sigmoid", True, 1.0)
    whole, whole_counts = fused_moe_routed(x, weights, ids, w_gate_up, w_down)
    total = torch.zeros_like(whole)
    for r in range(E // held):
        mine = torch.arange(r * held, (r + 1) * held, device=DEVICE)
        local = torch.where((ids >= r * held) & (ids < (r + 1) * held), ids - r * held, held)
        gu, dn = w_gate_up[mine], w_down[mine]
        out, counts = fused_moe_routed(x, weights, local, gu, dn, elsewhere=True)
        want, want_counts = fused_moe_routed_reference(x, weights, local, gu, dn, elsewhere=True)
        assert torch.allclose(out, want, atol=1e-5, rtol=1e-5), (out - want).abs().max()
        assert torch.equal(counts, want_counts) and counts.shape == (held + 1,)
        assert torch.equal(counts[:held], whole_counts[mine]) and int(counts[held]) == T * k - int(counts[:held].sum())
        total += out
    assert torch.allclose(total, whole, atol=1e-5, rtol=1e-5), (total - whole).abs().max()


@pytest.mark.parametrize("T", [1, 2, 9])
def test_programmatic_dependent_launches_change_no_bit(T):
    """PDL=1 (kernels/pdl.py): on a GPU every launch of an expert-parallel share's block (the sort, the split
    gate-up, SiLU·mul, down, combine) is a programmatic dependent of the one before, called twice in a row, eagerly
    and replayed from a CUDA graph: the same bits as plain launches. Under the interpreter (the CPU twin) the option
    is dropped (kernels/pdl.pdl_applies) and the block is the same too."""
    from ddtree_lab.kernels.pdl import pdl_applies
    from ddtree_lab.testing import assert_replays_equal

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, router, w_gate_up, w_down = make_block(T, 8, 256, 64, dtype, seed=T)
    weights, ids = route_reference(F.linear(x.float(), router.float()), 2, True)
    ids = torch.where(ids >= 4, 8, ids)  # experts 4-7 another rank's
    base = dict(BLOCK_K_UP=16, SPLIT_K_UP=4)

    def block(pdl):
        cfg = dict(base, PDL=1) if pdl else base
        first, _ = fused_moe_routed(x, weights, ids, w_gate_up[:4], w_down[:4], config=cfg, elsewhere=True)
        second, _ = fused_moe_routed(first, weights, ids, w_gate_up[:4], w_down[:4], config=cfg, elsewhere=True)
        return second

    want = block(False)
    assert torch.equal(block(True), want)
    assert pdl_applies(True, x) == (DEVICE == "cuda")
    if DEVICE == "cuda":
        assert_replays_equal(lambda: block(True), want)
