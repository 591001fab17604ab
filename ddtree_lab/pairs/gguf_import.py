"""Import a GGUF checkpoint into a Hugging Face model directory that `load_pair` reads.

    ddtree-lab import-gguf SmolLM2-135M-Instruct.Q4_1.gguf ~/models/smollm2

The libraries do the hard parts: `transformers` (with `gguf` and `accelerate`, the optional
`gguf` extra) dequantizes the blocks, maps llama.cpp tensor names to HF ones (undoing the q/k row
permutation llama.cpp applies for its RoPE layout) and rebuilds the tokenizer and chat template.
This module checks the file, writes plain safetensors + config.json + tokenizer files, and keeps
the chat template where `load_pair` looks for it (tokenizer_config.json). The directory is built
under a temporary name and renamed into place (`atomic.atomic_dir`), so it is either complete or absent.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..atomic import atomic_dir, file_digest
from ..names import STUDY_DTYPES
from ..runtime import check_extra
from . import PULLABLE

# Files whose content we know: a file with one of these names must have this sha256.
KNOWN_SHA256 = {Path(spec.member).name: spec.sha256 for spec in PULLABLE.values()}  # what `pull` may import
PROVENANCE = "gguf_import.json"  # says where the weights came from; `pull` compares its sha256


class GGUFImportError(RuntimeError):
    """A GGUF file that cannot be imported, or a missing optional dependency."""


class HashMismatchError(GGUFImportError):
    def __init__(self, path, expected: str, actual: str):
        self.path, self.expected, self.actual = Path(path), expected, actual
        super().__init__(f"{path}: sha256 mismatch: expected {expected}, got {actual} "
                         "(a corrupted or different file; download it again)")


# ----------------------------------------------------------------------------- checks

def require_extra() -> None:
    """Fail early, with the install command, when the optional `gguf` extra is missing or outside the versions
    it declares (transformers' GGUF reader changed its behaviour between releases)."""
    try:
        check_extra("gguf", "importing GGUF files")
    except ValueError as e:
        raise GGUFImportError(str(e)) from None


def verify_hash(path, expected: str | None = None) -> tuple[str, str | None]:
    """-> (actual sha256, what it was checked against or None). Raises HashMismatchError.

    `expected` wins; otherwise a known file name is checked against KNOWN_SHA256.
    """
    path = Path(path)
    actual = file_digest(path)["sha256"]
    want = expected.lower() if expected else KNOWN_SHA256.get(path.name)
    if want is not None and actual != want:
        raise HashMismatchError(path, want, actual)
    return actual, want


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise GGUFImportError(f"{path}: file not found")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")


def describe_gguf(path) -> dict:
    """Metadata worth recording: architecture, name, tensor types (reads the header only)."""
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key):
        f = reader.fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:  # older gguf versions lack .contents(); the value is cosmetic here
            return None

    return {"architecture": field("general.architecture"), "name": field("general.name"),
            "license": field("general.license"),
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors))}


# ----------------------------------------------------------------------------- import

