"""The docs' references hold.

- Every file in docs/bench is cited by name in docs/*.md or README.md, or read by code (its name, or a
  `docs/bench/<glob>` that matches it, written in a file under ddtree_lab/, kernels/, tools/ or tests/).
- Every docs/bench/... path the docs cite exists.
- Every repository path the docs name (`docs/…`, `ddtree_lab/…`, `kernels/…`, `tools/…`, `tests/…`, `params/…`,
  `notebooks/…`; a glob must match something) and every relative Markdown link exists.
- A section cited as `docs/X.md`, "Heading" is a heading of X.
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "docs" / "bench"
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
CODE_DIRS = ("ddtree_lab", "kernels", "tools", "tests")
CODE_SUFFIXES = {".py", ".json", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".md"}
TOP = ("docs", "ddtree_lab", "kernels", "tools", "tests", "params", "notebooks")
# A repository path: a top-level folder and what follows, not the tail of a longer path, a module name
# (ddtree_lab.kernels) or a git object (`git show REV:docs/bench/x.json`, history, not the working tree).
PATH = re.compile(r"(?<![\w./:~$-])((?:%s)/[\w./*{},+-]*[\w*}])" % "|".join(TOP))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SECTION = re.compile(r"`?(docs/[\w.-]+\.md)`?,\s*\"([^\"]+)\"")


def doc_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def expand(path: str) -> list[str]:
    """`a_{x,y}_{1,2}.json` -> the four names (shell brace expansion, one level per group)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in expand(path[:m.start()] + alt + path[m.end():])]


def cited_paths() -> list[tuple[str, str]]:
    """(doc name, path) for every repository path named in the docs, braces expanded."""
    out = []
    for doc in DOCS:
        for m in PATH.finditer(doc_text(doc)):
            out += [(doc.name, p) for p in expand(m.group(1).rstrip("."))]
    return out


def exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return any(True for _ in REPO.glob(path))
    return (REPO / path).exists()


def code_files():
    this = Path(__file__).resolve()
    for d in CODE_DIRS:
        for p in sorted((REPO / d).rglob("*")):
            if p.is_file() and p.suffix in CODE_SUFFIXES and p.resolve() != this and "__pycache__" not in p.parts:
                yield p


def test_every_bench_file_is_cited_or_read_by_code():
    docs = "\n".join(doc_text(d) for d in DOCS)
    code = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in code_files())
    globs = re.findall(r"docs/bench/([\w.*?\[\]-]+)", code)
    uncited = [f.name for f in sorted(BENCH.iterdir())
               if f.is_file() and f.name not in docs and f.name not in code
               and not any(fnmatch.fnmatchcase(f.name, g) for g in globs)]
    assert not uncited, (f"docs/bench files no doc cites and no code reads: {uncited}; cite each in docs/*.md "
                         "with the command that regenerates it, or `git rm` it")


def test_every_cited_bench_file_exists():
    missing = sorted({(doc, p) for doc, p in cited_paths() if p.startswith("docs/bench/") and not exists(p)})
    assert not missing, f"docs cite docs/bench files that are not there: {missing}"


def test_every_repository_path_in_the_docs_exists():
    missing = sorted({(doc, p) for doc, p in cited_paths() if not exists(p)})
    assert not missing, f"docs name repository paths that are not there: {missing}"


def test_every_relative_link_exists():
    missing = []
    for doc in DOCS:
        for target in LINK.findall(doc_text(doc)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, mailto: or an anchor in the same page
            path = target.split("#")[0].split("?")[0]
            if path and not (doc.parent / path).exists():
                missing.append((doc.name, target))
    assert not missing, f"relative links to files that are not there: {missing}"


def test_every_cited_section_is_a_heading():
    missing = []
    for doc in DOCS:
        for path, title in SECTION.findall(doc_text(doc)):
            target = REPO / path
            headings = [re.sub(r"^#+\s*", "", line) for line in doc_text(target).splitlines()
                        if line.startswith("#")] if target.exists() else []
            if not any(h.startswith(title) for h in headings):
                missing.append((doc.name, path, title))
    assert not missing, f"sections cited as `docs/X.md`, \"Heading\" that X has no heading for: {missing}"


@pytest.mark.parametrize("path", ["docs/bench/a_{x,y}_{1,2}.json"])
def test_brace_expansion(path):
    assert expand(path) == ["docs/bench/a_x_1.json", "docs/bench/a_x_2.json",
                            "docs/bench/a_y_1.json", "docs/bench/a_y_2.json"]
