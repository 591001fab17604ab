"""The declared dependency ranges and constraints.txt agree: every library the package or an extra declares
is pinned there, inside its range, so the README's commands install what the suite passed with."""
import re
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
