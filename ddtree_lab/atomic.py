"""Atomic writes: a reader (or a re-run after a crash) never sees half a file or half a run.

Files are written to a temp file in the same directory, flushed, fsynced and renamed over the
target (rename within one filesystem is atomic on POSIX). Run directories are built under a temp
name and renamed into place when finished.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(obj: Any) -> Any:
    # Tensors, numpy scalars/arrays and dataclasses show up in results; make them plain.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "to_json"):
        return obj.to_json()
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def to_json_text(obj: Any, indent: int | None = 1) -> str:
    return json.dumps(obj, indent=indent, default=_json_default, allow_nan=True)


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    return atomic_write_text(path, to_json_text(obj, indent) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> Path:
    text = "".join(json.dumps(r, default=_json_default, separators=(",", ":")) + "\n" for r in rows)
    return atomic_write_text(path, text)


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Move a finished directory `src` to `dst`, replacing any old `dst`.

    The old directory is first renamed aside, so at every instant `dst` is either the complete old
    run or the complete new one.
    """
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    trash = None
    if dst.exists():
        trash = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(dst, trash)
    os.rename(src, dst)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return dst


@contextlib.contextmanager
def atomic_dir(dst: str | os.PathLike, keep_on_error: bool = False) -> Iterator[Path]:
    """Yield a fresh temp directory next to `dst`; on success it replaces `dst`.

    On an exception the temp directory is removed (or, with keep_on_error, moved into place so a
    failed run's partial outputs can be inspected) and the exception propagates.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700
    try:
        yield tmp
    except BaseException:
        if keep_on_error:
            replace_dir(tmp, dst)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, dst)


def clean_stale_temps(parent: str | os.PathLike) -> None:
    """Remove temp dirs/files left by a killed process (names start with '.' and hold '.tmp-')."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
