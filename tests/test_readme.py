"""The README's commands: each parses as written, and its `[GPU]` mark says the truth (the unmarked ones run
on the CPU, the marked ones ask for a CUDA device)."""
import re
import shlex
from pathlib import Path

import yaml

from ddtree_lab import cli

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[tuple[str, list[str], bool]]:
    """(line, ddtree-lab's arguments, marked [GPU]) for every ddtree-lab command in the README's code blocks."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command, _, comment = line.partition("#")
            words = shlex.split(command)
            for i, w in enumerate(words):  # `ddtree-lab ...`, `... && ddtree-lab ...`, `... -m ddtree_lab.cli ...`
                if w == "ddtree-lab" or (w == "ddtree_lab.cli" and words[i - 1] == "-m"):
                    out.append((line, words[i + 1:], "[GPU]" in comment))
    return out


def wants_cuda(args) -> bool:
    if args.command == "study":
        return str(yaml.safe_load((ROOT / args.params).read_text())["models"].get("device", "cpu")).startswith("cuda")
    if args.command == "bench" and args.bench in ("kernels", "mla"):
        return True  # it times the CUDA kernels themselves: no --device
    return str(getattr(args, "device", "cpu")).startswith("cuda")


def test_every_readme_command_parses_and_is_marked_by_where_it_runs():
    commands = readme_commands()
    assert len(commands) >= 15 and any(a[:1] == ["study"] for _, a, _ in commands)
    for line, words, gpu in commands:
        args = cli.build_parser().parse_args(words)
        assert wants_cuda(args) == gpu, f"README: {line.strip()!r} is {'not ' * (not gpu)}marked [GPU]"
