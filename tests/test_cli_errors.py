"""Bad input: one line naming the problem, exit code 2, no traceback, before any worker starts,
and nothing created, changed or deleted (issue 13, item 7: a catalogue of bad inputs).

The cases call `gradmesh.cli.main` in-process (the `cli` fixture fails a test whose input
starts a process before it is refused) from inside their tmp folder, which is compared before
and after; a few go through the real `python -m gradmesh` so the entry point itself stays covered."""

import os
import socket

import pytest

from catalogue import copy_run
from helpers import python_m_gradmesh as gradmesh
from runs import half_run


def assert_usage_error(result, *words):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, f"expected one line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr and lines[0].startswith("gradmesh: error: ")
    for word in words:
        assert word in lines[0], lines[0]


def snapshot(folder):
    """Every path under `folder`, with size and modification time for files."""
    return {str(path.relative_to(folder)): None if path.is_dir() else (path.lstat().st_size, path.lstat().st_mtime_ns)
            for path in folder.rglob("*")}


@pytest.fixture
def files(tmp_path, monkeypatch):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 50)
    (tmp_path / "small.txt").write_text("def f(x):\n    return x + 1\n" * 400)  # gpt-char checks in milliseconds
    (tmp_path / "bad.toml").write_text("[model\nn_layer = 2\n")
    (tmp_path / "readonly").mkdir()
    (tmp_path / "readonly" / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")  # opening it for reading would wait for a writer forever
    monkeypatch.chdir(tmp_path)  # whatever a command writes into its working folder shows in the snapshot
    return tmp_path


CASES = {
    "unknown model": (["--model", "vgg"], ["vgg", "gpt-char", "mlp-digits", "resnet"]),
    "unknown strategy": (["--strategy", "magic"], ["magic", "ddp"]),
    "ps without a worker": (["--strategy", "ps", "--nproc", "2", "--ps-servers", "2"], ["--ps-servers 2", "worker"]),
    "ps without a server": (["--strategy", "ps", "--nproc", "2", "--ps-servers", "0"], ["ps.servers", ">= 1"]),
    "ps servers beyond rows": (["--strategy", "ps", "--nproc", "64", "--ps-servers", "60", "--model", "mlp-digits",
                                "--global-batch-size", "32", "--set", "model.hidden=2"], ["--ps-servers 60", "at most"]),
    "ps negative bound": (["--strategy", "ps", "--nproc", "3", "--ps-mode", "ssp:-1"], ["ssp:-1", "sync, async, ssp:K"]),
    "ps malformed mode": (["--strategy", "ps", "--nproc", "3", "--ps-mode", "bounded"], ["bounded", "sync, async"]),
    "ps shares of zero": (["--strategy", "ps", "--nproc", "3", "--ps-mode", "async", "--ps-shares", "0"], ["ps.shares", ">= 1"]),
    "ps shares without ps": (["--nproc", "2", "--ps-shares", "4"], ["--ps-shares apply to --strategy ps"]),
    "ps on a mesh": (["--strategy", "ps", "--nproc", "4", "--mesh", "dp=2,tp=2"], ["ps", "--mesh"]),
    "recsys without rows": (["--model", "recsys", "--set", "model.rows=0"], ["model.rows", ">= 1"]),
    "recsys tables without a row each": (["--model", "recsys", "--set", "model.rows=4"], ["model.rows=4", "model.tables"]),
    "recsys log beyond memory": (["--model", "recsys", "--set", "model.samples=2000000000"], ["model.samples=2,000,000,000", "at most"]),
    "recsys tables beyond memory": (["--model", "recsys", "--set", "model.rows=2000000000"], ["does not fit", "model.rows"]),
    "error feedback under fsdp": (["--strategy", "fsdp", "--nproc", "2", "--compression", "powersgd:rank=2"],
                                  ["--compression powersgd:rank=2", "fsdp", "accepted with it: none, fp16, bf16"]),
    "error feedback under ps": (["--strategy", "ps", "--nproc", "3", "--compression", "powersgd:rank=2"],
                                ["--compression powersgd:rank=2", "ps", "accepted with it: none, fp16, bf16"]),
    "powersgd without a rank": (["--compression", "powersgd"], ["--compression 'powersgd'", "powersgd:rank=R"]),
    "topk ratio out of range": (["--compression", "topk:ratio=1.5"], ["--compression 'topk:ratio=1.5'", "0 < K <= 1"]),
    "unknown compression": (["--compression", "zstd"], ["--compression 'zstd'", "fp16, bf16"]),
    "malformed balance": (["--balance", "even"], ["--balance 'even'", "static:S1,S2"]),
    "static shares for the wrong number of ranks": (["--nproc", "2", "--balance", "static:1,1,1"],
                                                    ["3 shares for 2 data-parallel rank(s)", "static:1,1"]),
    "balance under ps": (["--strategy", "ps", "--nproc", "3", "--balance", "auto"], ["--balance auto", "not to ps"]),
    "memory fault without balancing": (["--nproc", "2", "--inject", "memory:rank=1,free_mb=4"],
                                       ["memory:rank=1,free_mb=4", "--balance auto or static"]),
    "memory fault without a size": (["--inject", "memory:rank=0"], ["memory needs free_mb > 0"]),
    "bucket size of zero": (["--bucket-mb", "0"], ["--bucket-mb must be a size in MiB > 0", "'auto'"]),
    "error feedback under hybrid": (["--strategy", "hybrid", "--nproc", "3", "--model", "recsys", "--compression",
                                     "topk:ratio=0.1"], ["--compression topk:ratio=0.1", "hybrid", "none, fp16, bf16"]),
    "hybrid without tables": (["--strategy", "hybrid", "--nproc", "3", "--model", "mlp-digits", "--global-batch-size", "32"],
                              ["--strategy hybrid", "mlp-digits has none", "recsys"]),
    "hybrid tables async": (["--strategy", "hybrid", "--nproc", "3", "--model", "recsys", "--ps-mode", "async",
                             "--global-batch-size", "32"], ["not async", "sync or ssp:K"]),
    "recsys tables fewer rows than servers": (["--model", "recsys", "--strategy", "ps", "--nproc", "6", "--ps-servers", "3",
                                               "--global-batch-size", "33", "--set", "model.rows=16"], ["table tables.0", "2 rows", "--ps-servers at most 2"]),
    "recsys zipf not positive": (["--model", "recsys", "--set", "model.zipf=0"], ["model.zipf", "> 0"]),
    "ps batch not divisible": (["--strategy", "ps", "--nproc", "4", "--global-batch-size", "32"], ["32", "workers", "multiple of 3"]),
    "ps options without ps": (["--ps-mode", "async"], ["--ps-mode", "--strategy ps"]),
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
    # Refused before transformers is imported: these hold without the hf extra too.
    "tp for hf:gpt2": (["--model", "hf:gpt2", "--strategy", "tp", "--nproc", "2"],
                       ["tensor parallelism has no plan for hf:gpt2", "fused Conv1D", "--model hf:llama"]),
    "pipeline for an hf model": (["--model", "hf:llama", "--strategy", "pipeline", "--nproc", "2"],
                                 ["pipeline parallelism cannot cut --model hf:llama", "ddp, zero1 or fsdp"]),
    "hf:llama with an odd head width": (["--model", "hf:llama", "--set", "model.n_embd=30", "--set", "model.n_head=2"],
                                        ["head width", "= 15", "even"]),
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
    "Arabic-Indic digits in --trace-steps": (["--trace-steps", "\u0663:\u0664"], ["--trace-steps", "A:B"]),
    "a whole number past 64 bits": (["--max-steps", str(2**64)], ["train.max_steps", "2^63"]),
    "negative SGD momentum": (["--optimizer", "sgd", "--set", "train.momentum=-0.5"], ["train.momentum", "[0, 1)"]),
    "node rank past the machines": (["--nnodes", "2", "--rdzv-endpoint", "h:29400", "--node-rank", "2"],
                                    ["--node-rank 2", "0..1"]),
    "negative node rank": (["--node-rank", "-5"], ["--node-rank -5", "0..0"]),
    "static rendezvous without node ranks": (["--nnodes", "2", "--rdzv-endpoint", "h:29400", "--rdzv-backend", "static"],
                                             ["static", "--node-rank R"]),
    "empty rendezvous id": (["--rdzv-id", ""], ["rdzv_id is empty", "--rdzv-id ID"]),
    "malformed rendezvous conf": (["--nnodes", "2", "--rdzv-endpoint", "h:29400", "--rdzv-conf", "is_host"],
                                  ["--rdzv-conf 'is_host'", "key=value"]),
    "unknown interface": (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--iface", "nosuch0"],
                          ["--iface 'nosuch0'", "accepted: ", "lo"]),
    "a trace past the last step": (["--max-steps", "10", "--trace-steps", "20:21"], ["--trace-steps 20:21", "step 10"]),
    # The meta-device model is counted, never allocated: ~3 TiB of parameters, gradients and Adam state.
    "model too big for the machine": (["--data", "{tmp}/small.txt", "--set", "model.n_layer=2", "--set", "model.n_embd=65536"],
                                      ["does not fit", "GiB", "model.n_layer", "--strategy fsdp", "--nnodes"]),
    "sharded model too big for the machine": (["--data", "{tmp}/small.txt", "--strategy", "fsdp", "--set", "model.n_layer=2",
                                               "--set", "model.n_embd=65536"], ["does not fit", "fsdp", "--nnodes"]),
}
# What would block or read forever (issue 13): refused from os.stat, before anything opens it.
SPECIAL_FILES = {
    "FIFO as --config": (["--config", "{tmp}/fifo"], ["fifo", "a FIFO", "TOML file"]),
    "device as --config": (["--config", "/dev/null"], ["/dev/null", "a character device"]),
    "folder as --config": (["--config", "{tmp}/readonly"], ["readonly", "is a folder"]),
    "FIFO as --data": (["--data", "{tmp}/fifo"], ["fifo", "a FIFO", "text file"]),
    "endless device as --data": (["--data", "/dev/zero"], ["/dev/zero", "a character device"]),
    "too little text for one sample": (["--data", "{tmp}/small.txt", "--set", "data.max_chars=1"], ["too few", "block_size"]),
    "--data with a model that reads none": (["--model", "mlp-digits", "--data", "{tmp}/small.txt"], ["data.path", "gpt-char, hf:gpt2, hf:llama only"]),
}
# A model with batch normalisation trains where every rank runs the whole model in step (ddp, zero1, fsdp).
BATCH_NORM = {
    f"resnet under {label}": (["--model", "resnet", *args], ["--model resnet", "batch normalisation", "ddp, zero1 or fsdp",
                                                             f"not {label}"])
    for label, args in {"tp": ["--strategy", "tp", "--nproc", "2"],
                        "pipeline": ["--strategy", "pipeline", "--nproc", "2"],
                        "ps": ["--strategy", "ps", "--nproc", "3"],
                        "dp=2,tp=2": ["--nproc", "4", "--mesh", "dp=2,tp=2"]}.items()
}
BATCH_NORM["resnet images too small"] = (["--model", "resnet", "--set", "model.image_size=8"],
                                         ["model.image_size", "at least 16"])
CASES.update(NUMBERS)
CASES.update(SPECIAL_FILES)
CASES.update(BATCH_NORM)
# The other commands, whole command lines.
COMMANDS = {
    "export into a FIFO": (["export", "{tmp}", "--out", "{tmp}/fifo"], ["--out", "a FIFO"]),
    "export onto a folder": (["export", "{tmp}", "--out", "{tmp}/readonly"], ["--out", "is a folder"]),
    "export of a missing run": (["export", "{tmp}/nope", "--out", "x.safetensors"], ["nope", "does not exist"]),
    "export of a folder without checkpoints": (["export", "{tmp}/readonly", "--out", "x.safetensors"], ["no complete checkpoint"]),
    "export step in Devanagari digits": (["export", "{tmp}", "--out", "x.safetensors", "--step", "\u0967"], ["--step", "ASCII"]),
    "run a FIFO": (["run", "{tmp}/fifo"], ["script", "a FIFO"]),
    "run a device": (["run", "/dev/zero"], ["script", "a character device"]),
    "run with a malformed endpoint": (["run", "--nnodes", "2", "--rdzv-endpoint", "h", "{tmp}/small.txt"], ["--rdzv-endpoint 'h'"]),
    "monitor a FIFO": (["monitor", "{tmp}/fifo"], ["run dir", "a FIFO"]),
    "monitor port 0": (["monitor", "{tmp}", "--port", "0"], ["--port", "65535"]),
    "report of a device": (["report", "/dev/null"], ["run dir", "a character device"]),
    "report of a folder without metrics": (["report", "{tmp}/readonly"], ["no metrics.jsonl"]),
    "unknown command": (["fly"], ["invalid choice", "train"]),
}


def train_args(name, files):
    args, words = CASES[name]
    args = [a.replace("{tmp}", str(files)) for a in args]
    if "--run-dir" not in args:
        args += ["--run-dir", str(files / "run")]
    return ["train", *args], words


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_clear_line_with_exit_code_2(name, files, cli):
    args, words = train_args(name, files)
    before = snapshot(files)
    assert_usage_error(cli(*args), *words)
    assert snapshot(files) == before  # refused before the run directory (or anything else) is made


@pytest.mark.parametrize("name", COMMANDS)
def test_bad_input_to_the_other_commands(name, files, cli):
    args, words = COMMANDS[name]
    before = snapshot(files)
    assert_usage_error(cli(*[a.replace("{tmp}", str(files)) for a in args]), *words)
    assert snapshot(files) == before


def test_a_prometheus_port_in_use_is_refused_before_launch(files, cli):
    before = snapshot(files)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("train", "--prometheus-port", str(port), "--run-dir", str(files / "run"), "--data", "small.txt")
    assert_usage_error(result, f"--prometheus-port {port}", "not free")
    assert snapshot(files) == before


def test_a_dashboard_port_in_use_beyond_loopback_is_one_line(files, cli):
    """The --host warning comes only once listening, so it never joins the error."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("monitor", str(files), "--host", "0.0.0.0", "--port", str(port))
    assert_usage_error(result, f"0.0.0.0:{port}")


def test_the_memory_estimate_is_per_gpu_on_cuda_and_per_machine_on_cpu(monkeypatch):
    """mlp-digits with 80,000 hidden units: 6.4e9 parameters, ~96 GiB of fp32 Adam state in all."""
    from gradmesh import config, topology, workloads
    from gradmesh.cli.memory import check_memory
    from gradmesh.errors import UsageError
    from gradmesh.parallel import registry

    cfg = config.build([{"model": {"name": "mlp-digits", "hidden": 80_000}}])
    ddp, fsdp = registry.resolve("ddp", {"dp": 8}), registry.resolve("fsdp", {"fsdp": 8})
    monkeypatch.setattr(topology, "memory_bytes", lambda device: 80 * 2**30)
    with pytest.raises(UsageError, match="each GPU has 80.0 GiB"):
        check_memory(cfg, ddp, lambda: workloads.meta_model(cfg), 8, "cuda")  # a whole replica per GPU
    check_memory(cfg, fsdp, lambda: workloads.meta_model(cfg), 8, "cuda")  # an eighth per GPU
    monkeypatch.setattr(topology, "memory_bytes", lambda device: 200 * 2**30)
    with pytest.raises(UsageError, match=r"~763\.7 GiB .* 8 rank\(s\) sharing .* this machine has 200\.0 GiB"):
        check_memory(cfg, ddp, lambda: workloads.meta_model(cfg), 8, "cpu")  # eight replicas in one RAM
    check_memory(cfg, fsdp, lambda: workloads.meta_model(cfg), 8, "cpu")  # the eight shards together


def test_bad_input_through_the_real_entry_point(files):
    """`python -m gradmesh`: the exit code and the one line reach the shell."""
    args, words = train_args("unknown --set key", files)
    assert_usage_error(gradmesh(*args, timeout=60), *words)


# Resuming a run stopped at step 10 (TINY: n_embd=32, global batch 16).
RESUME = {
    "resume into a model of another shape": (["--set", "model.n_embd=64"],
                                             ["does not fit", "wte.weight [94, 32] in checkpoint vs [94, 64] now"]),
    "resume with another batch size": (["--global-batch-size", "12"], ["incompatible", "global_batch_size"]),
    "resume below the checkpoint's step": (["--max-steps", "7"], ["step 10", "--max-steps 7", "above 10"]),
}


@pytest.fixture
def stopped_run(catalogue, tmp_path):
    return copy_run(half_run(catalogue, 1), tmp_path / "run")


@pytest.mark.parametrize("name", RESUME)
def test_bad_resume_is_refused_and_touches_nothing(name, stopped_run, cli):
    args, words = RESUME[name]
    before = snapshot(stopped_run)
    assert_usage_error(cli("train", "--run-dir", str(stopped_run), "--resume", *args), *words)
    assert snapshot(stopped_run) == before


def test_resuming_a_finished_run_has_nothing_to_do(stopped_run, cli):
    """--max-steps equal to the checkpoint's step (here from the saved config.toml): a finished run,
    so a scheduler's retry succeeds without starting a worker or touching the run."""
    before = snapshot(stopped_run)
    result = cli("train", "--run-dir", str(stopped_run), "--resume")
    assert result.returncode == 0 and result.stderr.count("\n") == 1, result.stderr
    assert "already at step 10" in result.stderr and "nothing to train" in result.stderr
    assert snapshot(stopped_run) == before


def test_run_with_a_missing_script(tmp_path, cli):
    assert_usage_error(cli("run", str(tmp_path / "nope.py")), "nope.py", "does not exist")


def test_help_reads_well():
    result = gradmesh("train", "--help", timeout=60)
    assert result.returncode == 0
    for flag in ("--nproc", "--global-batch-size", "--grad-accum", "--optimizer", "--resume",
                 "--checkpoint-every", "--set", "--config", "--rdzv-endpoint"):
        assert flag in result.stdout
