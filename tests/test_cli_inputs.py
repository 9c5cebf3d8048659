"""The remaining unsafe inputs (issue 25, item 8), in the catalogue's pattern (test_cli_errors.py):
one line naming the problem and what is accepted, exit code 2, nothing created on disk.

Path names no file system takes, other scripts' digits where int() refuses them, an unusable
OMP_NUM_THREADS, sizes that would hang the pre-launch checks or the run, and run files that are
no regular files (a link to /dev/zero reads forever) or carry values of the wrong types."""

import json
import os

import pytest

from test_cli_errors import assert_usage_error, files, snapshot  # noqa: F401 (files: a fixture)

LONG_NAME = "x" * 300  # one folder level past the file system's 255 bytes

CASES = {
    "run dir name past 255 bytes": (["--run-dir", "{tmp}/" + LONG_NAME], ["run.dir", "300 bytes", "at most 255"]),
    "run dir path past 4095 bytes": (["--run-dir", "{tmp}/" + "/".join(["y" * 200] * 21)], ["run.dir", "at most 4095"]),
    "NUL in --data": (["--data", "a\0b"], ["data.path", "NUL"]),
    "NUL in a TOML data.path": (["--config", "{tmp}/nul-data.toml"], ["data.path", "NUL"]),
    "NUL in a TOML run.dir": (["--config", "{tmp}/nul-run.toml", "--run-dir", None], ["run.dir", "NUL"]),
    "data name past 255 bytes": (["--data", "{tmp}/" + LONG_NAME], ["data.path", "at most 255"]),
    "config name past 255 bytes": (["--config", "{tmp}/" + LONG_NAME], ["config file", "at most 255"]),
    "superscript digits in --mesh": (["--nproc", "2", "--mesh", "dp=\u00b2,tp=1"], ["--mesh 'dp=\u00b2,tp=1'", "AXIS=N"]),
    "a mesh size past int()'s 4300 digits": (["--mesh", "dp=" + "9" * 5000], ["--mesh", "AXIS=N"]),
    "superscript digits in --ps-mode": (["--strategy", "ps", "--nproc", "3", "--ps-mode", "ssp:\u00b2"], ["ssp:K"]),
    "a trace step past int()'s digits": (["--trace-steps", "1:" + "9" * 5000], ["--trace-steps", "A:B"]),
    "ps shares past 64": (["--strategy", "ps", "--nproc", "3", "--ps-mode", "async", "--ps-shares", "2000"],
                          ["ps.shares", "1..64", "2000"]),
    "ps shares of less than a sample": (["--strategy", "ps", "--nproc", "3", "--ps-mode", "async", "--ps-shares", "40"],
                                        ["--ps-shares 40", "16 samples", "1..16"]),
    "100,000 transformer blocks": (["--set", "model.n_layer=100000"], ["model.n_layer", "at most 1,024", "100,000"]),
    "a million embedding tables": (["--model", "recsys", "--set", "model.tables=1000000", "--set", "model.rows=2000000"],
                                   ["model.tables", "at most 1,024"]),
    "a width past 64-bit counts": (["--set", "model.n_embd=4294967296", "--set", "model.n_head=1"],
                                   ["model.n_embd", "at most 1,048,576"]),
    "a corpus past memory": (["--data", "{tmp}/small.txt", "--set", "data.max_chars=1000000000"],
                             ["data.max_chars", "at most 100,000,000"]),
}
OMP = {
    "superscript digits": "\u00b2",
    "a word": "four",
    "zero": "0",
    "a past-int() number": "9" * 5000,
}


@pytest.fixture
def inputs(files):
    (files / "nul-data.toml").write_text('[data]\npath = "a\\u0000b"\n')
    (files / "nul-run.toml").write_text('[run]\ndir = "a\\u0000b"\n')
    return files


def train_args(name, tmp):
    args, words = CASES[name]
    if None in args:  # the run dir comes from the config file
        args = [a for a in args if a not in ("--run-dir", None)]
    elif "--run-dir" not in args:
        args = [*args, "--run-dir", "{tmp}/run"]
    if not {"--data", "--model", "--config"} & set(args):
        args = [*args, "--data", "{tmp}/small.txt"]  # gpt-char checks in milliseconds
    return ["train", *[a.replace("{tmp}", str(tmp)) for a in args]], words


@pytest.mark.parametrize("name", CASES)
def test_unsafe_input_is_one_clear_line_with_exit_code_2(name, inputs, cli):
    args, words = train_args(name, inputs)
    before = snapshot(inputs)
    assert_usage_error(cli(*args), *words)
    assert snapshot(inputs) == before


