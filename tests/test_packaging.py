"""The declared dependency ranges and constraints.txt agree: every library the package or an extra declares
is pinned there, inside its range, so the README's commands install what the suite passed with. And a source
checkout imports as an install does (kernels/ as ddtree_lab.kernels)."""
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return [r for r in reqs if canonical(r.name) != canonical(project["name"])]  # an extra naming others


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[canonical(name)] = Version(version.strip())
    return out


def test_every_declared_library_is_pinned_inside_its_range():
    pinned = pins()
    for req in declared():
        assert canonical(req.name) in pinned, f"{req.name} is declared but not in constraints.txt"
        assert pinned[canonical(req.name)] in req.specifier, f"constraints.txt pins {req.name} outside {req}"


def test_every_range_has_a_floor_and_a_ceiling():
    for req in declared():
        ops = {s.operator for s in req.specifier}
        assert ops & {">=", "=="} and ops & {"<", "=="}, f"{req} is not bounded on both sides"


def test_a_checkout_that_is_not_installed_imports_its_kernels_as_ddtree_lab_kernels(tmp_path):
    # a copy of the layout, run from its root: the copy's kernels/ must answer, not an installed package's
    for rel in ("pyproject.toml", "ddtree_lab/__init__.py", "ddtree_lab/names.py", "kernels/__init__.py",
                "kernels/tree_walk.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    code = "import ddtree_lab, ddtree_lab.kernels.tree_walk as m; print(m.__file__); print(ddtree_lab.kernels.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    path, name = out.stdout.split()
    assert Path(path) == tmp_path / "kernels" / "tree_walk.py"
    assert name == "ddtree_lab.kernels"
