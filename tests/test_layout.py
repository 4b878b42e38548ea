"""The shape of the code, checked: the arrows between packages point one way, the two fine-tune recipes are
siblings (neither imports the other), no module grows into the one-class-does-everything recipe again, and every
test reaches the CLI the same way. Static reads of the source: no imports, milliseconds."""

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO_ROOT

RECIPES = REPO_ROOT / "recipes"
RECIPE_FILES = {"full_finetune_single_device.py": 850, "full_finetune_distributed.py": 750}
COMPONENT_LIMIT = 500  # lines, any other module of recipes/
DOCSTRING_INDEX_LIMIT = 45  # the recipe docstring is an index of keys; the manual is a docs page


def imported_modules(path: Path):
    """Every module name ``path`` imports (``from a.b import c`` gives a.b and a.b.c)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_recipes_are_siblings_within_their_size():
    for name, limit in RECIPE_FILES.items():
        path = RECIPES / name
        lines = len(path.read_text().splitlines())
        assert lines <= limit, f"{name}: {lines} lines (at most {limit}: move what is not the story to a component)"
        others = {f"recipes.{Path(other).stem}" for other in RECIPE_FILES if other != name}
        assert not others & set(imported_modules(path)), f"{name} imports the other recipe"
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert len(doc.splitlines()) <= DOCSTRING_INDEX_LIMIT, f"{name}: the docstring is an index; the manual is docs/"


def test_no_recipe_class_is_subclassed():
    for name in RECIPE_FILES:
        tree = ast.parse((RECIPES / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.startswith("FullFinetune"):
                assert not node.bases, f"{name}: {node.name} derives from {ast.unparse(node.bases[0])}"


@pytest.mark.parametrize("path", sorted(p for p in RECIPES.glob("*.py") if p.name not in RECIPE_FILES),
                         ids=lambda p: p.name)
def test_components_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= COMPONENT_LIMIT, f"{path.name}: {lines} lines (split it by concern)"


def test_eval_and_the_base_import_nothing_above_them():
    for path in (REPO_ROOT / "eval").glob("*.py"):
        assert not [m for m in imported_modules(path) if m == "recipes" or m.startswith("recipes.")], path
    for path in (REPO_ROOT / "finetune_base").glob("*.py"):
        assert not [m for m in imported_modules(path) if m.split(".")[0] in ("recipes", "eval", "optimizers")], path
    for path in (REPO_ROOT / "optimizers").glob("*.py"):
        assert not [m for m in imported_modules(path) if m.split(".")[0] in ("recipes", "eval", "torchtune")], path


def test_tests_reach_the_cli_through_conftest():
    """A bare ``"tune"`` exists only in an activated venv; tests use conftest's TUNE (beside sys.executable)."""
    for path in (REPO_ROOT / "tests").glob("*.py"):
        # (a list that starts with "tune" and is not compared with ``==``: a command about to run)
        assert not re.search(r"""(?<!== )\[\s*["']tune["']\s*,""", path.read_text()), f"{path.name} calls a bare tune"
