"""`gradmesh train`'s options, grouped as `--help` shows them: what to train, how (strategy, then
optimisation), the run directory, failures, monitoring and the launch."""

import argparse

from gradmesh import config as configuration
from gradmesh.cli.auto import AUTO
from gradmesh.cli.options import add_failure_options, add_launch_options, bucket_type, integer, number
from gradmesh.config.compression import help_text as compression_help
from gradmesh.parallel import registry


def add_parser(subparsers) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a built-in model on N workers",
        description="Train a built-in workload on N workers: data parallel, sharded, "
        "tensor or pipeline parallel, composed on a mesh, or with parameter servers.",
    )
    add_train_options(train)
    add_launch_options(train)


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """Every option of `gradmesh train` but the launch's (`gradmesh ray` places the workers itself)."""
    add_job_options(parser)
    run = _add_run_options(parser)
    add_failure_options(parser)
    _add_monitoring_options(parser)
    # Added after the monitoring options so that the usage line lists it where it always has.
    run.add_argument("--quiet", action="store_true", default=None, help="no progress bar or summary table")


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """What to train and how: the options `gradmesh plan` shares with `gradmesh train`."""
    _add_what_options(parser)
    how = _add_how_options(parser)
    _add_optimisation_options(parser, how)


def _add_what_options(train: argparse.ArgumentParser) -> None:
    what = train.add_argument_group("what to train")
    what.add_argument(
        "--model",
        choices=configuration.MODELS,
        help="built-in model (default gpt-char): gpt-char, a character-level GPT on Python's own source; "
        "mlp-digits, an MLP on scikit-learn's 8x8 digits; recsys, a DLRM-style click model on a synthetic "
        "click log; resnet, torchvision's ResNet-18 on generated images of coloured shapes (ddp, zero1 or fsdp; "
        "--set model.width=, model.image_size=, model.sync_bn=); hf:gpt2 and hf:llama: Hugging Face "
        "transformers models built from their config class, sized by model.* (pip install 'gradmesh[hf]')",
    )
    what.add_argument(
        "--data",
        metavar="PATH",
        help="UTF-8 text file or folder for gpt-char and hf:* (default: Python's stdlib source)",
    )
    what.add_argument(
        "--config", metavar="FILE", help="TOML config file (sections model, data, train, checkpoint, launch, run)"
    )
    what.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. model.n_layer=8 (repeatable)",
    )


