"""The shape of the code, checked: the arrows between packages point one way, the two fine-tune recipes are
siblings (neither imports the other), recipes/ holds entry points only, no module grows into the
one-class-does-everything recipe again, configs name public paths; and the tests: their folders mirror the source
tree, no test module imports another (shared code is in conftest.py and support.py), only tests/bench/ reaches into
bench/, and every test reaches the CLI the same way. Static reads of the source: no imports, milliseconds."""

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO_ROOT

RECIPES = REPO_ROOT / "recipes"
LIBRARY = REPO_ROOT / "finetune"
TESTS = REPO_ROOT / "tests"
BENCH = REPO_ROOT / "bench"
# What every test module may import from tests/: the fixtures and the builders. The test modules sit in folders that
# mirror the source tree, beside these and this file at the root.
SHARED_TEST_MODULES = {"conftest", "support"}
TEST_ROOT_FILES = {"conftest.py", "support.py", "test_layout.py"}
# Sizes count statements (ast.stmt nodes at any depth), which the formatter's wrapping leaves alone. The largest
# modules hold about 1.6 lines a statement; 350 (a library module) and 400 (a recipe) leave today's largest some 15 %
# headroom, about where the 500- and 600-line gates stood before the formatter's wrapping added 19 % lines.
RECIPE_FILES = {"full_finetune_single_device.py": 400, "full_finetune_distributed.py": 400}
ENTRY_POINTS = {"__init__.py", "evaluate.py", "launch.py", *RECIPE_FILES}
MODULE_LIMIT = 350  # statements, any module of the library
DOCSTRING_INDEX_LIMIT = 45  # the recipe docstring is an index of keys; the manual is a docs page
# The library's packages and top-level modules, bottom first: a module imports from its own package or from a lower
# rank, never from a peer or above. At the bottom, what eval/ and every concern share (the bad-input error, the run
# folder's file names, host memory); then the concerns on their own (among them a model folder's sizes against its
# weights, which eval/ shares too); the settings' sections (plain frozen records, which the components take); data
# builds on the model (packed attention's collate); checkpoint on the model (the families' config.json), data (the
# dataset digest a resume checks) and the optimizer; reporting is checkpoint's peer (neither knows the other: the names
# both use are at the bottom); settings reads every concern's keys; validation and services compose.
PACKAGE_ORDER = [
    {"base", "run_files", "host_memory", "tune_run", "launch"},
    {"model", "optimizer", "streaming", "stops", "weight_shapes"},
    {"sections"},
    {"data"},
    {"checkpoint", "reporting"},
    {"settings", "toy_folder"},
    {"validation"},
    {"services"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path):
    """Every module name ``path`` imports (``from a.b import c`` gives a.b and a.b.c)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def library_modules():
    return sorted(p for p in LIBRARY.rglob("*.py") if "__pycache__" not in p.parts)


def library_imports(path: Path):
    """The modules of finetune/ that ``path`` imports anywhere in its code: for ``from a.b import c``, a.b.c where that
    is a module, else a.b (a module, or a package's ``__init__``)."""
    modules = {module_name(p) for p in library_modules()}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            )
    return found & modules


def statements(path: Path) -> int:
    """The statements of a module: ast.stmt nodes at any depth (a def, and each statement of its body)."""
    return sum(isinstance(node, ast.stmt) for node in ast.walk(ast.parse(path.read_text())))


def test_recipes_hold_the_entry_points_only():
    assert {p.name for p in RECIPES.glob("*.py")} == ENTRY_POINTS
    assert not [p for p in RECIPES.iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_recipes_are_siblings_within_their_size():
    for name, limit in RECIPE_FILES.items():
        path = RECIPES / name
        count = statements(path)
        assert count <= limit, (
            f"{name}: {count} statements (at most {limit}: move what is not the story to a component)"
        )
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


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(LIBRARY)))
def test_library_modules_stay_small(path):
    count = statements(path)
    assert count <= MODULE_LIMIT, f"{path.name}: {count} statements (at most {MODULE_LIMIT}: split it by concern)"


def test_every_library_folder_is_a_package():
    """A folder without __init__.py imports as a namespace package: its modules load, the names its package
    re-exports do not (``from finetune.settings import Settings`` fails)."""
    folders = {p.parent for p in library_modules()}
    assert not [f for f in folders if not (f / "__init__.py").is_file()]


def test_every_library_package_has_a_rank():
    """Each folder of finetune/ and each module beside them stands in PACKAGE_ORDER once (a new one takes its place
    in the picture there, with its reason)."""
    ranked = [unit for rank in PACKAGE_ORDER for unit in rank]
    assert len(ranked) == len(set(ranked)), sorted(u for u in ranked if ranked.count(u) > 1)
    units = {module_name(p).split(".")[1] for p in library_modules() if p != LIBRARY / "__init__.py"}
    assert units == set(ranked), f"no rank: {sorted(units - set(ranked))}; gone: {sorted(set(ranked) - units)}"


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(LIBRARY)))
def test_the_library_imports_down_only(path):
    """A module imports from its own package or from a lower rank of PACKAGE_ORDER (never a peer's), and never
    recipes/ or eval/; finetune/__init__.py imports nothing (every interpreter of the environment loads it)."""
    me = module_name(path)
    assert not [m for m in imported_modules(path) if m.split(".")[0] in ("recipes", "eval")], me
    if me == "finetune":
        assert not list(imported_modules(path)), "finetune/__init__.py imports nothing"
        return
    rank = {unit: i for i, units in enumerate(PACKAGE_ORDER) for unit in units}
    mine = me.split(".")[1]
    for target in sorted(library_imports(path)):
        theirs = target.split(".")[1]
        if theirs != mine:
            assert rank[theirs] < rank[mine], f"{me} (rank {rank[mine]}) imports {target} (rank {rank[theirs]})"


