"""GPU kernels for ddtree_lab (Triton), each with a torch reference beside it.

Installed as `ddtree_lab.kernels`. Importing needs triton; the kernels run on CUDA devices, or
on the CPU under the Triton interpreter when TRITON_INTERPRET=1 is set before triton is imported
(the kernel tests do this themselves when no GPU is present).
"""
import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        # compiled Triton cannot run without a GPU; the interpreter can (slowly). The flag is read
        # when the kernels are decorated, i.e. when the modules below are imported.
        _os.environ["TRITON_INTERPRET"] = "1"
from .kv_compact import compact_kv, compact_kv_reference
from .tree_attention import (
    ancestor_matrix,
    causal_matrix,
    pack_mask,
    tree_attention,
    tree_attention_reference,
    unpack_mask,
)

__all__ = [
    "tree_attention",
    "tree_attention_reference",
    "ancestor_matrix",
    "causal_matrix",
    "pack_mask",
    "unpack_mask",
    "compact_kv",
    "compact_kv_reference",
]