def _load_with_transformers(path: Path):
    """-> (model, tokenizer) from transformers, dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers 5 may keep GGUF blocks packed when a kernel exists; we want dense weights
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(gguf_file=path.name, dequantize=True)
    except ImportError:
        pass  # 4.x always dequantizes
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32, **kwargs)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     torch_dtype=torch.float32, **kwargs)
    return model, tok


def _dense_state(model, dtype) -> dict:
    """HF parameter names -> contiguous tensors; a tied lm_head is left out (it is the embedding)."""
    import torch

    state = {}
    for name, p in model.named_parameters():
        if not torch.is_floating_point(p) or p.device.type == "meta":
            raise GGUFImportError(f"tensor '{name}' was not dequantized ({p.dtype}, {p.device}); "
                                  "this transformers version keeps GGUF blocks packed")
        state[name] = p.detach().to("cpu", dtype).contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


_CONFIG_NOISE = ("id2label", "label2id", "output_hidden_states", "output_attentions", "return_dict",
                 "chunk_size_feed_forward", "is_encoder_decoder", "problem_type")


def _hf_config(model, dtype_name: str) -> dict:
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights we write are plain tensors
    for key in [k for k in cfg if k.startswith("_") or k in _CONFIG_NOISE]:
        cfg.pop(key)  # generic PretrainedConfig fields that say nothing about this model
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = cfg["dtype"] = dtype_name
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]  # transformers 4.x readers look for it here
    return cfg


def _write_tokenizer(tok, directory: Path, context_length: int | None) -> None:
    tok.save_pretrained(str(directory))
    tcfg_path = directory / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    jinja = directory / "chat_template.jinja"
    template = getattr(tok, "chat_template", None)
    if not tcfg.get("chat_template"):
        if jinja.is_file():  # newer transformers save the template beside, not inside
            template = jinja.read_text()
        if template:
            tcfg["chat_template"] = template
    for key in ("is_local", "local_files_only", "backend"):  # load-time details, not tokenizer facts
        tcfg.pop(key, None)
    if tcfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # readable by transformers 4.x and 5.x
    if context_length:
        tcfg["model_max_length"] = int(context_length)
    tcfg_path.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")


def import_gguf(gguf_path, out_dir, dtype: str = "float32", expected_sha256: str | None = None,
                overwrite: bool = False, log=print, already_verified: bool = False) -> Path:
    """Convert FILE.gguf into an HF model directory at `out_dir`; return it.

    `already_verified`: the caller has checked the file against `expected_sha256` as it wrote it (`pull`
    hashes while it extracts), so the file is not read a second time for its digest.
    """
    from safetensors.torch import save_file

    from ..checkpoint import torch_dtype
    from ..config import SUPPORTED_TARGETS, target_config_from_hf

    gguf_path, out_dir = Path(gguf_path).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    if dtype not in STUDY_DTYPES:
        raise GGUFImportError(f"dtype={dtype!r} is not one of {', '.join(STUDY_DTYPES)}")
    _check_gguf_file(gguf_path)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise GGUFImportError(f"{out_dir} exists and is not empty (pass --force to replace it)")
    require_extra()
    start = time.perf_counter()
    if already_verified:
        if not expected_sha256:
            raise GGUFImportError("already_verified needs the expected_sha256 the file was checked against")
        sha = checked = expected_sha256.lower()
    else:
        sha, checked = verify_hash(gguf_path, expected_sha256)
    log(f"sha256 {sha} " + ("(verified)" if checked else "(not a known file: not verified)"))
    meta = describe_gguf(gguf_path)
    log(f"reading {gguf_path.name}: {meta['architecture']} '{meta['name']}', tensors {meta['tensor_types']}")

    import torch  # noqa: F401  (after the extra check: the error above names what to install)
    try:
        model, tok = _load_with_transformers(gguf_path)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise GGUFImportError(f"{gguf_path}: transformers could not load it: {e}") from e
    arch = type(model).__name__
    if arch not in SUPPORTED_TARGETS:
        raise GGUFImportError(f"{gguf_path}: the model is a {arch}; ddtree_lab targets are "
                              f"{', '.join(SUPPORTED_TARGETS)}")
    cfg = _hf_config(model, dtype)
    target_config_from_hf(cfg, out_dir / "config.json")  # refuse now what load_pair would refuse later
    state = _dense_state(model, torch_dtype(dtype))

    with atomic_dir(out_dir) as tmp:  # an existing out_dir is replaced only with overwrite (or when empty)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _write_tokenizer(tok, tmp, cfg.get("max_position_embeddings"))
        (tmp / PROVENANCE).write_text(json.dumps({
            "source": gguf_path.name, "sha256": sha, "sha256_verified": bool(checked), "dtype": dtype,
            **meta, "versions": _versions(), "imported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=2, default=str) + "\n")
    n_params = sum(t.numel() for t in state.values())
    log(f"wrote {out_dir} ({arch}, {n_params / 1e6:.1f}M parameters, {dtype}) "
        f"in {time.perf_counter() - start:.1f}s")
    return out_dir


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("transformers", "gguf", "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def read_provenance(directory) -> dict | None:
    p = Path(directory) / PROVENANCE
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ----------------------------------------------------------------------------- CLI

def add_import_gguf_args(p) -> None:
    p.add_argument("gguf_file", help="the .gguf checkpoint (Llama or Qwen3 architecture)")
    p.add_argument("out_dir", help="the Hugging Face model directory to write")
    p.add_argument("--dtype", choices=STUDY_DTYPES, default="float32",
                   help="weights dtype on disk (default float32: dequantized values are exact in it)")
    p.add_argument("--sha256", default=None, help="expected sha256 of the file (known files are checked anyway)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")


def run_import_gguf_cli(args) -> int:
    try:
        import_gguf(args.gguf_file, args.out_dir, dtype=args.dtype, expected_sha256=args.sha256,
                    overwrite=args.force)
    except GGUFImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"load it with: dl.load_pair(target={str(Path(args.out_dir).expanduser())!r})")
    return 0


__all__ = ["import_gguf", "verify_hash", "require_extra", "GGUFImportError", "HashMismatchError", "KNOWN_SHA256",
           "add_import_gguf_args", "run_import_gguf_cli"]
