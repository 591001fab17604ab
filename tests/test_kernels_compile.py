"""The Triton kernels compile for Hopper (sm_90), with no GPU needed: the interpreter runs a kernel's
Python, but type rules that only the compiler enforces (a loop variable changing type, say) would
otherwise first fail on the GPU. Triton's wheel ships the compiler and ptxas."""
import importlib.util
import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # an older or newer layout of triton's compiler API
    pytest.skip("this triton has no ASTSource/GPUTarget compile API", allow_module_level=True)

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
HOPPER = GPUTarget("cuda", 90, 32)


def compiled_module(name):
    """The kernel file imported without the interpreter (its jit functions are then compilable)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        spec = importlib.util.spec_from_file_location(f"_compile_{name}", KERNELS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


CASES = [
    ("tree_build", "_beam_step_kernel",
     {"Prev": "*fp32", "Lp": "*fp32", "CandSlot": "*i64", "CandRank": "*i64", "OutScore": "*fp32",
      "OutFlat": "*i64", "M": "i32", "W": "i32", "K": "i32"}, {"BLOCK_C": 64, "BLOCK_K": 64}),
    ("tree_build", "_select_kernel",
     {"Beam": "*fp32", "BeamFlat": "*i64", "TopLp": "*fp32", "TopTok": "*i64", "Tokens": "*i64",
      "Depths": "*i64", "Parents": "*i64", "Scores": "*fp32", "Logprobs": "*fp32", "Ranks": "*i64",
      "L": "i32", "W": "i32", "K": "i32", "n": "i32"}, {"BLOCK_E": 64, "BLOCK_W": 64}),
    ("tree_walk", "_masks_kernel",
     {"Parents": "*i64", "Anc": "*i8", "Bits": "*i32", "T": "i32", "n_words": "i32", "L": "i32"},
     {"BLOCK_J": 128}),
    ("tree_walk", "_accept_kernel",
     {"Tokens": "*i64", "Parents": "*i64", "Depths": "*i64", "Choice": "*i64", "Path": "*i64", "A": "*i64",
      "T": "i32", "L": "i32"}, {"BLOCK_T": 128, "BLOCK_P": 16}),
    ("commit", "_advance_kernel",
     {"Tokens": "*i64", "Path": "*i64", "A": "*i64", "Choice": "*i64", "N": "*i64", "Bonus": "*i64", "Out": "*i64",
      "OutLen": "*i64", "Taus": "*i64", "RoundIdx": "*i64", "CtxPos": "*i64", "CtxCount": "*i64", "L": "i32"},
     {"BLOCK": 16}),
]


@pytest.mark.parametrize("module,kernel,signature,constexprs", CASES, ids=[c[1] for c in CASES])
def test_kernel_compiles_for_sm90(module, kernel, signature, constexprs):
    fn = getattr(compiled_module(module), kernel)
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    compiled = triton.compile(src, target=HOPPER)
    assert len(compiled.asm["cubin"]) > 1000
