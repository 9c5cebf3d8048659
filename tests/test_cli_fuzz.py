"""Generated input for `gradmesh train` (issue 25, item 8): every flag of its parser, every config
key through --set and a TOML file. Whatever the input, the command exits 0 or 2, never with a
traceback, and a refusal (2) leaves the folder it ran in as it was.

In-process and stopped at the launch (`train._launch`): everything a user can get wrong is checked
before it, and one example costs milliseconds, not a Python start-up. The flags and keys are read
from the parser and the config's dataclasses, so a new one is fuzzed without a change here."""

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import tempfile
from itertools import count
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradmesh.cli
from gradmesh.cli import auto
from gradmesh import config as configuration
from gradmesh.cli import train as train_command
from test_cli_errors import snapshot

# The same examples on every run (derandomize); FUZZ_N=2000 explores afresh, with more of them.
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_N", 150)), deadline=None, derandomize=not os.environ.get("FUZZ_N"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# Values that broke something once, or sit on an edge: other scripts' digits, int()'s 4300-digit
# limit, NaN and infinity, a NUL, a folder level past 255 bytes, and every syntax a flag takes.
EDGES = ["0", "1", "2", "3", "-1", "16", "1.5", "nan", "inf", "-inf", "1e309", str(2**63), "9" * 5000, "\u00b2",
         "\u0661\u0662", "\u0663:\u0664", "", " ", "\0", "x" * 300, "auto", "none", "1:2", "5:3", "a=b",
         "dp=2,tp=1", "dp=\u00b2", "fsdp=2", "pp=2,dp=1", "kill:rank=0,step=1", "slow:rank=1,factor=2", "chaos:faults=2,seed=1",
         "static:1,1", "static:0,1", "ssp:2", "ssp:\u00b2", "async", "powersgd:rank=2", "topk:ratio=0.5",
         "fp16", "h.1", "127.0.0.1:29400", "h:0", "is_host=true", "lo"]
TEXT = st.one_of(st.sampled_from(EDGES), st.text(max_size=30), st.integers(-2**70, 2**70).map(str),
                 st.floats().map(repr))
# Paths stay inside the test's folder: a fresh run is let through to its (patched-out) launch, and
# `--data /` would read the whole file system in a real run too.
PATHS = st.one_of(st.sampled_from(["small.txt", "nope", "empty.txt", "fifo", "folder", "x" * 300, "a\0b", ""]),
                  st.text(max_size=30)).map(lambda text: "/".join(p for p in text.split("/") if p not in ("", "..")))


def _train_actions() -> list[argparse.Action]:
    parser = gradmesh.cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in commands.choices["train"]._actions if a.option_strings and a.dest != "help"]


ACTIONS = _train_actions()
PATH_FLAGS = {"data", "config", "run_dir"}


def _flag(action: argparse.Action):
    name = action.option_strings[-1]
    if action.nargs == 0:
        return st.just([name])
    values = PATHS if action.dest in PATH_FLAGS else TEXT
    if action.choices:
        values = st.one_of(st.sampled_from(list(action.choices)), values)
    return values.map(lambda value: [name, value])


