"""The documentation site (docs/, mkdocs.yml) and the README agree with the code: the
configuration reference is the generator's output, the strategy tables are the registry's rows,
every `gradmesh train` flag is documented, the site builds with no broken link, and measured
figures live on the benchmark page, not in the source's docstrings and comments."""

import ast
import importlib.util
import io
import re
import runpy
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from gradmesh.parallel import registry

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCES = sorted((ROOT / "gradmesh").rglob("*.py"))


def strategy_table(text: str) -> list[str]:
    """The strategy names of the first table whose header begins `| strategy | what each rank holds |`."""
    table = text[text.index("| strategy | what each rank holds |"):]
    table = table[:table.index("\n\n")]
    return re.findall(r"^\| `([a-z0-9]+)` \|", table, flags=re.MULTILINE)


def test_the_configuration_reference_is_generated_from_the_config_dataclasses():
    """Regenerate with `python docs/gen_config.py > docs/configuration.md`."""
    generate = runpy.run_path(str(DOCS / "gen_config.py"))["generate"]
    assert (DOCS / "configuration.md").read_text() == generate()


def test_the_reference_documents_every_config_key():
    from gradmesh.config import all_keys

    text = (DOCS / "configuration.md").read_text()
    missing = [key for key in all_keys() if f"| `{key.split('.', 1)[1]}` |" not in text]
    assert not missing and all(f"## `[{section}]`" in text for section in {k.split(".")[0] for k in all_keys()})


def test_the_docs_strategy_table_is_the_registry():
    """The user's table of strategies lists exactly the registry's rows, in its order."""
    assert strategy_table((DOCS / "strategies.md").read_text()) == [row.name for row in registry.ROWS]


def test_the_readmes_strategy_table_is_the_registry():
    assert strategy_table((ROOT / "README.md").read_text()) == [row.name for row in registry.ROWS]


@pytest.mark.parametrize("command", ["train", "plan"])
def test_every_flag_is_documented(command):
    from gradmesh.cli import build_parser

    commands = next(action for action in build_parser()._actions if action.dest == "command")
    text = "\n".join(path.read_text() for path in DOCS.glob("*.md"))
    flags = [flag for action in commands.choices[command]._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"]
    assert [flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", text)] == []


def test_the_readme_stays_short_and_no_design_md_is_cited():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    sources = [*DOCS.glob("*.md"), ROOT / "README.md", *(ROOT / "gradmesh").rglob("*.py")]
    assert [str(path) for path in sources if "DESIGN.md" in path.read_text()] == []


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs-material is not installed (pip install -e '.[docs]')")
def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` fails on a broken link, a missing page or an unknown anchor."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                             "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()


MEASUREMENT = re.compile(
    r"\b\d+(?:\.\d+)?x\b"  # a ratio: 1.03x none's loss
    r"|\bmeasured\b[^.;]{0,40}?\d"  # measured: 0.975 / measured at 150 steps
    r"|\d\s*samples/s\b"  # a throughput
    r"|\b\d+\.\d+\s*(?:ms|s)\b"  # a timing: 0.8 s, 183.6 ms
    r"|\d%\s+(?:off|above|below|higher|lower|slower|faster|worse|better)\b"  # ends 5% higher
    r"|\b\d\.\d+\s+of\s+(?:plain|none|sync|uncompressed|fp32)\b"  # 0.975 of plain DDP's throughput
    r"|\b(?:takes|took|costs?)\s+(?:about\s+|~)\d",  # its import takes ~74 MB
    re.IGNORECASE,
)
"""What reads as a reported measurement. Design choices (defaults, limits: "at most 10% of compute",
"20 x the slowest step") and formulas do not match; a figure a run produced does."""


def prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each docstring (any string statement) and each block of consecutive
    comment lines of a Python file, so that a figure broken across lines is still one text."""
    source = path.read_text()
    blocks: list[tuple[int, str]] = []
    last = -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            line, text = token.start[0], token.string.lstrip("#")
            if blocks and line == last + 1 and blocks[-1][0] + blocks[-1][1].count("\n") == last:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + "\n" + text)
            else:
                blocks.append((line, text))
            last = line
    for node in ast.walk(ast.parse(source)):
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)
            for statement in statements if isinstance(statements, list) else []:
                if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                        and isinstance(statement.value.value, str)):
                    blocks.append((statement.lineno, statement.value.value))
    return blocks


def measurements(sources: list[Path], root: Path) -> list[str]:
    """`file:line: text` for each docstring or comment line where a measurement-like figure begins."""
    hits = set()
    for path in sources:
        for first, text in prose(path):
            for match in MEASUREMENT.finditer(text):
                offset = text.count("\n", 0, match.start())
                hits.add((str(path.relative_to(root)), first + offset, text.splitlines()[offset].strip()))
    return [f"{where}:{line}: {text}" for where, line, text in sorted(hits)]


def test_no_measured_figure_in_the_sources_prose():
    """Measured figures go stale in docstrings: they belong on the benchmark page with the command
    that reproduces them (docs/benchmarks.md) or in benchmarks/results/. The source keeps the
    reason in words and points there, e.g. (docs/benchmarks.md#loopback)."""
    assert measurements(SOURCES, ROOT) == []


def test_the_measurement_check_sees_what_it_must(tmp_path):
    """Ratios, "measured" figures, throughputs, timings, relative losses and costs are caught,
    across a line break too; design limits and formulas are not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""A ratio: 1.03x none\'s loss."""\n'  # 1
        "# measured: 0.975 of plain DDP's throughput\n"  # 2
        "def f():\n"  # 3
        '    """Importing it takes 0.8 s per process; 94.0 samples/s."""\n'  # 4
        "    return 1  # ends 5% higher in loss\n"  # 5
        "# the gather was measured\n"  # 6
        "# at 150 steps\n"  # 7
        "x = 2  # at most 10% of compute, max(300 s, 20 x the slowest), 8x8 digits, 2(N-1)/N x 4P\n"  # 8
        '"""Its import alone costs ~74 MB."""\n'  # 9
    )
    hits = measurements([probe], tmp_path)
    assert [hit.split(":")[1] for hit in hits] == ["1", "2", "4", "5", "6", "9"], hits
    assert hits[1] == "probe.py:2: measured: 0.975 of plain DDP's throughput"


def anchors(page: Path) -> set[str]:
    """A docs page's anchors: each heading's `{#id}`, else its slug as mkdocs' toc makes it."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"#+\s+(.*?)\s*(?:\{#([\w-]+)\})?\s*$", line)
        if heading:
            slug = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading.group(1)).strip().lower())
            found.add(heading.group(2) or slug)
    return found


def test_the_sources_pointers_into_the_docs_resolve():
    """Every `docs/PAGE.md#anchor` the source points to names a page and a section it has."""
    broken = []
    for path in SOURCES:
        for match in re.finditer(r"docs/([\w-]+\.md)(?:#([\w-]+))?", path.read_text()):
            page = DOCS / match.group(1)
            if not page.exists() or (match.group(2) and match.group(2) not in anchors(page)):
                broken.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert broken == []
