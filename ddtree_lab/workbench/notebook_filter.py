"""The notebooks' git filter: nbstripout's stripping (outputs, execution counts, cell ids, widget state, cell
timings) plus the metadata a kernel rewrites on every save, so a notebook run and saved in JupyterLab leaves
the repository clean: `language_info` (the kernel's Python version) is dropped and the kernelspec set to the
one every notebook names. nbstripout alone keeps both, and its only setting for extra keys is per clone.
`.gitattributes` names the filter; once per clone, in the checkout,

    python ddtree_lab/workbench/notebook_filter.py --install

makes git run this file for it. The filter keeps the name `nbstripout`, which `nbstripout --install` also
writes into .git/info/attributes (read before .gitattributes), so a clone set up that way gets this filter
too. Git runs the file by path for every saved notebook: `python -m` would import the package, and torch.
"""
import subprocess
import sys
import warnings
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # run by path: this folder's modules (profile.py, ...) must not shadow others of their names

KERNEL = "python3"  # the kernel every notebook names and a study runs them in
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": KERNEL}  # as ipykernel's
STRIPPED_KEYS = ("metadata.language_info", "metadata.signature", "metadata.widgets", "cell.metadata.collapsed",
                 "cell.metadata.ExecuteTime", "cell.metadata.execution", "cell.metadata.heading_collapsed",
                 "cell.metadata.hidden", "cell.metadata.scrolled")
FILTER = "nbstripout"  # the filter .gitattributes names


def strip(text: str) -> str:
    """A notebook's JSON as it is committed."""
    import nbformat
    from nbstripout import strip_output

    with warnings.catch_warnings():  # nbformat's notes on a notebook's schema would land in git's output
        warnings.simplefilter("ignore", UserWarning)
        nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
        nb = strip_output(nb, keep_output=False, keep_count=False, keep_id=False, extra_keys=list(STRIPPED_KEYS))
        nb.metadata["kernelspec"] = dict(KERNELSPEC)
        return nbformat.writes(nb) + "\n"


def install() -> None:
    """Point this clone's filter (and the notebooks' diff) at this file; run in the checkout."""
    command = f'"{Path(sys.executable).as_posix()}" "{Path(__file__).resolve().as_posix()}"'
    for key, value in ((f"filter.{FILTER}.clean", command), (f"filter.{FILTER}.smudge", "cat"),
                       (f"filter.{FILTER}.required", "true"), ("diff.ipynb.textconv", command)):
        subprocess.run(["git", "config", "--local", key, value], check=True, capture_output=True)


def main(argv: list[str]) -> int:
    """`--install`; a path: print it stripped (git's textconv); nothing: stdin to stdout (git's clean)."""
    try:
        if argv == ["--install"]:
            install()
            return 0
        if len(argv) > 1 or (argv and argv[0].startswith("-")):
            print("usage: notebook_filter.py [--install | NOTEBOOK]", file=sys.stderr)
            return 2
        text = Path(argv[0]).read_text(encoding="utf-8") if argv else sys.stdin.buffer.read().decode("utf-8")
        sys.stdout.buffer.write(strip(text).encode("utf-8"))
        return 0
    except ImportError as e:
        print(f"notebook_filter: needs {e.name}: pip install -e '.[lab]'", file=sys.stderr)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"notebook_filter: {'git config failed: not a git checkout?' if argv == ['--install'] else e}",
              file=sys.stderr)
    except ValueError as e:  # not JSON, or not a notebook (nbformat's errors are ValueErrors)
        print(f"notebook_filter: {argv[0] if argv else 'stdin'} is not a notebook: {str(e)[:200]}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
