"""What ran where: package versions, the device, the code's commit and digest. One capture for bench
JSON, run results and provenance files, so every recorded figure names its machine and code."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
VERSIONED = ("torch", "triton", "ddtree_lab", "plotly", "papermill", "tokenizers", "transformers")


def versions(packages=VERSIONED) -> dict:
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def device_info(device: Any = None) -> dict:
    """The host, and the GPU when `device` is a CUDA device (best effort: never raises)."""
    info = {"device": str(device) if device is not None else "cpu", "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available() and str(device).startswith("cuda"):
            p = torch.cuda.get_device_properties(torch.device(device).index or 0)
            info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                        cuda=torch.version.cuda, sm=f"{p.major}.{p.minor}")
    except Exception:  # noqa: BLE001 - device info is best effort
        pass
    return info


def git_commit(repo: Path = REPO_DIR) -> str:
    """HEAD of the checkout the package runs from, "-dirty" when tracked files differ; "unknown" outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def source_digest() -> str:
    """sha256 over the package's and the kernels' Python sources (relative path and bytes, in path
    order): names the code that ran even where a copied tree's git metadata is stale or absent."""
    kernels = REPO_DIR / "kernels"
    files = sorted(PACKAGE_DIR.rglob("*.py")) + (sorted(kernels.glob("*.py")) if kernels.is_dir() else [])
    h = hashlib.sha256()
    for f in files:
        if "__pycache__" in f.parts or f.is_symlink() or (f.parent.name == "kernels" and f.parent.parent == PACKAGE_DIR):
            continue
        h.update(f.relative_to(REPO_DIR).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def environment(device: Any = "cuda") -> dict:
    """All of the above, flat, as bench JSON records it ("device" is the GPU's name, or None)."""
    machine = device_info(device)
    return {**versions(), "platform": machine["platform"], "device": machine.get("gpu"), "cuda": machine.get("cuda"),
            "commit": git_commit(), "source_sha256": source_digest()}
