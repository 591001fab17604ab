"""Atomic writes: a reader (or a re-run after a crash) never sees half a file or half a run.

Files are written to a temp file in the same directory, flushed, fsynced and renamed over the
target (rename within one filesystem is atomic on POSIX). Run directories are built under a temp
name and renamed into place when finished.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator


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
    """Every non-empty line as JSON; a ValueError names the file and line of one that is not."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {n}: not JSON ({e.msg}, column {e.colno})") from None
    return out


# Written into every temp directory this module makes (and into an old run renamed aside), so that
# cleaning after a killed process removes only what this code made, never a user's look-alike entry.
MARKER = ".ddtree-lab-partial"


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
        with contextlib.suppress(OSError):
            (trash / MARKER).touch()
    with contextlib.suppress(FileNotFoundError):
        (src / MARKER).unlink()
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
    (tmp / MARKER).write_text(f"{os.getpid()}\n")
    try:
        yield tmp
    except BaseException:
        if keep_on_error:
            replace_dir(tmp, dst)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, dst)


def clean_stale_temps(parent: str | os.PathLike, names: Iterable[str]) -> list[Path]:
    """Remove the temp and set-aside directories of `names` that a killed process left in `parent`
    (`.<name>.tmp-*` / `.<name>.old-*` holding this module's marker); returns what was removed.
    Anything else, hidden or not, is left alone. Call it only while holding the folder's lock."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    pattern = re.compile(r"^\.(%s)\.(tmp|old)-" % "|".join(re.escape(n) for n in names)) if names else None
    removed = []
    for p in sorted(parent.iterdir()):
        if pattern is not None and pattern.match(p.name) and p.is_dir() and not p.is_symlink() \
                and (p / MARKER).is_file():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


# ----------------------------------------------------------------------------- file digests
def stream_sha256(src: BinaryIO, sink: BinaryIO | None = None) -> str:
    """The sha256 of a binary stream read to its end, each block also written to `sink` when given:
    a copy and its digest in one read."""
    h = hashlib.sha256()
    while block := src.read(1 << 20):
        h.update(block)
        if sink is not None:
            sink.write(block)
    return h.hexdigest()


def file_digest(path: str | os.PathLike) -> dict:
    """{"size", "sha256"} of one file."""
    with open(path, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": stream_sha256(f)}


def digest_tree(root: str | os.PathLike, exclude: Iterable[str] = ()) -> dict[str, dict]:
    """{relative path: file_digest} of every file under root (sorted), less the `exclude` names."""
    root, skip = Path(root), set(exclude) | {MARKER}
    return {p.relative_to(root).as_posix(): file_digest(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in skip}


def changed_files(root: str | os.PathLike, recorded: dict[str, dict]) -> list[str]:
    """What differs from a digest_tree record: '<file>: missing', '<file>: size A, was B', '<file>: content changed'."""
    out = []
    for rel, want in recorded.items():
        p = Path(root) / rel
        if not p.is_file():
            out.append(f"{rel}: missing")
            continue
        size = p.stat().st_size
        if size != want.get("size"):
            out.append(f"{rel}: {size} bytes, was {want.get('size')}")
        elif file_digest(p)["sha256"] != want.get("sha256"):
            out.append(f"{rel}: content changed")
    return out
