"""Carry the imported SmolLM2 target to a machine that cannot download it, in few small files.

The imported target is float32, but every weight came from a Q4_1 or Q8_0 block of the GGUF file, so
the exact float32 values are recovered from the block data: 4-bit codes with an fp16 scale and
minimum per 32 weights (Q4_1), or int8 codes with an fp16 scale (Q8_0). `pack` finds that form for
each tensor (and keeps a tensor as it is when no form reproduces it bit for bit), writes the codes into
safetensors parts of at most --part-mib, and records a sha256 per tensor; `unpack` rebuilds the
HF directory and checks every hash (docs/smollm2.md gives the sizes).

Run on either machine (from a checkout, installed or not):

    python -m ddtree_lab.train.smollm2.ship pack   TARGET_DIR PACK_DIR [--part-mib 30]
    python -m ddtree_lab.train.smollm2.ship unpack PACK_DIR_OR_PARTS... OUT_DIR
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import time
from pathlib import Path

import torch

SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "gguf_import.json")


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _q4_1(w: torch.Tensor):
    """float32 [.., k*32] -> (packed codes uint8, d fp16, m fp16) or None if not bit-exact."""
    b = w.reshape(-1, 32)
    mn, mx = b.min(1).values, b.max(1).values
    d, m = ((mx - mn) / 15).half(), mn.half()
    df = d.float()
    q = torch.where(df[:, None] > 0, ((b - m.float()[:, None]) / df.clamp(min=1e-30)[:, None]).round(),
                    torch.zeros_like(b)).clamp(0, 15).to(torch.uint8)
    if not torch.equal(_dq4_1(q, d, m), b):
        return None
    return q[:, 0::2] | (q[:, 1::2] << 4), d, m


def _dq4_1(q, d, m):
    return d.float()[:, None] * q.float() + m.float()[:, None]  # the GGUF reader's order: d * q + m


def _q8_0(w: torch.Tensor):
    b = w.reshape(-1, 32)
    d = (b.abs().max(1).values / 127).half()
    q = torch.where(d.float()[:, None] > 0, (b / d.float().clamp(min=1e-30)[:, None]).round(),
                    torch.zeros_like(b)).clamp(-128, 127).to(torch.int8)
    return (q, d) if torch.equal(d.float()[:, None] * q.float(), b) else None


def pack(target: Path, out: Path, part_mib: float = 30.0, log=print) -> dict:
    from safetensors import safe_open
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    entries, blobs = {}, []  # blobs: (tensor-name-in-part, tensor)
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            e = {"shape": list(w.shape), "dtype": str(w.dtype).replace("torch.", ""), "sha256": _sha(w)}
            r = _q4_1(w.float()) if w.dtype == torch.float32 and w.numel() % 32 == 0 and w.dim() == 2 else None
            if r is not None:
                e["kind"] = "q4_1"
                blobs += [(f"{name}.q", r[0]), (f"{name}.d", r[1]), (f"{name}.m", r[2])]
            else:
                r = _q8_0(w.float()) if w.dtype == torch.float32 and w.numel() % 32 == 0 and w.dim() == 2 else None
                if r is not None:
                    e["kind"] = "q8_0"
                    blobs += [(f"{name}.q", r[0]), (f"{name}.d", r[1])]
                else:
                    e["kind"] = "raw"
                    blobs.append((f"{name}.raw", w))
            entries[name] = e
    limit = part_mib * 2**20
    parts, cur, size = [], {}, 0
    for k, t in _split_rows(blobs, limit):
        nb = t.numel() * t.element_size()
        if cur and size + nb > limit:
            parts.append(cur)
            cur, size = {}, 0
        cur[k], size = t.contiguous(), size + nb
    parts.append(cur)
    # side files go into the last part's folder; each part is its own folder so that it can travel alone
    for i, p in enumerate(parts):
        d = out / f"part{i}"
        d.mkdir(exist_ok=True)
        save_file(p, str(d / "weights.safetensors"))
    last = out / f"part{len(parts) - 1}"
    for fn in SIDE_FILES:
        if (target / fn).is_file():
            with gzip.open(last / f"{fn}.gz", "wb", compresslevel=9) as g:
                g.write((target / fn).read_bytes())
    manifest = {"tensors": entries, "parts": len(parts), "side_files": [f for f in SIDE_FILES if (target / f).is_file()]}
    (last / "manifest.json").write_text(json.dumps(manifest) + "\n")
    sizes = [sum(f.stat().st_size for f in (out / f"part{i}").iterdir()) / 2**20 for i in range(len(parts))]
    kinds = {k: sum(e["kind"] == k for e in entries.values()) for k in ("q4_1", "q8_0", "raw")}
    log(f"pack: {target} -> {out}: {len(parts)} parts of {', '.join(f'{s:.1f}' for s in sizes)} MiB, "
        f"tensors {kinds}, {time.time() - t0:.0f}s")
    return {"parts_mib": sizes, "kinds": kinds}


def _split_rows(blobs: list, limit: float) -> list:
    """A blob larger than a part (the int8 embedding) travels as row chunks 'name#0', 'name#1', …"""
    out = []
    for k, t in blobs:
        row_bytes = t[0].numel() * t.element_size() if t.dim() else t.element_size()
        if t.dim() == 0 or t.numel() * t.element_size() <= limit or row_bytes > limit:
            out.append((k, t))
            continue
        rows = max(1, int(limit // row_bytes))
        out += [(f"{k}#{i}", c) for i, c in enumerate(t.split(rows))]
    return out


def _join_rows(blobs: dict) -> dict:
    """Inverse of _split_rows: concatenates 'name#i' chunks in order of i."""
    chunks: dict[str, dict[int, torch.Tensor]] = {}
    for k in [k for k in blobs if "#" in k]:
        name, _, i = k.rpartition("#")
        chunks.setdefault(name, {})[int(i)] = blobs.pop(k)
    for name, c in chunks.items():
        blobs[name] = torch.cat([c[i] for i in range(len(c))])
    return blobs


def unpack(sources: list[Path], out: Path, log=print) -> Path:
    """sources: the pack dir, or its part folders (wherever each travelled). Rebuilds and checks out/."""
    from safetensors.torch import load_file, save_file
    dirs = []
    for s in sources:
        dirs += sorted(p for p in s.glob("part*") if p.is_dir()) if not (s / "weights.safetensors").exists() else [s]
    man_dir = [d for d in dirs if (d / "manifest.json").exists()]
    if not man_dir:
        raise SystemExit(f"unpack: no manifest.json among {[str(d) for d in dirs]}")
    manifest = json.loads((man_dir[0] / "manifest.json").read_text())
    if len(dirs) != manifest["parts"]:
        raise SystemExit(f"unpack: {len(dirs)} of {manifest['parts']} parts found in {[str(s) for s in sources]}")
    blobs = {}
    for d in dirs:
        blobs.update(load_file(str(d / "weights.safetensors")))
    blobs = _join_rows(blobs)
    sd = {}
    for name, e in manifest["tensors"].items():
        if e["kind"] == "q4_1":
            p = blobs[f"{name}.q"]
            q = torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], 32)
            w = _dq4_1(q, blobs[f"{name}.d"], blobs[f"{name}.m"])
        elif e["kind"] == "q8_0":
            w = blobs[f"{name}.d"].float()[:, None] * blobs[f"{name}.q"].float()
        else:
            w = blobs[f"{name}.raw"]
        w = w.reshape(e["shape"]).to(getattr(torch, e["dtype"]))
        if _sha(w) != e["sha256"]:
            raise SystemExit(f"unpack: tensor {name} does not match its sha256")
        sd[name] = w
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for fn in manifest["side_files"]:
        with gzip.open(man_dir[0] / f"{fn}.gz", "rb") as g:
            (tmp / fn).write_bytes(g.read())
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    log(f"unpack: {len(sd)} tensors rebuilt and checked -> {out}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree_lab.train.smollm2.ship", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("target")
    a.add_argument("out")
    a.add_argument("--part-mib", type=float, default=30.0)
    b = sub.add_parser("unpack")
    b.add_argument("sources", nargs="+", help="pack dir or part folders, then the output dir last")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        pack(Path(args.target), Path(args.out), args.part_mib)
    else:
        if len(args.sources) < 2:
            raise SystemExit("unpack needs the pack (or its parts) and an output dir")
        unpack([Path(s) for s in args.sources[:-1]], Path(args.sources[-1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
