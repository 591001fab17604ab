"""The study's shared kernel: notebooks run in one kernel without seeing each other's variables, each in
its own working directory, and a kernel that dies is recorded as a failure and replaced."""
import os

import nbformat
import pytest

from ddtree_lab.workbench import kernels, runner
from ddtree_lab.workbench.runs import RunParams


def _nb(path, *cells):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)
    return path


def test_one_kernel_namespace_reset_cwd_and_dead_kernel(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first = _nb(tmp_path / "first.ipynb", "import sys\nleak = 41\nsys.modules['math'].leak_mark = 1\n"
                                          "open('here.txt', 'w').write('a')")
    second = _nb(tmp_path / "second.ipynb",
                 "import os, math\nassert 'leak' not in globals(), 'a variable leaked between notebooks'\n"
                 "assert getattr(math, 'leak_mark', 0) == 1  # modules stay imported: the point\n"
                 "open('here.txt', 'w').write(os.getcwd())")
    fresh = _nb(tmp_path / "fresh.ipynb", "import math\nassert not hasattr(math, 'leak_mark')  # a new process")
    dies = _nb(tmp_path / "dies.ipynb", "import os\nos._exit(3)")
    shared = kernels.shared_kernel(runner.KERNEL)
    p = RunParams()
    runner.execute_notebook(first, a / "first.ipynb", p, a, 120, False)
    starts = shared.starts
    runner.execute_notebook(second, b / "second.ipynb", p, b, 120, False)
    assert shared.starts == starts  # the same kernel ran both
    assert (a / "here.txt").read_text() == "a" and (b / "here.txt").read_text() == os.path.realpath(b)
    out = nbformat.read(b / "second.ipynb", as_version=4)
    counts = [c.execution_count for c in out.cells if c.cell_type == "code"]
    assert counts[0] == 1, counts  # numbered from 1 in every notebook
    with pytest.raises(Exception):
        runner.execute_notebook(dies, a / "dies.ipynb", p, a, 120, False)
    assert shared.km is None  # the dead kernel was let go
    runner.execute_notebook(fresh, b / "fresh.ipynb", p, b, 120, False)  # a fresh kernel runs the next one
    assert shared.starts == starts + 1


def test_kernel_uses_ipc_not_tcp():
    shared = kernels.shared_kernel(runner.KERNEL)
    km = shared.manager(runner._kernel_env())
    assert km.transport == "ipc"
