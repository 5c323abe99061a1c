"""celery_guard's imports only point down: the import-linter contracts in pyproject.toml hold,
and no module hides an import of celery_guard inside a function (where it would escape them)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_guard"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_the_import_contracts_hold() -> None:
    run = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "celery_guard's layers KEPT" in run.stdout
    assert "0 broken" in run.stdout


def _nested_guard_imports(tree: ast.Module) -> list[int]:
    """Line numbers of celery_guard imports below the module's top level."""
    top = {id(node) for node in tree.body}
    lines = []
    for node in ast.walk(tree):
        if id(node) in top:
            continue
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else ["celery_guard"]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        if any(name.split(".")[0] == "celery_guard" for name in names):
            lines.append(node.lineno)
    return lines


def test_no_celery_guard_import_inside_a_function_or_block() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30  # the whole package was read
    nested = {
        str(path.relative_to(ROOT)): lines
        for path in modules
        if (lines := _nested_guard_imports(ast.parse(path.read_text(), str(path))))
    }
    assert nested == {}, "move these imports to the top of their module (or the code down)"


def test_the_check_sees_an_import_inside_a_function() -> None:
    tree = ast.parse("import os\ndef f():\n    from celery_guard.install import get_runtime\n")
    assert _nested_guard_imports(tree) == [3]
