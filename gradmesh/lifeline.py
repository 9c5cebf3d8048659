"""No worker outlives its launcher, and a stopped job stops quietly (issue 13, item 6).

Launcher side: `Stopped` turns SIGINT/SIGTERM into an exception the launch loop handles (stop
every worker: the same signal, a grace period, then SIGKILL), and `stopped_line` is the one line
the user sees. Worker side: `tie_to_launcher` asks the kernel to SIGKILL this worker when its
launcher dies (prctl PR_SET_PDEATHSIG; a SIGKILLed launcher runs no handler that could stop its
workers, and torch elastic starts them in sessions of their own, out of reach of the terminal),
and turns the launcher's SIGINT/SIGTERM into a quiet exit instead of a KeyboardInterrupt
traceback per rank.

`python -m gradmesh.lifeline SCRIPT.py ARGS` runs a user's script tied the same way
(`gradmesh run`). Torch-free, so that wrapper costs no start-up time.
"""

import contextlib
import ctypes
import os
import runpy
import signal
import sys
import threading
import time

from gradmesh import env

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 5
"""A stopped worker's time to exit after the launcher passes the signal on, before SIGKILL."""


class Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


_armed = 0
"""How many `stop_on_signals` blocks are open (`rearm_stop_signals` acts only inside one)."""


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM raise `Stopped` inside the block (main thread only)."""
    global _armed
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    _armed += 1
    try:
        yield
    finally:
        _armed -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def rearm_stop_signals() -> None:
    """Inside a `stop_on_signals` block: take SIGINT and SIGTERM back from a library that put its
    own handlers in their place (Ray's driver does at `ray.init`: it dies on SIGTERM with a stack
    dump, leaving gradmesh no say in how the job stops). Outside one: nothing."""
    if _armed:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _raise_stopped)


class DeferredStop:
    """A SIGINT or SIGTERM kept for later (`deferred_stop`)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def record(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def check(self) -> None:
        """Raise `Stopped` for a signal that came."""
        if self.signum is not None:
            raise Stopped(self.signum)


@contextlib.contextmanager
def deferred_stop():
    """Inside a `stop_on_signals` block: SIGINT and SIGTERM are recorded, not raised, while the
    main thread waits in a library's C code (Ray's `wait` runs Python's signal check and turns
    what a handler raises into a SystemError); the caller polls `check()`. Outside one: nothing."""
    deferred = DeferredStop()
    if not _armed:
        yield deferred
        return
    previous = {sig: signal.signal(sig, deferred.record) for sig in STOP_SIGNALS}
    try:
        yield deferred
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    deferred.check()


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stopped_line(signum: int, workers: int) -> str:
    return (
        f"gradmesh: stopped by {signal.Signals(signum).name}; "
        f"{workers} worker{'s' if workers != 1 else ''} stopped, none left running"
    )


def exit_code(signum: int) -> int:
    return 128 + signum


def _quiet_exit(signum, frame):
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(exit_code(signum))


def _watch(launcher: int) -> None:
    """Where prctl is missing (not Linux): notice the launcher's death by polling."""
    while os.getppid() == launcher:
        time.sleep(0.5)
    os._exit(exit_code(signal.SIGKILL))


def die_with(parent: int) -> None:
    """SIGKILL this process when `parent`, the process that started it, dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the kernel was asked to tell us
        os._exit(exit_code(signal.SIGKILL))


def tie_to_launcher() -> None:
    """Die with the launcher; exit quietly on its SIGINT/SIGTERM. A no-op outside gradmesh's launchers."""
    launcher = env.launcher_pid()
    if launcher is None or launcher == os.getpid():  # not launched, or the launcher itself
        return
    die_with(launcher)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _quiet_exit)


def run_script(script: str, args: list[str]) -> None:
    """Run a user's script as `python SCRIPT.py ARGS` would, tied to the launcher.

    Once the script has finished (returned or called sys.exit), its atexit handlers run and the
    process leaves without the interpreter's finalisation, as `gradmesh train`'s workers do: gloo's
    threads can still hold tensors of a process group that lives on in some object, and freeing
    them while the interpreter is torn down aborts the process (SIGABRT, "terminate called without
    an active exception"; pytorch#179291) after a run that succeeded. An exception still ends the
    process the usual way, with its traceback."""
    tie_to_launcher()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else _said(done.code))
    _leave(code)


def _said(message) -> int:
    """sys.exit("text"): Python prints the text to stderr and exits 1."""
    print(message, file=sys.stderr)
    return 1


def _leave(code: int) -> None:
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run_script(sys.argv[1], sys.argv[2:])
