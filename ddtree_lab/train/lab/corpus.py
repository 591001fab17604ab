"""The lab pair's corpus: Python source files, a byte-level BPE tokenizer, token arrays.

The corpus is the Python standard library of the interpreter that builds it (the card names the
version), read file by file in sorted order so the file list is deterministic. Files are held
out for evaluation by a hash of their relative path, so the split does not depend on the order of
the walk or on which other files exist. Everything derived (tokenizer, token arrays, meta.json)
goes to a cache folder; the token arrays are what a GPU machine needs for training.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN]


@dataclass
class CorpusConfig:
    root: str = ""                      # folder to read; "" = this interpreter's stdlib
    exclude_dirs: tuple = ("site-packages", "pydoc_data", "encodings", "lib-dynload", "__pycache__")
    max_file_bytes: int = 256_000       # drop generated tables and giant test files
    heldout_per_mille: int = 40         # share of files held out, by path hash
    vocab_size: int = 4096
    max_files: int = 0                  # 0 = all; >0 for tiny test corpora
    tokenizer: str = ""                 # a folder holding tokenizer.json to encode with; "" = train one here


def default_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str, per_mille: int) -> bool:
    # Hash of the path alone: stable whatever else is in the tree.
    h = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16)
    return h % 1000 < per_mille


def list_files(cfg: CorpusConfig) -> list[tuple[str, str]]:
    """Sorted (relpath, text) of the usable .py files: UTF-8 that parses as Python."""
    root = Path(cfg.root or default_root())
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in cfg.exclude_dirs)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            data = path.read_bytes()
            if len(data) > cfg.max_file_bytes or not data.strip():
                continue
            try:
                text = data.decode("utf-8")
                ast.parse(text)
            except (UnicodeDecodeError, SyntaxError, ValueError):
                continue  # lib2to3 fixtures, deliberately bad test inputs
            out.append((rel, text))
    out.sort()
    if cfg.max_files:
        out = out[: cfg.max_files]
    return out


def file_list_hash(files: list[tuple[str, str]]) -> str:
    """sha256 over 'relpath sha256(content)' lines: pins the exact bytes used."""
    h = hashlib.sha256()
    for rel, text in files:
        h.update(f"{rel} {hashlib.sha256(text.encode()).hexdigest()}\n".encode())
    return h.hexdigest()


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE; the special tokens get ids 0 (EOS) and 1 (MASK)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config(model_max_length: int = 4096) -> dict:
    """tokenizer_config.json in the form transformers' fast tokenizer reads."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 4096) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN}, indent=2) + "\n")


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer
    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def encode_files(tok, texts: list[str]) -> np.ndarray:
    """One uint16 stream: file, EOS, file, EOS, ... (EOS also opens the stream)."""
    eos = tok.token_to_id(EOS_TOKEN)
    parts = [np.array([eos], np.uint16)]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, np.uint16))
        parts.append(np.array([eos], np.uint16))
    return np.concatenate(parts)


@dataclass
class CorpusMeta:
    python_version: str
    implementation: str
    root: str
    n_files: int
    n_train_files: int
    n_heldout_files: int
    file_list_sha256: str
    train_bytes: int
    heldout_bytes: int
    train_tokens: int
    heldout_tokens: int
    vocab_size: int
    eos_token_id: int
    mask_token_id: int
    heldout_files: list = field(default_factory=list)
    config: dict = field(default_factory=dict)


def build_corpus(cfg: CorpusConfig, cache_dir: str | Path, log=print) -> CorpusMeta:
    """Read, split, train the tokenizer on the training files, write arrays and meta to cache_dir."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    files = list_files(cfg)
    train = [(r, t) for r, t in files if not is_heldout(r, cfg.heldout_per_mille)]
    held = [(r, t) for r, t in files if is_heldout(r, cfg.heldout_per_mille)]
    log(f"corpus: {len(files)} files ({len(train)} train, {len(held)} held out) from {cfg.root or default_root()}")
    if cfg.tokenizer:  # another pair's tokenizer, copied byte for byte (its ids are that pair's)
        tok = load_tokenizer(cfg.tokenizer)
        (cache / "tokenizer").mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (Path(cfg.tokenizer) / name).is_file():
                shutil.copy(Path(cfg.tokenizer) / name, cache / "tokenizer" / name)
    else:
        tok = train_tokenizer([t for _, t in train], cfg.vocab_size)
        save_tokenizer(tok, cache / "tokenizer")
    train_ids = encode_files(tok, [t for _, t in train])
    held_ids = encode_files(tok, [t for _, t in held])
    np.save(cache / "train.npy", train_ids)
    np.save(cache / "heldout.npy", held_ids)
    meta = CorpusMeta(
        python_version=platform.python_version(), implementation=platform.python_implementation(),
        root=str(cfg.root or default_root()), n_files=len(files), n_train_files=len(train),
        n_heldout_files=len(held), file_list_sha256=file_list_hash(files),
        train_bytes=sum(len(t.encode()) for _, t in train), heldout_bytes=sum(len(t.encode()) for _, t in held),
        train_tokens=int(train_ids.size), heldout_tokens=int(held_ids.size),
        vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id(EOS_TOKEN),
        mask_token_id=tok.token_to_id(MASK_TOKEN), heldout_files=[r for r, _ in held], config=asdict(cfg))
    (cache / "meta.json").write_text(json.dumps(asdict(meta), indent=2) + "\n")
    (cache / "files.txt").write_text("".join(f"{'heldout' if is_heldout(r, cfg.heldout_per_mille) else 'train'} {r}\n" for r, _ in files))
    log(f"corpus: {meta.train_tokens:,} train tokens, {meta.heldout_tokens:,} held-out tokens, "
        f"vocab {meta.vocab_size}, files sha256 {meta.file_list_sha256[:16]}…")
    return meta


def load_corpus(cache_dir: str | Path):
    """(train ids, heldout ids, meta dict) from a cache written by build_corpus."""
    cache = Path(cache_dir)
    meta = json.loads((cache / "meta.json").read_text())
    return np.load(cache / "train.npy"), np.load(cache / "heldout.npy"), meta


def heldout_texts(cfg: CorpusConfig) -> list[tuple[str, str]]:
    return [(r, t) for r, t in list_files(cfg) if is_heldout(r, cfg.heldout_per_mille)]


if __name__ == "__main__":  # python -m ddtree_lab.train.lab.corpus CACHE_DIR
    build_corpus(CorpusConfig(), sys.argv[1] if len(sys.argv) > 1 else ".cache/lab_corpus")