@pytest.mark.parametrize("value", OMP.values(), ids=OMP.keys())
def test_an_unusable_omp_num_threads_is_refused_before_launch(value, inputs, cli, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    before = snapshot(inputs)
    assert_usage_error(cli("train", "--run-dir", str(inputs / "run"), "--data", "small.txt"),
                       "OMP_NUM_THREADS=", "whole number of threads", "leave it unset")
    assert_usage_error(cli("run", "small.txt"), "OMP_NUM_THREADS=")
    assert snapshot(inputs) == before


def test_openmp_lists_of_thread_counts_take_their_first_level(monkeypatch):
    from gradmesh import env

    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")
    assert env.omp_threads() == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert env.omp_threads() is None


def _run_dir(tmp, rows):
    run = tmp / "rd"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


@pytest.mark.parametrize("name", ["alerts.jsonl", "metrics.jsonl", "summary.json", "config.toml"])
@pytest.mark.parametrize("command", ["report", "monitor"])
def test_a_run_file_linked_to_an_endless_device_is_refused(name, command, inputs, cli):
    """Read, /dev/zero never ends: refused from fstat of what was opened, before anything is written."""
    run = _run_dir(inputs, [{"step": 1, "loss": 1.0, "time": 0.0}])
    (run / name).unlink(missing_ok=True)
    os.symlink("/dev/zero", run / name)
    before = snapshot(inputs)
    assert_usage_error(cli(command, str(run), *(["--port", "1"] if command == "monitor" else [])),
                       name, "a character device", "only regular files")
    assert snapshot(inputs) == before


def test_a_fifo_as_alerts_is_refused_without_waiting(inputs, cli):
    run = _run_dir(inputs, [{"step": 1, "loss": 1.0, "time": 0.0}])
    os.mkfifo(run / "alerts.jsonl")
    assert_usage_error(cli("report", str(run)), "alerts.jsonl", "a FIFO")


def test_a_run_file_past_the_read_limit_is_refused(inputs, cli, monkeypatch):
    from gradmesh import files

    run = _run_dir(inputs, [{"step": 1, "loss": 1.0, "time": 0.0}] * 10)
    monkeypatch.setattr(files, "READ_LIMIT", 100)  # the real limit is 512 MiB
    assert_usage_error(cli("report", str(run)), "metrics.jsonl", "bytes, more than the 100")


ODD = [None, "fast", [], [1, "a"], {"a": 1}, True, 10**30, 1e308]


def test_report_of_metrics_with_odd_types_plots_what_it_can(inputs, cli):
    """Strings, nulls and lists where numbers belong (hand-edited or foreign files) are left out as
    if absent, never a traceback; rows whose step is no whole number are skipped."""
    keys = ("loss", "time", "samples_per_s", "imbalance", "breakdown", "peak_memory_bytes", "model_state_bytes",
            "staleness_max", "staleness_mean")
    rows = [{"step": 1, "loss": 2.0, "time": 0.0}]
    rows += [{"step": 2 + i, **{key: value for key in keys}} for i, value in enumerate(ODD)]
    rows += [{"step": value, "loss": 1.0} for value in ODD]
    rows.append({"step": 20, "breakdown": {"forward": ["x"], "data": None}})
    run = _run_dir(inputs, rows)
    (run / "summary.json").write_text(json.dumps({key: "odd" for key in ("wall_s", "world_size", "final_loss", "steps")}))
    (run / "alerts.jsonl").write_text("".join(json.dumps({"kind": v, "step": v, "time": v}) + "\n" for v in ODD))
    result = cli("report", str(run))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert (run / "report.html").is_file()


def test_a_lock_file_linked_to_a_device_is_refused_not_truncated(inputs, cli):
    """The lock file is written and truncated: never through a link (it had been an EINVAL traceback)."""
    run = inputs / "locked"
    run.mkdir()
    os.symlink("/dev/zero", run / ".gradmesh-lock")
    before = snapshot(inputs)
    assert_usage_error(cli("train", "--run-dir", str(run), "--data", "small.txt"), ".gradmesh-lock", "remove it")
    assert snapshot(inputs) == before


def test_a_folder_corpus_is_read_lazily_in_sorted_path_order(tmp_path):
    """Found as read (a huge folder is not listed whole first), in the order sorted(rglob) gave:
    the corpus, and so the vocabulary of a resumed run, stays what it was."""
    from gradmesh.data.corpus import load_text

    for name in ("a/sub/y", "a/x", "a-", "a0/z", "b/w", "c", ".h/q", "a/.hid"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "b" / "link").symlink_to("../c")
    (tmp_path / "b" / "dirlink").symlink_to("../a")  # links to folders are not followed
    assert load_text(str(tmp_path), 1000).split("\n") == ["a/sub/y", "a/x", "a-", "a0/z", "c", "b/w", "c"]
