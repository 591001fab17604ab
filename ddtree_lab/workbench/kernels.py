"""One Jupyter kernel per study: papermill executes every notebook of a study in the same kernel.

Starting a kernel and importing torch and the engine costs seconds per notebook on a small CPU, more
than a quickstart run spends generating. So the kernel is started once (lazily, at the first notebook)
and kept; before each notebook the user namespace is reset (`%reset -f`), the execution counter set
back to 1 and the working directory changed to that notebook's run directory, so one notebook cannot
see another's variables while imported modules stay loaded (that is the saving). A kernel that died,
timed out or was interrupted is shut down and the next notebook starts a fresh one. After a Ctrl-C,
`after_interrupt` shuts every kernel down without a word.

The kernel talks over IPC sockets (local files) rather than TCP, so it neither opens a port nor warns
about unencrypted TCP traffic.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import tempfile
from pathlib import Path

from jupyter_core.utils import run_sync
from papermill.clientwrap import PapermillNotebookClient
from papermill.engines import NBClientEngine, papermill_engines
from papermill.utils import merge_kwargs, remove_args

ENGINE = "ddtree_shared_kernel"

PRELUDE = """\
get_ipython().run_line_magic("reset", "-f")
get_ipython().execution_count = 1
__import__("os").chdir({cwd!r})
"""


class KernelPreludeError(RuntimeError):
    """The reset / chdir before a notebook failed: the shared kernel is not usable."""


class SharedKernel:
    """A started kernel manager reused across notebooks, restarted when it is no longer usable."""

    def __init__(self, kernel_name: str = "python3"):
        self.kernel_name = kernel_name
        self.km = None
        self.env: dict | None = None
        self.starts = 0  # how many kernels this object has started (tests read it)
        self._ipc_dir: str | None = None

    def manager(self, env: dict):
        """The running kernel manager for `env`, starting one if there is none (or `env` changed)."""
        if self.km is not None and (self.env != env or not run_sync(self.km.is_alive)()):
            self.shutdown()
        if self.km is None:
            # The async manager, as nbclient's own: its client never blocks the loop that notices a dead kernel.
            from jupyter_client.manager import AsyncKernelManager
            self._ipc_dir = tempfile.mkdtemp(prefix="ddtree-kernel-")
            km = AsyncKernelManager(kernel_name=self.kernel_name, transport="ipc",
                                    ip=os.path.join(self._ipc_dir, "kernel"))
            self.km, self.env = km, dict(env)  # before the start: an interrupted start is shut down too
            run_sync(km.start_kernel)(env=env, cwd=tempfile.gettempdir())
            self.starts += 1
        return self.km

    def shutdown(self) -> None:
        km, self.km, self.env = self.km, None, None
        if km is None:
            return
        try:
            if run_sync(km.is_alive)():
                run_sync(km.shutdown_kernel)(now=True)
        except Exception:  # noqa: BLE001 - a kernel that is already gone is what we want
            pass
        finally:
            try:
                run_sync(km.cleanup_resources)()
            except Exception:  # noqa: BLE001
                pass
            if self._ipc_dir:
                for f in Path(self._ipc_dir).glob("*"):
                    f.unlink(missing_ok=True)
                Path(self._ipc_dir).rmdir() if Path(self._ipc_dir).is_dir() else None


_SHARED: dict[str, SharedKernel] = {}


def shared_kernel(kernel_name: str = "python3") -> SharedKernel:
    if kernel_name not in _SHARED:
        _SHARED[kernel_name] = SharedKernel(kernel_name)
    return _SHARED[kernel_name]


@atexit.register
def _shutdown_all() -> None:
    for k in _SHARED.values():
        k.shutdown()


@contextlib.contextmanager
def after_interrupt():
    """Shut every shared kernel down after a Ctrl-C, quietly, then run the body: a further Ctrl-C is ignored
    meanwhile, and asyncio's logger stays silent for the rest of the process, since the interrupted
    notebook's pending tasks, collected later, would each report the kernel's death with a traceback.
    Main thread only (signal handlers can be set there alone)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("asyncio").disabled = True
    try:
        _shutdown_all()
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _PreludeClient(PapermillNotebookClient):
    """Runs the reset / chdir prelude, silently and outside the notebook, before the first cell."""

    def __init__(self, nb_man, prelude: str, **kw):
        super().__init__(nb_man, **kw)
        self._prelude = prelude

    def papermill_execute_cells(self):
        msg_id = self.kc.execute(self._prelude, silent=True, store_history=False)
        reply = self.wait_for_reply(msg_id)
        if reply is None or reply["content"].get("status") != "ok":
            content = (reply or {}).get("content", {})
            raise KernelPreludeError(f"kernel reset before the notebook failed: "
                                     f"{content.get('ename')}: {content.get('evalue')}")
        super().papermill_execute_cells()


class SharedKernelEngine(NBClientEngine):
    """papermill engine: like the default one, on a kernel manager it is given and does not own."""

    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, log_output=False, stdout_file=None,
                                 stderr_file=None, start_timeout=60, execution_timeout=None, **kwargs):
        km, cwd = kwargs.pop("km"), kwargs.pop("kernel_cwd")
        kwargs = remove_args(["input_path", "timeout", "startup_timeout"], **kwargs)
        final = merge_kwargs(kwargs, timeout=execution_timeout, startup_timeout=start_timeout,
                             kernel_name=kernel_name, log_output=log_output, stdout_file=stdout_file,
                             stderr_file=stderr_file)
        from papermill.log import logger
        client = _PreludeClient(nb_man, PRELUDE.format(cwd=str(cwd)), km=km, log=logger, **final)
        try:
            return client.execute()
        finally:
            if getattr(client, "kc", None) is not None:
                client.kc.stop_channels()


papermill_engines.register(ENGINE, SharedKernelEngine)