@pytest.fixture(scope="module")
def folder():
    """The folder every example runs in (cwd), with inputs the paths may name."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "small.txt").write_text("def f(x):\n    return x + 1\n" * 400)
        (root / "empty.txt").write_text("")
        (root / "folder").mkdir()
        os.mkfifo(root / "fifo")
        yield root


class _NoWorkers:
    def __init__(self, args, *rest, **kwargs):
        raise AssertionError(f"a process was started: {args}")


runs = count()


def _call(folder: Path, argv: list[str]) -> tuple[int, str]:
    """`gradmesh <argv>` in this process, in `folder`, stopped where workers would start."""
    err = io.StringIO()
    cwd = os.getcwd()
    patches = contextlib.ExitStack()
    try:
        os.chdir(folder)
        patches.enter_context(_patched(subprocess, "Popen", _NoWorkers))
        patches.enter_context(_patched(train_command, "_launch", lambda cfg, nproc, run_dir, prediction=None: 0))
        # --strategy auto plans (real processes calibrate) once the input is checked: stopped there
        # too, as the first strategy; tests/test_plan_runs.py runs the planning for real.
        patches.enter_context(_patched(auto, "choose", lambda cfg, nproc, device: (auto.placeholder(cfg), None)))
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = gradmesh.cli.main(argv)
            except SystemExit as exit_:  # argparse's --help
                code = exit_.code
    finally:
        patches.close()
        os.chdir(cwd)
    return code, err.getvalue()


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def check(folder: Path, args: list[str], data: list[str] = ["--data", "small.txt"]) -> None:
    run_dir = folder / "runs" / str(next(runs))
    argv = ["train", "--run-dir", str(run_dir.relative_to(folder)), *data, *args]
    before = snapshot(folder)
    code, stderr = _call(folder, argv)
    assert code in (0, 2), (argv, code, stderr)
    assert "Traceback" not in stderr, (argv, stderr)
    if code == 2:
        assert stderr.count("\n") >= 1 and stderr.strip().splitlines()[-1].startswith("gradmesh: error: "), (argv, stderr)
        assert snapshot(folder) == before, argv
    shutil.rmtree(run_dir, ignore_errors=True)  # the folder stays small: it is listed twice per example


@FUZZ
@given(data=st.data())
def test_every_train_flag_takes_any_value(folder, data):
    """A few flags at a time, each with a generated value (the later of a repeated flag wins)."""
    chosen = data.draw(st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=3))
    args = [part for action in chosen for part in data.draw(_flag(action))]
    check(folder, args)


def _value(kind: type):
    typed = {int: st.integers(-2**64, 2**64), float: st.floats(), bool: st.booleans(), str: TEXT}[kind]
    return st.one_of(typed.map(str), TEXT)


SET_KEYS = [(section, name, kind) for section in configuration.SECTIONS
            for name, kind in configuration.section_fields(section).items()]


@FUZZ
@given(data=st.data())
def test_every_set_key_takes_any_value(folder, data):
    chosen = data.draw(st.lists(st.sampled_from(SET_KEYS), min_size=1, max_size=3))
    args = [part for section, name, kind in chosen for part in ("--set", f"{section}.{name}={data.draw(_value(kind))}")]
    check(folder, args)


TOML_VALUES = st.recursive(st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(), st.booleans(), TEXT),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=2),
                           max_leaves=4)


@FUZZ
@given(data=st.data())
def test_any_toml_config_is_accepted_or_refused_in_one_line(folder, data):
    """Known keys with values of any TOML type, and now and then a section or key of its own."""
    layer: dict = {}
    for section, name, _ in data.draw(st.lists(st.sampled_from(SET_KEYS), min_size=1, max_size=4)):
        layer.setdefault(section, {})[name] = data.draw(TOML_VALUES)
    layer.update(data.draw(st.dictionaries(st.text(max_size=8), TOML_VALUES, max_size=1)))
    if isinstance(layer.get("data", {}), dict):
        layer.setdefault("data", {}).setdefault("path", "small.txt")  # the stdlib corpus takes longer to check
    path = folder / f"config-{next(runs)}.toml"
    path.write_text(tomli_w.dumps(layer))
    check(folder, ["--config", path.name], data=[])



@pytest.mark.slow  # fast-tier budget: the hypothesis tests above draw from the same flags
def test_every_train_flag_takes_every_edge_value(folder):
    """Each flag with each of EDGES (paths flags with PATHS' edges): the cases a random draw is
    unlikely to pair with the one flag they break."""
    for action in ACTIONS:
        values = [None] if action.nargs == 0 else EDGES + list(action.choices or [])
        for value in values:
            check(folder, [action.option_strings[-1]] + ([] if value is None else [value]))
