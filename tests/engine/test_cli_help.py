"""`ddtree-lab generate --help` documents every option with its default; `--version` answers."""
import argparse

import pytest

from ddtree_lab import cli


def _generate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


def test_every_generate_option_has_help_and_shows_its_default():
    p = _generate_parser()
    options = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert {"method", "budget", "topk", "max_new_tokens", "temperature", "seed", "pair", "device"} <= \
        {a.dest for a in options}
    assert all(a.help for a in options), [a.dest for a in options if not a.help]
    text = " ".join(p.format_help().split())  # the help wraps lines
    assert "(default: 64)" in text and "(default: ddtree)" in text and "(default: 96)" in text
    assert "tok/s = new tokens" in text  # what its tokens/s includes


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("ddtree-lab ") and len(out.split()) >= 2
