"""INT4 weight-only experts (kernels/int4.py's layout) in the fused-MoE kernels: the layout against
compressed-tensors' own pack, unpack and decompression; the kernels, given routing and their own, against the
dequantize-first reference across token counts, experts, top-k, widths, group sizes, tiles and both schemes.
Without a GPU the kernels run under the interpreter (fp32, fp16); test_gpu_* need CUDA (bf16, real widths)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.kernels.fused_moe import (fused_moe, fused_moe_reference, fused_moe_routed,  # noqa: E402
                                          fused_moe_routed_reference)
from ddtree_lab.kernels.int4 import Int4Weights, dequantize, unpack_int4  # noqa: E402
from ddtree_lab.kernels.moe_layout import route_grouped_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def random_int4(E, N, K, G, symmetric, gen, scale_dtype=torch.float32, device=DEVICE):
    """Uniformly random nibbles (every value -8 … 7 and zero point), scales about 1 / (4·sqrt(K)), so an
    expert's output is O(1)."""
    def words(*shape):
        return torch.randint(-2 ** 31, 2 ** 31, shape, generator=gen, dtype=torch.int64).to(torch.int32)

    scale = (0.5 + torch.rand(E, N, K // G, generator=gen)) / (4 * K ** 0.5)
    zero = None if symmetric else words(E, -(-N // 8), K // G).to(device)
    return Int4Weights(words(E, N, K // 8).to(device), scale.to(device, scale_dtype), zero, G)


def routing(T, E, k, gen):
    """Given routing: distinct experts per token, positive weights (not summing to 1)."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    return torch.rand(T, k, generator=gen).to(DEVICE) + 0.1, ids.to(DEVICE)


def close(out, want, tol):
    err = (out.float() - want.float()).abs().max() / want.float().abs().max()
    return bool(err < tol), float(err)


# ----------------------------------------------------------------------------- the layout

def test_nibble_order_is_compressed_tensors_pack():
    """Value i of a word at bits 4i … 4i+3, stored as value + 8: compressed-tensors' own packing of eight values
    gives exactly that word, and unpack_int4 gives them back; for any values, its unpack and ours agree."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = torch.tensor([[-8, -3, 0, 7, 1, -1, 5, 2]], dtype=torch.int8)
    word = sum((int(v) + 8) << (4 * i) for i, v in enumerate(values[0]))
    packed = helpers.pack_to_int32(values, 4)
    assert packed.shape == (1, 1) and packed.item() % 2 ** 32 == word
    assert torch.equal(unpack_int4(packed), values)
    many = torch.randint(-8, 8, (6, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    stored = helpers.pack_to_int32(many, 4)
    assert torch.equal(unpack_int4(stored), many)
    assert torch.equal(helpers.unpack_from_int32(stored, 4, many.shape), unpack_int4(stored))


@pytest.mark.parametrize("N,K,G", [(16, 64, 32), (20, 256, 128), (8, 32, 32)])  # N = 20: a zero-point word padded
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_equals_compressed_tensors_decompression(N, K, G, symmetric, scale_dtype):
    """A weight compressed by compressed-tensors (its min-max qparams and pack-quantized compressor) dequantizes
    to exactly what its own decompression gives, in the scales' dtype."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=G)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(N + K)).to(scale_dtype)
    groups = weight.unflatten(-1, (-1, G))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    stored = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale,
                                                    "weight_zero_point": zero}, scheme)
    assert ("weight_zero_point" in stored) != symmetric
    want = PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
    w = Int4Weights(stored["weight_packed"][None], stored["weight_scale"][None],
                    None if symmetric else stored["weight_zero_point"][None], G)
    assert w.shape == (1, N, K)
    got = dequantize(w)
    assert got.dtype == scale_dtype and torch.equal(got[0], want)
    assert (got[0].float() - weight.float()).abs().max() <= scale.float().max() * 1.05  # a step, at most


def test_dequantize_picks_experts():
    gen = torch.Generator().manual_seed(1)
    w = random_int4(6, 24, 64, 32, False, gen, device="cpu")
    ids = torch.tensor([[5, 0], [2, 2], [1, 4]])
    assert torch.equal(dequantize(w, torch.float32, ids), dequantize(w, torch.float32)[ids])
    assert dequantize(w, torch.float16).dtype == torch.float16


def test_int4_weights_refusals_name_what_is_wrong():
    gen = torch.Generator().manual_seed(2)
    w = random_int4(2, 16, 96, 32, True, gen, device="cpu")
    with pytest.raises(ValueError, match="K=96 is not a multiple of the group size 64"):
        Int4Weights(w.packed, w.scale[..., :1], None, 64)
    with pytest.raises(ValueError, match="group_size=48 is not a power of two"):
        Int4Weights(w.packed, w.scale[..., :2], None, 48)
    with pytest.raises(ValueError, match="scale must be float"):
        Int4Weights(w.packed, w.scale[:, :8], None, 32)
    with pytest.raises(ValueError, match="packed must be int32"):
        Int4Weights(w.packed.long(), w.scale, None, 32)
    with pytest.raises(ValueError, match=r"zero must be int32 \[E, ceil\(N / 8\), K // G\]"):
        Int4Weights(w.packed, w.scale, torch.zeros(2, 16, 3, dtype=torch.int32), 32)


# ----------------------------------------------------------------------------- the kernels

SHAPES = [  # (T, E, top_k, hidden, width, group): group where both K (hidden for gate_up, width for down) allow
    (1, 8, 2, 64, 96, 32),
    (3, 8, 2, 96, 64, 32),      # hidden 96: the last K tile half past the end (masked words and groups)
    (17, 16, 4, 128, 128, 128),
    (40, 8, 2, 64, 64, 32),
    (40, 16, 4, 64, 128, 32),
]


@pytest.mark.parametrize("T,E,k,H,I,G", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("routed", [True, False])
def test_int4_matches_dequantize_first_reference(T, E, k, H, I, G, symmetric, routed):
    gen = torch.Generator().manual_seed(T * 7 + E + G)
    x = torch.randn(T, H, generator=gen).to(DEVICE)
    w_gate_up, w_down = random_int4(E, 2 * I, H, G, symmetric, gen), random_int4(E, H, I, G, symmetric, gen)
    if routed:
        weights, ids = routing(T, E, k, gen)
        out, counts = fused_moe_routed(x, weights, ids, w_gate_up, w_down)
        want, want_counts = fused_moe_routed_reference(x, weights, ids, w_gate_up, w_down)
    else:
        router = (torch.randn(E, H, generator=gen) / H ** 0.5 * 3).to(DEVICE)
        out, counts = fused_moe(x, router, w_gate_up, w_down, k, True)
        want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, k, True)
    assert out.shape == (T, H) and out.dtype == x.dtype and torch.equal(counts, want_counts)
    ok, err = close(out, want, 1e-5)
    assert ok, err


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_fp16_activations_and_scales(symmetric):
    """fp16 activations, fp16 scales: the kernel's dequantized tile is the reference's (rounded once to fp16)."""
    gen = torch.Generator().manual_seed(5)
    T, E, k, H, I, G = 17, 8, 2, 64, 96, 32
    x = torch.randn(T, H, generator=gen).to(DEVICE, torch.float16)
    w_gate_up = random_int4(E, 2 * I, H, G, symmetric, gen, torch.float16)
    w_down = random_int4(E, H, I, G, symmetric, gen, torch.float16)
    weights, ids = routing(T, E, k, gen)
    out, _ = fused_moe_routed(x, weights, ids, w_gate_up, w_down)
    want, _ = fused_moe_routed_reference(x, weights, ids, w_gate_up, w_down)
    ok, err = close(out, want, 3e-3)
    assert out.dtype == torch.float16 and ok, err


@pytest.mark.parametrize("block_k,G", [(16, 32), (16, 128), (128, 32), (64, 64)])
def test_int4_tiles_inside_and_across_groups(block_k, G):
    """A K tile narrower than a group (one scale a tile) or spanning several (a scale row each), and row
    blocks below an expert's token count."""
    gen = torch.Generator().manual_seed(block_k + G)
    T, E, k, H, I = 33, 2, 2, 128, 128  # every token on both experts: three row blocks each
    x = torch.randn(T, H, generator=gen).to(DEVICE)
    w_gate_up, w_down = random_int4(E, 2 * I, H, G, False, gen), random_int4(E, H, I, G, False, gen)
    weights, ids = routing(T, E, k, gen)
    cfg = dict(BLOCK_M=16, BLOCK_N_UP=64, BLOCK_N_DOWN=64, BLOCK_K_UP=block_k, BLOCK_K_DOWN=block_k)
    out, counts = fused_moe_routed(x, weights, ids, w_gate_up, w_down, config=cfg)
    want, _ = fused_moe_routed_reference(x, weights, ids, w_gate_up, w_down)
    ok, err = close(out, want, 1e-5)
    assert int(counts.max()) > 16 and ok, err


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("H, I, config", [(256, 64, dict(BLOCK_K_UP=32, SPLIT_K_UP=3)),
                                          (64, 128, dict(BLOCK_K_DOWN=32, SPLIT_K_DOWN=3))], ids=["gate_up", "down"])
def test_int4_split_k(symmetric, H, I, config):
    """An AR step's gate-up with its K walk split (a Kimi layer's launch, SPLIT_K_UP), or the down's walk over I
    (the SPLIT_K_DOWN override): the pieces, added in order, give the unsplit block."""
    gen = torch.Generator().manual_seed(21 + symmetric + I)
    T, E, k = 2, 8, 4
    x = torch.randn(T, H, generator=gen).to(DEVICE)
    w_gate_up, w_down = random_int4(E, 2 * I, H, 32, symmetric, gen), random_int4(E, H, I, 32, symmetric, gen)
    weights, ids = routing(T, E, k, gen)
    out, _ = fused_moe_routed(x, weights, ids, w_gate_up, w_down, config=config)
    want, _ = fused_moe_routed_reference(x, weights, ids, w_gate_up, w_down)
    ok, err = close(out, want, 1e-5)
    assert ok, err


def test_int4_equals_its_dense_dequantized_form():
    """The same weights, INT4 or dequantized to dense fp32: the kernels agree (and so do the grouped router's
    int64 ids, given as they come from torch)."""
    gen = torch.Generator().manual_seed(9)
    T, E, k, H, I = 9, 16, 4, 64, 64
    x = torch.randn(T, H, generator=gen).to(DEVICE)
    w_gate_up, w_down = random_int4(E, 2 * I, H, 32, True, gen), random_int4(E, H, I, 32, False, gen)
    logits = torch.randn(T, E, generator=gen).to(DEVICE)
    weights, ids = route_grouped_reference(logits, torch.zeros(E, device=DEVICE), k, 4, 2, "sigmoid", True, 2.5)
    out, counts = fused_moe_routed(x, weights, ids, w_gate_up, w_down)
    dense, dense_counts = fused_moe_routed(x, weights, ids, dequantize(w_gate_up), dequantize(w_down))
    assert torch.equal(counts, dense_counts) and torch.allclose(out, dense, atol=1e-5, rtol=1e-5)


def test_mismatched_weights_are_refused():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=gen).to(DEVICE)
    w_gate_up, w_down = random_int4(8, 64, 64, 32, True, gen), random_int4(8, 64, 64, 32, True, gen)
    weights, ids = routing(3, 8, 2, gen)
    with pytest.raises(AssertionError, match="do not fit together"):
        fused_moe_routed(x, weights, ids, w_gate_up, w_down)
    with pytest.raises(AssertionError, match=r"must both be \[T, k\]"):
        fused_moe_routed(x, weights[:, :1], ids, w_gate_up, random_int4(8, 64, 32, 32, True, gen))


# ----------------------------------------------------------------------------- GPU only

@gpu
@pytest.mark.parametrize("E,I", [(48, 2048), (384, 256)])  # an EP8 rank of Kimi K2; a TP8 rank (every expert)
@pytest.mark.parametrize("T", [1, 9, 33, 129])
def test_gpu_kimi_width_bf16(E, I, T):
    """bf16 activations and scales at DeepSeek-V3 / Kimi K2 width (H 7168, groups of 32, top-8), given routing
    and the kernel's own, against the reference on the same dequantized bf16 weights."""
    gen = torch.Generator().manual_seed(T + E)
    H, k = 7168, 8
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    w_gate_up = random_int4(E, 2 * I, H, 32, True, gen, torch.bfloat16, "cuda")
    w_down = random_int4(E, H, I, 32, False, gen, torch.bfloat16, "cuda")
    weights, ids = routing(T, E, k, gen)
    out, counts = fused_moe_routed(x, weights, ids, w_gate_up, w_down)
    want, want_counts = fused_moe_routed_reference(x, weights, ids, w_gate_up, w_down)
    ok, err = close(out, want, 2e-2)
    assert torch.equal(counts, want_counts) and ok, err
    router = (torch.randn(E, H, generator=gen) / H ** 0.5).to("cuda", torch.bfloat16)
    out, counts = fused_moe(x, router, w_gate_up, w_down, k, True)
    want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, k, True)
    ok, err = close(out, want, 2e-2)
    assert torch.equal(counts, want_counts) and ok, err


@gpu
@pytest.mark.parametrize("T", [1, 33])
def test_gpu_paired_unpacking_equals_fp32_unpacking(T):
    """bf16 activations unpack two values an instruction (inline assembly the interpreter cannot run); the fp32
    unpacking, its twin here and under the interpreter, gives the same bf16 weights, so the outputs are equal."""
    gen = torch.Generator().manual_seed(11 + T)
    E, k, H, I = 16, 4, 1024, 256
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    w_gate_up = random_int4(E, 2 * I, H, 32, True, gen, torch.bfloat16, "cuda")
    w_down = random_int4(E, H, I, 32, True, gen, torch.bfloat16, "cuda")
    weights, ids = routing(T, E, k, gen)
    paired, _ = fused_moe_routed(x, weights, ids, w_gate_up, w_down)
    fp32, _ = fused_moe_routed(x, weights, ids, w_gate_up, w_down, config={"paired": False})
    assert torch.equal(paired, fp32)


@gpu
def test_gpu_int4_cuda_graph_replays_new_routing():
    """One capture of the routed INT4 path serves any routing of the same T."""
    gen = torch.Generator().manual_seed(4)
    T, E, k, H, I = 17, 64, 8, 1024, 256
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    w_gate_up = random_int4(E, 2 * I, H, 32, True, gen, torch.bfloat16, "cuda")
    w_down = random_int4(E, H, I, 32, True, gen, torch.bfloat16, "cuda")
    weights, ids = routing(T, E, k, gen)
    static_w, static_ids = weights.clone(), ids.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_moe_routed(x, static_w, static_ids, w_gate_up, w_down)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, counts = fused_moe_routed(x, static_w, static_ids, w_gate_up, w_down)
    for _ in range(3):
        weights, ids = routing(T, E, k, gen)
        static_w.copy_(weights)
        static_ids.copy_(ids)
        g.replay()
        want, want_counts = fused_moe_routed(x, weights, ids, w_gate_up, w_down)
        assert torch.equal(out, want) and torch.equal(counts, want_counts)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_pairs_held_elsewhere_add_nothing(symmetric):
    """Expert parallelism with INT4 experts: two ranks' halves (packed words, scales, zero points sliced by
    expert), the other half's pairs passed as id E/2; each rank equals the reference, and the two sum to the
    whole block."""
    T, E, k, H, I, G = 9, 8, 3, 64, 32, 32
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen).to(DEVICE)
    w_gate_up, w_down = random_int4(E, 2 * I, H, G, symmetric, gen), random_int4(E, H, I, G, symmetric, gen)
    weights, ids = routing(T, E, k, gen)
    whole, _ = fused_moe_routed(x, weights, ids, w_gate_up, w_down)

    def half(w, r):
        sl = slice(r * E // 2, (r + 1) * E // 2)
        return Int4Weights(w.packed[sl], w.scale[sl], None if w.zero is None else w.zero[sl], w.group_size)

    total = torch.zeros_like(whole)
    for r in range(2):
        local = torch.where(ids // (E // 2) == r, ids % (E // 2), E // 2)
        out, counts = fused_moe_routed(x, weights, local, half(w_gate_up, r), half(w_down, r), elsewhere=True)
        want, want_counts = fused_moe_routed_reference(x, weights, local, half(w_gate_up, r), half(w_down, r),
                                                       elsewhere=True)
        assert torch.equal(counts, want_counts) and close(out, want, 1e-5)[0]
        total += out
    assert close(total, whole, 1e-5)[0]