def test_the_library_has_no_import_cycle():
    """No module of finetune/ reaches itself through imports, function-local ones included (across packages the order
    above rules cycles out; this holds inside a package)."""
    graph = {module_name(p): sorted(library_imports(p)) for p in library_modules()}
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError(" -> ".join(path[path.index(module) :] + [module]))
        if module not in done:
            path.append(module)
            for target in graph[module]:
                visit(target)
            path.pop()
            done.add(module)

    for module in graph:
        visit(module)


def test_eval_and_the_optimizers_import_nothing_above_them():
    for path in (REPO_ROOT / "eval").glob("*.py"):
        assert not [m for m in imported_modules(path) if m.split(".")[0] == "recipes"], path
        assert not [
            m
            for m in imported_modules(path)
            if m.startswith("finetune.") and m.split(".")[1] not in ("base", "run_files", "weight_shapes")
        ], path
    for path in (REPO_ROOT / "optimizers").glob("*.py"):
        assert not [
            m for m in imported_modules(path) if m.split(".")[0] in ("recipes", "eval", "finetune", "torchtune")
        ], path


def test_configs_name_no_private_module():
    for path in sorted((REPO_ROOT / "configs").rglob("*.yaml")):
        for component in re.findall(r"_component_:\s*(\S+)", path.read_text()):
            assert not [part for part in component.split(".") if part.startswith("_")], f"{path}: {component}"


def test_tests_reach_the_cli_through_conftest():
    """A bare ``"tune"`` exists only in an activated venv; tests use conftest's TUNE (beside sys.executable)."""
    for path in (REPO_ROOT / "tests").rglob("*.py"):
        # (a list that starts with "tune" and is not compared with ``==``: a command about to run)
        assert not re.search(r"""(?<!== )\[\s*["']tune["']\s*,""", path.read_text()), f"{path.name} calls a bare tune"


def all_test_modules():
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_tests_mirror_the_source_tree():
    """tests/<path>/ for a source folder <path>/; test modules' names unique (pytest imports them by basename: no
    __init__.py packages under tests/)."""
    assert {p.name for p in TESTS.glob("*.py")} == TEST_ROOT_FILES
    assert not list(TESTS.rglob("__init__.py"))
    for folder in (p for p in TESTS.rglob("*") if p.is_dir() and "__pycache__" not in p.parts):
        if any(folder.glob("*.py")):
            assert (REPO_ROOT / folder.relative_to(TESTS)).is_dir(), f"{folder.relative_to(REPO_ROOT)} mirrors nothing"
    names = [p.name for p in all_test_modules() if p.parent != TESTS]
    assert all(n.startswith("test_") for n in names), "under tests/ a module is a test module or conftest/support"
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("path", all_test_modules(), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_module_imports_another(path):
    """What tests share is in conftest.py (fixtures, recipe runners) or support.py (builders); a test module is only
    collected, never imported by another."""
    tests = {p.stem for p in all_test_modules()} - SHARED_TEST_MODULES
    imported = {name.split(".")[0] for name in imported_modules(path)}
    assert not imported & tests, f"{path.name} imports {sorted(imported & tests)}"
    assert not re.search(r"""(__import__|import_module)\(\s*f?["']test_""", path.read_text()), path.name


@pytest.mark.parametrize("path", all_test_modules(), ids=lambda p: str(p.relative_to(TESTS)))
def test_only_the_bench_tests_reach_into_bench(path):
    """bench/ is not a fixture factory: outside tests/bench/, no test puts bench/ on sys.path or imports a bench
    script (one may run a bench script as a user does, ``python bench/<script>.py``)."""
    if path.is_relative_to(TESTS / "bench"):
        return
    scripts = {p.stem for p in BENCH.glob("*.py")}
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func.value) == "sys.path"
        ):
            assert "bench" not in ast.unparse(node), f"{path.name}: {ast.unparse(node)}"
    imported = {name.split(".")[0] for name in imported_modules(path)}
    assert not imported & scripts, f"{path.name} imports bench/'s {sorted(imported & scripts)}"


def test_docs_and_comments_name_test_files_that_exist():
    """A test file named in the docs, the README or a comment exists (a move of tests/ updates its readers)."""
    sources = [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")]
    for folder in ("finetune", "recipes", "optimizers", "eval", "bench", "tests"):
        sources += [p for p in (REPO_ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
    missing = [
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for path in sources
        for name in sorted(set(re.findall(r"\btests/[\w/]+\.py", path.read_text())))
        if not (REPO_ROOT / name).is_file()
    ]
    assert not missing, missing
