"""A warm start for the tests' `gradmesh ...` calls: fork a process that has imported torch once.

A run in the suite is mostly start-up: the CLI process spends a second importing torch and torch
elastic before it starts any worker, and the suite starts a hundred of them. This server imports
all that once, then forks a child per call that runs `gradmesh.cli.main(argv)` — the same code as
`python -m gradmesh`, in a fresh process with the caller's environment, working folder and
output files. The workers it launches are started by torch elastic exactly as in real use
(fresh interpreters). tests/test_cli_errors.py keeps a few calls on the real `python -m gradmesh`.

The server is single-threaded (a fork from a process with other threads could inherit a lock
held by one of them): it polls its socket and reaps its children in one loop.

Protocol, one connection per call: the client sends one JSON line {argv, cwd, env, out, err};
the server answers {"pid": N} at once and {"code": C} when the child exits.
"""

import json
import os
import select
import socket
import sys
import traceback

PRELOAD = ("torch", "torch.distributed.run", "gradmesh.cli", "gradmesh.launch", "gradmesh.workloads",
           "gradmesh.fault.checkpoint", "gradmesh.worker", "gradmesh.launch.inplace")
HF_PRELOAD = ("transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama")
"""The hf:* models' code, where transformers is installed: a launcher imports it to build the meta
model its checks read, and its forked workers inherit it, as the rest of PRELOAD."""


def _child(request: dict) -> None:
    """In the forked child: become the `gradmesh` process the caller asked for; never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["out"]), (2, request["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        sys.argv = ["gradmesh", *request["argv"]]
        sys.path[0] = os.getcwd()  # as `python -m gradmesh` has it
        import gradmesh.cli

        code = gradmesh.cli.main(request["argv"])
    except SystemExit as done:  # argparse's --help and its own errors
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _serve(listener: socket.socket) -> None:
    waiting: dict[int, socket.socket] = {}  # child pid -> its caller's connection
    parent = os.getppid()
    while os.getppid() == parent:  # the test session is gone: so is this server
        readable, _, _ = select.select([listener], [], [], 0.02)
        if readable:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                _child(request)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass  # the caller gave up (timeout) and closed its end
                conn.close()


def main(path: str) -> None:
    import importlib
    import importlib.util

    for name in PRELOAD:
        importlib.import_module(name)
    if importlib.util.find_spec("transformers") is not None:
        from gradmesh import env

        env.hub_offline()  # before huggingface_hub reads it, as gradmesh.hf has it
        for name in HF_PRELOAD:
            importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    _serve(listener)


if __name__ == "__main__":
    main(sys.argv[1])