def _add_how_options(train: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    how = train.add_argument_group("how to train")
    how.add_argument(
        "--strategy",
        choices=(*registry.STRATEGIES, AUTO),
        help="parallelism (default ddp; rl-cartpole: impala, its only one); auto: the plan `gradmesh plan` ranks first",
    )
    how.add_argument(
        "--mesh", metavar="AXIS=N,...", help="compose strategies on a named mesh: dp=2,tp=2, fsdp=2,tp=2 or dp=2,pp=2"
    )
    how.add_argument(
        "--ps-servers",
        type=integer,
        metavar="S",
        help="--strategy ps or hybrid: ranks that hold the parameters (hybrid: the sparse tables; default 1)",
    )
    how.add_argument(
        "--ps-mode", metavar="MODE", help="--strategy ps or hybrid: sync, async (ps) or ssp:K (default sync)"
    )
    how.add_argument(
        "--ps-shares",
        type=integer,
        metavar="N",
        help="--strategy ps, async and ssp:K >= 1: shares per worker "
        "per step, each its own update (default 2; at most 64 and the samples per worker; more: smaller "
        "updates, less staleness)",
    )
    how.add_argument("--pp-schedule", choices=configuration.PP_SCHEDULES, help="pipeline schedule (default 1f1b)")
    how.add_argument("--microbatches", type=integer, metavar="M", help="micro-batches per pipeline step (default 4)")
    how.add_argument(
        "--pp-split", metavar="UNIT,...", help="manual pipeline cut, e.g. h.2 (default: balanced by measured cost)"
    )
    how.add_argument(
        "--table-sharding",
        choices=configuration.TABLE_SHARDINGS,
        help="--strategy tables: row, each sparse table's rows split evenly over every rank (default), or table, "
        "each table whole on one rank (placed by size, as TorchRec's table-wise)",
    )
    return how


def _add_optimisation_options(train: argparse.ArgumentParser, how: argparse._ArgumentGroup) -> None:
    how.add_argument(
        "--learners",
        type=integer,
        metavar="L",
        help="--model rl-cartpole: ranks that train (the first L; the others act and send trajectories; "
        "default 1, at most --nproc / 2: each learner has an actor of its own)",
    )
    how.add_argument(
        "--global-batch-size", type=integer, metavar="B", help="samples per optimizer step over all ranks (default 32)"
    )
    how.add_argument("--grad-accum", type=integer, metavar="K", help="micro-batches per rank per step (default 1)")
    how.add_argument("--optimizer", choices=configuration.OPTIMIZERS, help="default adamw")
    how.add_argument(
        "--balance",
        metavar="HOW",
        help="split each global batch by rank speed: off (equal, default), auto (measured, re-split every "
        "few steps) or static:S1,S2,... (fixed shares); the model trained is the same",
    )
    how.add_argument(
        "--bucket-mb",
        type=bucket_type,
        metavar="MB",
        help="DDP's gradient bucket size in MiB, or 'auto': a few sizes timed over the first steps (default 25)",
    )
    how.add_argument(
        "--compression",
        metavar="METHOD",
        help=compression_help(),
    )
    how.add_argument("--lr", type=number, help="peak learning rate")
    how.add_argument("--max-steps", type=integer, metavar="N", help="optimizer steps to run (default 1500)")
    how.add_argument("--seed", type=integer)
    how.add_argument(
        "--eval-every", type=integer, metavar="N", help="held-out evaluation every N steps (default: at the end)"
    )


def _add_run_options(train: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    run = train.add_argument_group("run directory")
    run.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where config, metrics, checkpoints and weights go (default: a new folder under runs/, "
        "runs/latest pointing at it; --resume without --run-dir continues runs/latest)",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="start afresh in a gradmesh run dir that has checkpoints (its files are replaced)",
    )
    run.add_argument(
        "--checkpoint-every", type=integer, metavar="N", help="checkpoint every N steps (default: at the end)"
    )
    run.add_argument(
        "--resume", action="store_true", default=None, help="continue from the latest checkpoint in --run-dir"
    )
    run.add_argument(
        "--resume-if-any",
        action="store_true",
        default=None,
        help="--resume when --run-dir holds a complete checkpoint, else start afresh (a restarted pod or requeued job)",
    )
    run.add_argument(
        "--async-checkpoint", action="store_true", default=None, help="write checkpoints in the background"
    )
    run.add_argument(
        "--record-samples", action="store_true", default=None, help="log each rank's sample indices per step"
    )
    return run


def _add_monitoring_options(train: argparse.ArgumentParser) -> None:
    watch = train.add_argument_group("monitoring (see gradmesh monitor / gradmesh report)")
    watch.add_argument(
        "--no-monitor",
        dest="monitor_enabled",
        action="store_false",
        default=None,
        help="no per-rank step breakdown, straggler detection or replica checks",
    )
    watch.add_argument(
        "--check-every",
        type=integer,
        metavar="N",
        help="compare parameter checksums across data-parallel replicas every N steps (default 50; 0: never)",
    )
    watch.add_argument(
        "--trace-steps", metavar="A:B", help="write trace.json (Chrome/Perfetto) of steps A..B on every rank"
    )
    watch.add_argument(
        "--tensorboard", action="store_true", default=None, help="write TensorBoard event files to RUN_DIR/tensorboard"
    )
    watch.add_argument(
        "--prometheus-port", type=integer, metavar="P", help="serve Prometheus metrics on 127.0.0.1:P/metrics"
    )
