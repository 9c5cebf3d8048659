"""The architecture's rules (issue 12), checked on the source: layers depend downwards only, files
and functions stay small, strategies are known only to the registry, and the registry's and the
reducer chain's logic holds."""

import ast
import re
import subprocess
from types import SimpleNamespace
import sys
from pathlib import Path

import pytest
import torch

from gradmesh.comm.reducer import CommCounter, Counted, Guarded, Reducer, Timed, build_reducer
from gradmesh.errors import UsageError
from gradmesh.loop.trainer import SEGMENT_STEPS, Trainer
from gradmesh.loop.services import Service
from gradmesh.mesh import MESH_AXES
from gradmesh.parallel import registry

PACKAGE = Path(__file__).resolve().parent.parent / "gradmesh"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_files_and_functions_stay_small():
    long_files = [f"{p.relative_to(PACKAGE)} ({n})" for p in SOURCES if (n := len(p.read_text().splitlines())) > 300]
    long_functions = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 40:
                long_functions.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert not long_files and not long_functions, (long_files, long_functions)


@pytest.mark.parametrize("layer, forbidden", [
    ("models", ("gradmesh",)),
    ("config", ("gradmesh.fault", "gradmesh.parallel", "gradmesh.engine", "gradmesh.loop", "torch")),
    ("parallel", ("gradmesh.cli", "gradmesh.loop", "gradmesh.engine", "gradmesh.worker")),
    ("comm", ("gradmesh.parallel", "gradmesh.engine", "gradmesh.loop", "gradmesh.fault", "gradmesh.monitor")),
    ("engine", ("gradmesh.loop", "gradmesh.cli", "gradmesh.fault")),
    ("fault/checkpoint.py", ("gradmesh.parallel", "gradmesh.engine")),
])
def test_layers_only_import_downwards(layer, forbidden):
    paths = [PACKAGE / layer] if layer.endswith(".py") else sorted((PACKAGE / layer).rglob("*.py"))
    bad = [(p.name, name) for p in paths for name in imports_of(p)
           if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not bad


def test_environment_is_read_in_one_module():
    readers = [p.relative_to(PACKAGE) for p in SOURCES if "os.environ" in p.read_text() or "getenv" in p.read_text()]
    assert [str(p) for p in readers] == ["env.py"]


REGISTRIES = {"parallel/registry.py", "parallel/plans.py", "parallel/strategy.py", "config/compression.py"}
"""The strategy registry (its rows and their type) and the compressor registry."""
AXIS_MODULES = {"mesh.py", "topology.py"}
"""Where mesh axes are named and picked; code elsewhere picks an axis by mesh.py's constants."""


def _compared_constants(tree: ast.AST):
    """(line, value) of each string literal compared (==, !=, in, not in), matched in a case, or
    looked up as a key."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            where = node
        elif isinstance(node, ast.Subscript):
            where = node.slice
        elif isinstance(node, ast.match_case):
            where = node.pattern
        else:
            continue
        yield from ((c.lineno, c.value) for c in ast.walk(where) if isinstance(c, ast.Constant) and isinstance(c.value, str))


def _names_outside_the_registries():
    from gradmesh.engine import ENGINES

    names = ({row.name for row in registry.ROWS} | set(ENGINES)
             | {role for row in registry.ROWS for role in row.roles} | set(MESH_AXES))
    hits = []
    for path in SOURCES:
        where = str(path.relative_to(PACKAGE))
        if where in REGISTRIES:
            continue
        for line, value in _compared_constants(ast.parse(path.read_text())):
            if value in names and not (where in AXIS_MODULES and value in MESH_AXES):
                hits.append(f"{where}:{line} {value!r}")
    return hits


def test_only_the_registry_knows_strategy_names():
    """No `== "ddp"`-style branches outside the registries: strategy, engine-family and role names
    are the registry's keys, and code elsewhere asks a row's or a plan's capabilities. Names that
    are also mesh axes ("fsdp", "tp", "pp", "ps", "dp") are not skipped: only mesh.py and
    topology.py compare axis literals, other code uses mesh.py's axis constants."""
    assert not _names_outside_the_registries()


def test_the_names_check_sees_what_it_must(monkeypatch, tmp_path):
    """A comparison with an axis-named strategy, an engine family or a role, a literal key lookup
    and a match case are each caught."""
    source = tmp_path / "probe.py"
    source.write_text('a == "fsdp"\nb != "collective"\n"server" in c\nd["ps"]\nmatch e:\n    case "pipeline": pass\n')
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", [source])
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert len(_names_outside_the_registries()) == 5


def test_a_compressor_row_is_all_a_new_method_needs(monkeypatch):
    """The compressor registry is the seam: a row added there (and nothing else) parses with its
    parameters, builds its reducer, is accepted by the strategies of its families and shows in
    --compression's help."""
    from gradmesh.cli import build_parser
    from gradmesh.comm.compress import reducer_for
    from gradmesh.config import compression

    row = compression.Compressor(
        "sign", "sign[:scale=S] (one bit per entry)", syntax="[:scale=S]", parameters={"scale": float},
        reducer="gradmesh.comm.compress:cast_all_reduce", wire_dtype="float16", families=compression.THROUGH_THE_REDUCER,
    )
    rows = (*compression.ROWS[:-1], row, compression.ROWS[-1])
    monkeypatch.setattr(compression, "ROWS", rows)
    monkeypatch.setattr(compression, "COMPRESSORS", {r.name: r for r in rows})
    assert compression.parse_compression("sign:scale=0.5") == ("sign", {"scale": 0.5})
    assert reducer_for("sign:scale=2").name == "all_reduce_sign"
    assert "sign" in registry.resolve("ddp", {"dp": 2}).compressions
    assert "sign" not in registry.resolve("ps", {"ps": 3}).compressions
    with pytest.raises(UsageError, match=re.escape("topk:ratio=K[,start=N] (0 < K <= 1), sign[:scale=S] or auto")):
        compression.parse_compression("zstd")
    fresh = build_parser.__wrapped__()  # the CLI builds its parser once per process, from the rows then
    assert "sign[:scale=S] (one bit per entry)" in " ".join(_train_help(fresh).split())


def _train_help(parser) -> str:
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["train"].format_help()


def test_cli_reads_the_registry_without_importing_torch():
    code = ("import sys\nfrom gradmesh.parallel import registry\nfrom gradmesh.cli import build_parser\n"
            "build_parser()\nprint('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_every_registry_row_resolves_to_real_functions():
    for row in registry.ROWS:
        for ref in (row.apply, row.sync, row.optimizer, row.optimizer_state, row.load_optimizer_state, row.cost):
            assert ref is None or callable(registry.load(ref)), (row.name, ref)
    from gradmesh.engine import ENGINES

    assert {row.engine for row in registry.ROWS} <= set(ENGINES)


@pytest.mark.parametrize("name, mesh, label, order, engine", [
    ("ddp", {"dp": 4}, "ddp", ["ddp"], "collective"),
    ("zero1", {"dp": 2}, "zero1", ["zero1"], "collective"),
    ("ddp", {"dp": 2, "tp": 2}, "dp=2,tp=2", ["tp", "ddp"], "collective"),
    ("ddp", {"fsdp": 2, "tp": 2}, "fsdp=2,tp=2", ["tp", "fsdp"], "collective"),
    ("ddp", {"dp": 2, "pp": 2}, "dp=2,pp=2", ["pipeline", "ddp"], "pipeline"),
    ("pipeline", {"pp": 2}, "pipeline", ["pipeline"], "pipeline"),
])
def test_meshes_resolve_in_the_fixed_composition_order(name, mesh, label, order, engine):
    plan = registry.resolve(name, mesh)
    assert (plan.label, [row.name for row in plan.rows], plan.engine) == (label, order, engine)


def test_plan_properties_follow_its_rows():
    assert registry.resolve("ddp", {"dp": 2}).inplace_recovery
    assert not registry.resolve("zero1", {"dp": 2}).inplace_recovery
    assert not registry.resolve("ddp", {"dp": 2, "tp": 2}).replicated
    assert not registry.resolve("pipeline", {"pp": 2}).same_work
    with pytest.raises(UsageError, match="not one of ddp, zero1"):
        registry.get("horovod")


def test_a_plans_capabilities_are_its_families():
    """What the CLI, the loop and the worker ask instead of comparing names."""
    ddp, pipeline, ps = (registry.resolve("ddp", {"dp": 2}), registry.resolve("ddp", {"dp": 2, "pp": 2}),
                         registry.resolve("ps", {"ps": 3}))
    assert ddp.runs_lockstep and ddp.accepts_balance and not ddp.has_servers
    assert pipeline.runs_lockstep and not pipeline.accepts_balance and not pipeline.has_servers
    assert not ps.runs_lockstep and not ps.accepts_balance and ps.has_servers
    assert [row.name for row in registry.ROWS if row.has_servers] == ["ps", "hybrid"]
    assert ps.compressions == registry.resolve("fsdp", {"fsdp": 2}).compressions == ("none", "fp16", "bf16")
    assert ddp.compressions == ("none", "fp16", "bf16", "powersgd", "topk", "auto")


def test_state_formulas_are_the_zero_papers():
    """fp32 AdamW (K = 2 slots): ddp 16P, zero1 8P + 8P/N, fsdp 16P/N (Rajbhandari et al., 2020)."""
    size, n = registry.ModelSize(params=1000), 4
    formulas = {row.name: row.state_bytes(size, n) for row in registry.ROWS}
    assert formulas["ddp"] == 16_000 and formulas["zero1"] == 8000 + 2000 and formulas["fsdp"] == 4000
    tp = registry.STRATEGIES["tp"].state_bytes(registry.ModelSize(params=1000, tp_params=800), n)
    assert tp == 16 * (200 + 800 / n)


def test_a_plans_state_per_rank_composes_its_rows():
    """What the pre-launch memory check multiplies by the ranks sharing a machine."""
    size = registry.ModelSize(params=1000, tp_params=800)
    assert registry.resolve("zero1", {"dp": 4}).state_bytes(size) == 10_000
    assert registry.resolve("ddp", {"dp": 2, "tp": 2}).state_bytes(size) == 16 * (200 + 800 / 2)
    assert registry.resolve("ddp", {"fsdp": 2, "tp": 2}).state_bytes(size) == 16 * (200 + 800 / 2) / 2
    assert registry.resolve("ddp", {"dp": 2, "pp": 2}).state_bytes(size) == 16_000 / 2


class _Recorded(Reducer):
    name = "fake"

    def reduce(self, tensor, group, parts=None):
        future = torch.futures.Future()
        future.set_result(tensor * 2)
        return future


class _Clock:
    def __init__(self):
        self.issued, self.completed = [], 0

    def collective(self, name):
        self.issued.append(name)
        return self._done

    def _done(self):
        self.completed += 1


def test_the_reducer_chain_counts_times_and_passes_the_result_through():
    counter, clock = CommCounter(), _Clock()
    reducer = build_reducer(counter, clock, None, base=_Recorded())
    out = reducer.average(torch.ones(10), group=None)
    assert torch.equal(out, torch.full((10,), 2.0))
    assert counter.take() == (40, 1) and counter.take() == (0, 0)
    assert clock.issued == ["fake"] and clock.completed == 1
    assert isinstance(reducer, Guarded) and isinstance(reducer.inner, Timed) and isinstance(reducer.inner.inner, Counted)


def test_the_guard_fails_the_result_when_a_member_is_lost():
    from gradmesh.fault.inplace import MembersLost

    class Lost:
        def guard(self, future):
            failed = torch.futures.Future()
            failed.set_exception(MembersLost("a member left"))
            return failed

    reducer = build_reducer(CommCounter(), None, Lost(), base=_Recorded())
    with pytest.raises(MembersLost):
        reducer.average(torch.ones(3), group=None)


def test_segments_of_an_engine_out_of_lockstep_end_where_a_service_needs_every_rank():
    """Checkpoints and evaluations see the model exactly after their step: a segment ends there."""
    class EveryFour(Service):
        def wants_all_ranks(self, step):
            return step % 4 == 0

    trainer = SimpleNamespace(train=SimpleNamespace(max_steps=130), services=SimpleNamespace(all=[Service()]))
    assert Trainer._segment_end(trainer, 0) == SEGMENT_STEPS
    assert Trainer._segment_end(trainer, 120) == 130
    trainer.services.all.append(EveryFour())
    assert [Trainer._segment_end(trainer, s) for s in (0, 4, 5)] == [4, 8, 8]


def test_a_strategy_named_on_a_sessions_default_mesh_runs_alone_over_its_ranks():
    """gradmesh.init() gives a one-axis dp mesh: Trainer(strategy="fsdp") had run ddp on it."""
    assert (registry.resolve("fsdp", {"dp": 2}).label, registry.resolve("fsdp", {"dp": 2}).mesh) == ("fsdp", {"fsdp": 2})
    assert registry.resolve("ps", {"dp": 3}).engine == "ps"
    assert registry.resolve("zero1", {"dp": 2}).label == "zero1"
    with pytest.raises(UsageError, match="does not combine"):
        registry.resolve("ps", {"dp": 2, "tp": 2})
