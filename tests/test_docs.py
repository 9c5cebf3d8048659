"""The documentation site (docs/, mkdocs.yml) and the README agree with the code: the
configuration reference is the generator's output, the strategy tables are the registry's rows,
every `gradmesh train` flag is documented, and the site builds with no broken link."""

import importlib.util
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from gradmesh.parallel import registry

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


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


def test_every_train_flag_is_documented():
    from gradmesh.cli import build_parser

    commands = next(action for action in build_parser()._actions if action.dest == "command")
    text = "\n".join(path.read_text() for path in DOCS.glob("*.md"))
    flags = [flag for action in commands.choices["train"]._actions for flag in action.option_strings
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
