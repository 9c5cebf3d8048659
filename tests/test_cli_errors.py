"""Bad input: one line naming the problem, exit code 2, no traceback, before any worker starts.

The cases call `gradmesh.cli.main` in-process (the `cli` fixture fails a test whose input
starts a process before it is refused); a few go through the real `python -m gradmesh` so the
entry point itself stays covered."""

import socket

import pytest

from catalogue import copy_run
from helpers import python_m_gradmesh as gradmesh
from runs import half_run


def assert_usage_error(result, *words):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, f"expected one line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr and lines[0].startswith("gradmesh")
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 50)
    (tmp_path / "bad.toml").write_text("[model\nn_layer = 2\n")
    (tmp_path / "readonly").mkdir()
    (tmp_path / "readonly" / "file").write_text("x")
    return tmp_path


CASES = {
    "unknown model": (["--model", "resnet"], ["resnet", "gpt-char", "mlp-digits"]),
    "unknown strategy": (["--strategy", "magic"], ["magic", "ddp"]),
    "missing data": (["--data", "{tmp}/nope.txt"], ["nope.txt", "does not exist"]),
    "empty data": (["--data", "{tmp}/empty.txt"], ["empty.txt", "no text"]),
    "non-UTF-8 data": (["--data", "{tmp}/latin1.txt"], ["latin1.txt", "not UTF-8"]),
    "batch not divisible": (["--nproc", "2", "--global-batch-size", "10", "--grad-accum", "2"], ["10", "multiple of 4"]),
    "nproc zero": (["--nproc", "0"], ["--nproc", ">= 1"]),
    "nproc not a number": (["--nproc", "many"], ["--nproc", "many"]),
    "malformed TOML": (["--config", "{tmp}/bad.toml"], ["bad.toml", "TOML"]),
    "missing TOML": (["--config", "{tmp}/none.toml"], ["none.toml", "does not exist"]),
    "unknown --set key": (["--set", "model.depth=3"], ["model.depth", "model.n_layer"]),
    "bad --set value": (["--set", "train.lr=fast"], ["train.lr", "fast"]),
    "heads not dividing width": (["--set", "model.n_head=5"], ["n_head=5", "n_embd"]),
    "unwritable run dir": (["--run-dir", "{tmp}/readonly/file/run"], ["run dir", "not writable"]),
    "resume with no checkpoint": (["--resume", "--run-dir", "{tmp}/fresh"], ["--resume", "no complete checkpoint"]),
}
# Numbers that pass a `<` check but break a run later (issue 13): refused before anything is written.
NUMBERS = {
    "NaN learning rate": (["--lr", "nan"], ["train.lr", "finite", "nan"]),
    "infinite step timeout": (["--set", "fault.step_timeout=inf"], ["fault.step_timeout", "finite"]),
    "NaN gradient clip": (["--set", "train.grad_clip=nan"], ["train.grad_clip", "finite"]),
    "NaN straggler margin": (["--set", "monitor.straggler_margin=nan"], ["monitor.straggler_margin", "finite"]),
    "NaN slow-down factor": (["--inject", "slow:rank=1,factor=nan"], ["factor=nan", "finite factor"]),
    "infinite slow-down delay": (["--inject", "slow:rank=1,delay=inf"], ["delay=inf", "delay >= 0"]),
    "negative seed": (["--seed", "-1"], ["train.seed", "2^63"]),
    "seed past 2^63": (["--seed", str(2**63)], ["train.seed", "2^63"]),
    "Arabic-Indic digits in a flag": (["--max-steps", "\u0661\u0660"], ["--max-steps", "ASCII digits only"]),
    "Arabic-Indic digits in --set": (["--set", "train.max_steps=\u0661\u0660"], ["train.max_steps", "ASCII"]),
    "Devanagari digits in an injection": (["--inject", "kill:rank=\u0967,step=3"], ["--inject", "kill:rank=R"]),
    "endpoint without a port": (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1"], ["--rdzv-endpoint", "HOST:PORT"]),
    "endpoint port out of range": (["--nnodes", "2", "--rdzv-endpoint", "h:70000"], ["70000", "1 to 65535"]),
    "empty run dir": (["--run-dir", ""], ["run.dir is empty", "--run-dir DIR"]),
}
CASES.update({name: ([a.encode().decode("unicode_escape") for a in args], words)
              for name, (args, words) in NUMBERS.items()})


def train_args(name, files):
    args, words = CASES[name]
    args = [a.replace("{tmp}", str(files)) for a in args]
    if "--run-dir" not in args:
        args += ["--run-dir", str(files / "run")]
    return ["train", *args], words


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_clear_line_with_exit_code_2(name, files, cli):
    args, words = train_args(name, files)
    assert_usage_error(cli(*args), *words)
    assert not (files / "run").exists()  # refused before the run directory is made


def test_a_prometheus_port_in_use_is_refused_before_launch(files, cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("train", "--prometheus-port", str(port), "--run-dir", str(files / "run"))
    assert_usage_error(result, f"--prometheus-port {port}", "not free")
    assert not (files / "run").exists()


def test_bad_input_through_the_real_entry_point(files):
    """`python -m gradmesh`: the exit code and the one line reach the shell."""
    args, words = train_args("unknown --set key", files)
    assert_usage_error(gradmesh(*args, timeout=60), *words)


def test_resume_into_a_model_of_another_shape_names_the_tensors(catalogue, cli, tmp_path):
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")  # TINY: n_embd=32, global batch 16
    result = cli("train", "--run-dir", str(run), "--resume", "--set", "model.n_embd=64")
    assert_usage_error(result, "does not fit", "wte.weight [94, 32] in checkpoint vs [94, 64] now")
    result = cli("train", "--run-dir", str(run), "--resume", "--global-batch-size", "12")
    assert_usage_error(result, "incompatible", "global_batch_size")


def test_run_with_a_missing_script(tmp_path, cli):
    assert_usage_error(cli("run", str(tmp_path / "nope.py")), "nope.py", "does not exist")


def test_help_reads_well():
    result = gradmesh("train", "--help", timeout=60)
    assert result.returncode == 0
    for flag in ("--nproc", "--global-batch-size", "--grad-accum", "--optimizer", "--resume",
                 "--checkpoint-every", "--set", "--config", "--rdzv-endpoint"):
        assert flag in result.stdout
