"""Prompt sets for the lab pair, drawn from held-out corpus files only.

Two kinds, each a jsonl of {"id", "prompt", "source"} ("source" = "relpath:line" of the cut):
  code       a file's text cut at a line boundary inside a function body: continue the code.
  docstring  a function's signature and docstring: write the body.
Choices are seeded and spread over files (a few per file) so one odd file cannot dominate.
A prompt ends at the end of a line, without its newline: byte-level BPE makes a newline and the next
line's indentation one token, so a prompt ending in a bare newline tells the model the next line is
unindented (it would close the function and start a new class).
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
from pathlib import Path

from .corpus import CorpusConfig, heldout_texts

PROMPT_SETS = ("code", "docstring")


def _order(files):
    # Files in hash order: deterministic, yet not alphabetical (no clustering by package).
    return sorted(files, key=lambda rt: hashlib.sha256(rt[0].encode()).hexdigest())


def code_prompts(files, tok, n: int, max_tokens: int = 192, min_tokens: int = 64,
                 per_file: int = 2, seed: int = 0) -> list[dict]:
    """Cut at a line boundary inside a function body; the prompt is the preceding lines that fit."""
    rng = random.Random(seed)
    out = []
    for rel, text in _order(files):
        lines = text.splitlines(keepends=True)
        tree = ast.parse(text)
        cuts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) >= 3:
                # A cut before the 2nd..last statement: there is something to write next.
                for stmt in node.body[1:]:
                    if lines[stmt.lineno - 1].strip():
                        cuts.append(stmt.lineno - 1)
        rng.shuffle(cuts)
        taken = 0
        for cut in cuts:
            if taken >= per_file:
                break
            # Grow the prompt upwards line by line while it fits the token budget.
            start, ntok = cut, 0
            while start > 0:
                t = len(tok.encode("".join(lines[start - 1:cut]), add_special_tokens=False).ids)
                if t > max_tokens:
                    break
                start, ntok = start - 1, t
            if ntok < min_tokens:
                continue
            prompt = "".join(lines[start:cut]).rstrip("\n")
            out.append({"id": f"code-{len(out):02d}", "prompt": prompt, "source": f"{rel}:{cut + 1}"})
            taken += 1
            if len(out) >= n:
                return out
    return out


def docstring_prompts(files, tok, n: int, max_tokens: int = 192, min_body_lines: int = 3,
                      per_file: int = 2, seed: int = 0) -> list[dict]:
    """A function's lines from `def` through the end of its docstring; the body is left to write."""
    rng = random.Random(seed + 1)
    out = []
    for rel, text in _order(files):
        lines = text.splitlines(keepends=True)
        cands = []
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
                continue
            doc = node.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                continue
            body_lines = node.end_lineno - doc.end_lineno
            if body_lines < min_body_lines:
                continue
            first = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            prompt = "".join(lines[first:doc.end_lineno]).rstrip("\n")
            if not 8 <= len(tok.encode(prompt, add_special_tokens=False).ids) <= max_tokens:
                continue
            cands.append((first, prompt))
        rng.shuffle(cands)
        for first, prompt in cands[:per_file]:
            out.append({"id": f"docstring-{len(out):02d}", "prompt": prompt, "source": f"{rel}:{first + 1}"})
            if len(out) >= n:
                return out
    return out


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def build_prompt_sets(cfg: CorpusConfig, tok, out_dir: str | Path, n: int = 32, seed: int = 0,
                      min_tokens: int = 64, log=print) -> dict[str, list[dict]]:
    files = heldout_texts(cfg)
    make = {"code": lambda: code_prompts(files, tok, n, min_tokens=min_tokens, seed=seed),
            "docstring": lambda: docstring_prompts(files, tok, n, seed=seed)}
    sets = {name: make[name]() for name in PROMPT_SETS}
    for name, rows in sets.items():
        write_jsonl(rows, Path(out_dir) / f"{name}.jsonl")
        log(f"prompts: {len(rows)} {name} prompts from {len({r['source'].split(':')[0] for r in rows})} held-out files")
    return sets
