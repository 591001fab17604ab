"""`ddtree-lab bench` (cli.py) and the micro-benchmarks: speed measured side by side in one run, as JSON.

  e2e.py         rounds end to end: stage times, tokens/s, the AR step's roofline; prompts; profiles; the
                 timed passes every bench over prompts shares
  overhead.py    what budget="auto" costs beyond its rounds, per call and per round; the MoE counts' read
  attention.py   verify attention: triton vs sdpa vs flex; MLA: triton vs sdpa (python -m ddtree_lab.bench.attention)
  timing.py      a call timed inside a captured graph; the copy bandwidth (torch only)
  tree_build.py  the one-launch tree build's warps (python -m ddtree_lab.bench.tree_build)
  vocab_topk.py  the per-depth top-K kernel vs torch (python -m ddtree_lab.bench.vocab_topk)
  fused_moe.py   the MoE block vs torch's grouped path vs its floor (python -m ddtree_lab.bench.fused_moe)
  commit.py      the commit after the walk, fixed and with budget="auto"'s update (python -m ddtree_lab.bench.commit)

A micro-benchmark's `--baseline FILE` times another version of its kernel file beside this one
(`load_kernel_file`); each writes its rows with `write_bench_json`.
"""
from __future__ import annotations

# the MLA attention bench's default sweep (attention.py and the CLI's `bench mla`; here, importable without Triton)
MLA_TREES = (1, 17, 129, 1025)  # an AR step, then trees of budgets 16, 128, 1024 with their root
MLA_CONTEXTS = (4096, 32768)
MLA_HEADS = (64, 8)  # Kimi K2's heads on one GPU; a TP8 rank's


def smoke_device(ap) -> str:
    """A `--smoke` run's device: the GPU, else the CPU with the kernels under Triton's interpreter (set here, before
    triton first loads; refused in one line where it already has)."""
    import os
    import sys

    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:  # (the interpreter is chosen as triton first loads)
            ap.error("--smoke on the CPU runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def load_kernel_file(path: str, name: str):
    """A kernel file from elsewhere (`git show REV:kernels/X.py > old.py`) as a module of its own, `name`. A
    neighbour it imports as a lone file (`from auto_budget import …`) is the file beside it where that folder is
    not this checkout's kernels/, else this checkout's own module: a file kept alone in /tmp still finds
    `moe_layout`, and the INT4 weights it is handed are instances of the classes it checks for, whatever an earlier
    load of another folder left in sys.modules."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    from .. import kernels

    folder = Path(path).resolve().parent
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    for ours in Path(kernels.__file__).resolve().parent.glob("*.py"):
        beside = folder / ours.name
        if ours.stem == "__init__":
            continue
        if beside.exists() and beside != ours:  # its own neighbour: a module loaded from elsewhere is dropped
            loaded = getattr(sys.modules.get(ours.stem), "__file__", None)
            if loaded is not None and Path(loaded).resolve() != beside:
                del sys.modules[ours.stem]
        else:
            sys.modules[ours.stem] = importlib.import_module(f"{kernels.__name__}.{ours.stem}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_bench_json(path: str, rows: list, module: str, argv: list[str] | None, **meta) -> None:
    """A micro-benchmark's rows as JSON, written atomically, after what names the run: the machine, the library
    versions, the command (`python -m module argv…`; argv None: the process's own), the commit and the digest of
    the sources that ran, and `meta`."""
    import shlex
    import sys

    import torch
    import triton

    from ..atomic import atomic_write_json
    from ..environment import git_commit, source_digest

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
    if module == "__main__":  # run as `python -m …`: the module's own name is its spec's
        module = sys.modules["__main__"].__spec__.name
    command = shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])
    atomic_write_json(path, {"device": device, "torch": torch.__version__, "triton": triton.__version__,
                             "command": command, "commit": git_commit(), "source_sha256": source_digest(), **meta,
                             "rows": rows})
