"""What this machine can run, checked before anything loads: the device, the attention backend, the
optional libraries. The API (load_pair), the CLI and the study files share these checks, so a mistake
gets the same one line wherever it is made.

Which extra installs a library is read from the package's own metadata (pyproject.toml is its one
home), and the smallest extra that holds it is named.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re

from .names import TRITON_BACKENDS


class RuntimeCheckError(ValueError):
    """A setting this machine cannot run; `field` names the setting ("device" or "attention")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> list[str]:
    """The package's requirements as its metadata lists them: the installed package's, or, in a checkout that
    was never pip-installed, pyproject.toml's written the same way."""
    try:
        return md.requires("ddtree_lab") or []
    except md.PackageNotFoundError:
        import tomllib

        from .environment import REPO_DIR

        try:
            project = tomllib.loads((REPO_DIR / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        except (OSError, KeyError, ValueError):
            return []
        return [f'{req}; extra == "{extra}"' for extra, reqs in project.get("optional-dependencies", {}).items()
                for req in reqs]


def extras() -> dict[str, dict[str, str]]:
    """Each optional extra of ddtree_lab -> {library: its declared version range}."""
    out: dict[str, dict[str, str]] = {}
    requires = _requirements()
    for line in requires:
        req, _, marker = line.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if extra:
            name, spec = re.match(r"\s*([A-Za-z0-9_.\-]+)(?:\[[^]]*\])?\s*\(?([^)]*)\)?", req).groups()
            out.setdefault(extra.group(1), {})[_canonical(name)] = _lowest_first(spec)
    return out


def _lowest_first(spec: str) -> str:
    """'<6,>=5.18' (as metadata writes a range) -> '>=5.18,<6' (as a reader expects it)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    return ",".join(sorted(parts, key=lambda p: not p.startswith(">")))


def extra_for(library: str) -> str | None:
    """The smallest optional extra of ddtree_lab that installs `library` (a distribution name), or None."""
    holding = [(len(libs), extra) for extra, libs in extras().items() if _canonical(library) in libs]
    return min(holding)[1] if holding else None


def check_extra(extra: str, what: str) -> None:
    """ValueError naming every library of `extra` that is missing or outside its declared range (a version
    whose behaviour the suite has not passed with), with the command that installs the range."""
    from packaging.specifiers import SpecifierSet

    wrong = []
    for library, spec in extras().get(extra, {}).items():
        try:
            have = md.version(library)
        except md.PackageNotFoundError:
            wrong.append(f"{library}{spec} (not installed)")
            continue
        if spec and have not in SpecifierSet(spec):
            wrong.append(f"{library}{spec} ({have} is installed)")
    if wrong:
        raise ValueError(f"{what} needs {', '.join(wrong)}: pip install -e '.[{extra}]'")


def install_hint(library: str) -> str:
    """How to install `library`: the extra that holds it, or the library itself."""
    extra = extra_for(library)
    return f"pip install -e '.[{extra}]'" if extra else f"pip install {library}"


def missing_library(what: str, library: str) -> str:
    """One line for `what` needing a library that is not installed."""
    return f"{what} needs the library {library!r}, which is not installed: {install_hint(library)}"


def has_library(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module set to None in sys.modules
        return False


def check_runtime(device: str | None, attention: str | None) -> None:
    """RuntimeCheckError for a device or attention backend this machine cannot run (before any model loads)."""
    device = str(device) if device is not None else None
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeCheckError("device", f"device={device!r}: no CUDA device is visible here (use 'cpu')")
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise RuntimeCheckError("device", f"device={device!r}: this machine has {torch.cuda.device_count()} "
                                              f"CUDA device(s), cuda:0 … cuda:{torch.cuda.device_count() - 1}")
    if attention in TRITON_BACKENDS:
        if not has_library("triton"):
            raise RuntimeCheckError("attention", missing_library(f"attention={attention!r}", "triton"))
        if (device or "cpu") == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeCheckError("attention", f"attention={attention!r} needs a CUDA device (or TRITON_INTERPRET=1 "
                                                 "to run its kernels under the interpreter on the CPU, slowly); "
                                                 "use 'sdpa' on the CPU")


def device_defaults(device: str) -> dict:
    """The dtype and verify attention a benchmark runs with unless told: the GPU's fast path on CUDA
    (bf16, the Triton kernel), the dense reference in fp32 on the CPU."""
    on_gpu = str(device).startswith("cuda")
    return {"dtype": "bfloat16" if on_gpu else "float32", "attention": "triton" if on_gpu else "sdpa"}
