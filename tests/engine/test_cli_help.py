"""Every `ddtree-lab` subcommand's --help documents each option with its default; `--version` answers."""
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


def _all_parsers(parser, path=("ddtree-lab",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _all_parsers(child, path + (name,))


def test_every_subcommand_option_has_help_and_its_default_shown():
    seen = 0
    for path, parser in _all_parsers(cli.build_parser()):
        text = " ".join(parser.format_help().split())
        for a in parser._actions:
            if not a.option_strings or a.dest in ("help", "version"):
                continue
            seen += 1
            assert a.help, (path, a.dest)
            if a.nargs == 0 or a.default in (None, argparse.SUPPRESS) or "default" in a.help:
                continue  # a switch, no default, or a help that says it in words
            assert f"(default: {a.default})" in text, (path, a.dest)
    assert seen > 60  # every subcommand was walked, not just generate


def test_a_bad_argument_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "e2e", "--budgets", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--budgets" in err[0] and "0" in err[0]
