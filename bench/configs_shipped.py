"""Which configs are shipped: each config's passing end-to-end row (bench/configs_check.py) from the current code.

    python bench/configs_shipped.py [--results bench/results/configs_check_h100.json ...] [--strict]

A config is shipped when a results file (by default each ``bench/results/configs_check_*.json``: one per GPU) has a
passing row of it whose code is the current code: nothing a run reads changed between the row's commit (its ``code``)
and the working tree, in the recipes, the library (``finetune/``, ``optimizers/``, ``eval/``), the eval's settings
(``configs/eval/``) and the config's own settings (its comments, where the measured figures go, may change, and so
may a setting the row's command line gives, such as ``output_dir``: the run never read the file's). A row
from older code is ``stale`` (the changed files are named: a fix in the checkpoint writer can break a save the row
proved); a config whose row from the current code failed (in ``rows`` or the file's ``failed`` list) is
``failing``, the failed checks named, though an older row passed: the current code is what a user runs; a config
without a passing row is ``missing``. Prints one line per
config, then the ``--configs`` of those that need a row, in the order a device call should take them (each model's
configs together, so its folder is made once). ``--strict`` exits 1 while any config needs a row. Configs the
single-device check cannot run (``*_distributed``) are listed apart: they need a machine of several GPUs.

Rows span device calls and days, so "current" is decided by the code, not the date: a change to bench/ or docs/ keeps
every row, a change to ``finetune/`` makes every row stale until it runs again, except where the row names the files
its runs imported (``imported``, recorded by bench/configs_check.py): then a changed Python file that none of its runs
loaded keeps it (the MoE blocks, for a dense config: code a process never imports cannot change what it did). So does
a Python file whose change is comments or layout alone (its syntax tree, docstrings included, is the commit's): a
comment is not code, and rewording one must not cost every row a device run. Other changed files under those folders
(not Python: a template, a .pth) make it stale as before. Rows recorded before bench/configs_check.py's module record
(no ``imported_from``) name only what Python's import-time lines reported, which leave out a module that
``importlib.import_module`` loads: of a package that loads its modules so (``finetune/streaming``: the host-room check,
``room.py``, ran in every streamed run unreported), such a row that loaded any module counts the whole package.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

REPO_ROOT = Path(__file__).resolve().parents[1]
# bench/configs_check.py's committed results, a file per GPU (configs_check_h100.json, configs_check_h200.json)
RESULTS_GLOB = "bench/results/configs_check_*.json"
# What a training run, its resume and its eval read besides the config file (bench/_harness.py's CODE_PATHS less bench/
# and configs/: a row's config is compared on its own, and the other configs do not change it).
RUN_PATHS = ["finetune", "recipes", "optimizers", "eval"]
# The eval's settings: every row's eval (bench/configs_check.py) reads them.
EVAL_CONFIGS = "configs/eval"


def shipped_configs(root: Path) -> List[str]:
    """Every config a user is given: configs/<family>/<name>.yaml, the eval's settings (configs/eval/) left out."""
    return sorted(
        str(p.relative_to(root / "configs").with_suffix(""))
        for p in (root / "configs").glob("*/*.yaml")
        if p.parent.name != "eval"
    )


def changed_since(
    root: Path,
    commit: str,
    config: str,
    imported: Optional[Sequence[str]] = None,
    command: Optional[str] = None,
) -> Optional[List[str]]:
    """The files a run of ``config`` reads that differ between ``commit`` and the working tree; None where git does not
    know the commit (a shallow clone, a row from another repository). ``imported``: the Python files the row's runs
    loaded, where it names them; a changed Python file outside them is left out. ``command``: the row's recipe
    command, whose ``key=value`` settings replace the file's on both sides (``command_settings``)."""
    paths = RUN_PATHS + [EVAL_CONFIGS, f"configs/{config}.yaml"]
    proc = subprocess.run(
        ["git", "diff", "--name-only", commit, "--", *paths], cwd=root, capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        return None
    changed = proc.stdout.split()
    own = f"configs/{config}.yaml"
    if own in changed and same_settings(root, commit, own, command_settings(command)):
        changed.remove(own)  # (its header's figures, comments only: the run reads the same settings)
    if imported is not None:
        loaded = set(imported)
        changed = [f for f in changed if f == own or not f.endswith(".py") or f in loaded]
    return [f for f in changed if not (f.endswith(".py") and same_code(root, commit, f))]


def same_code(root: Path, commit: str, path: str) -> bool:
    """Whether a Python file's code at ``commit`` is the working tree's: the same syntax tree (docstrings and every
    name, value and statement in it; not comments, blank lines, line breaks or quotes). False where either side is
    missing or does not parse."""
    texts = then_and_now(root, commit, path)
    try:
        return texts is not None and ast.dump(ast.parse(texts[0])) == ast.dump(ast.parse(texts[1]))
    except (SyntaxError, ValueError):
        return False


def then_and_now(root: Path, commit: str, path: str) -> Optional[Tuple[str, str]]:
    """A file's text at ``commit`` and in the working tree; None where either is missing."""
    before = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, text=True, timeout=60)
    if before.returncode != 0 or not (root / path).is_file():
        return None
    return before.stdout, (root / path).read_text()


def lazy_packages(root: Path) -> List[str]:
    """The packages under RUN_PATHS whose ``__init__.py`` loads their modules through ``importlib.import_module``."""
    inits = (p for d in RUN_PATHS for p in sorted((root / d).rglob("__init__.py")))
    return [str(p.parent.relative_to(root)) for p in inits if "import_module(" in p.read_text(errors="replace")]


def row_imports(root: Path, row: dict, lazy: Sequence[str]) -> Optional[List[str]]:
    """The files a row's runs loaded: its ``imported`` list (None without one), and for a row recorded from the
    import-time lines alone, every module of a lazily loading package (``lazy``: ``lazy_packages``) of which it
    names one."""
    imported = row.get("imported")
    if imported is None or row.get("imported_from"):
        return imported
    found = set(imported)
    for package in lazy:
        if any(f.startswith(f"{package}/") and f != f"{package}/__init__.py" for f in imported):
            found |= {str(p.relative_to(root)) for p in (root / package).glob("*.py")}
    return sorted(found)


def command_settings(command: Optional[str]) -> Dict[str, str]:
    """The ``key=value`` settings of a recipe command line (``key`` dotted for a nested one), in its order: what the
    run took from the command rather than from its config file. None or no such words: none."""
    settings: Dict[str, str] = {}
    for word in shlex.split(command or ""):
        key, eq, value = word.partition("=")
        if eq and key and not key.startswith("-") and all(part.isidentifier() for part in key.split(".")):
            settings[key] = value
    return settings


def same_settings(root: Path, commit: str, path: str, settings: Optional[Dict[str, str]] = None) -> bool:
    """Whether a config file holds the same settings at ``commit`` as in the working tree: its comments (the header's
    measured figures, written after a row) do not change a run, nor does a value the row's command line gives
    (``settings``, from ``command_settings``: the run took that one from the command, on both sides)."""
    texts = then_and_now(root, commit, path)
    if texts is None:
        return False
    try:  # (merged as the recipe's command line merges them: OmegaConf's dotlist, a dotted key into its section)
        given = OmegaConf.from_dotlist([f"{k}={v}" for k, v in (settings or {}).items()])
        then, now = (OmegaConf.to_container(OmegaConf.merge(yaml.safe_load(t) or {}, given)) for t in texts)
    except OmegaConfBaseException:  # (a command setting the file's structure refuses: nothing to tell, so stale)
        return False
    return then == now


def row_changes(root: Path, config: str, row: dict, lazy: Sequence[str]) -> Optional[List[str]]:
    """``changed_since`` for a results row of ``config``: its commit, the files its runs imported, its command; None
    where the row names no commit or git does not know it."""
    if not row.get("code"):
        return None
    return changed_since(root, row["code"], config, row_imports(root, row, lazy), row.get("command"))


def status(root: Path, results: Sequence[Path]) -> Dict[str, dict]:
    """Per config: ``state`` (shipped, failing, stale, missing, several_gpus, unknown_code), the row's code, tok/s,
    file, the changed files and (failing) the failed checks. Of several rows (files of other GPUs, rows of other calls)
    the best tells: a current passing one, else a current failing one, else a stale passing one."""
    passing: Dict[str, List[tuple]] = {}
    failing: Dict[str, List[tuple]] = {}
    for path in results:
        data = json.loads(path.read_text())
        for row in data["rows"] + data.get("failed", []):
            (passing if row.get("passed") else failing).setdefault(row["config"], []).append((path.name, row))
    rank = {"shipped": 0, "failing": 1, "stale": 2, "unknown_code": 3}
    lazy = lazy_packages(root)
    out = {}
    for config in shipped_configs(root):
        if config.endswith("_distributed"):
            out[config] = {"state": "several_gpus", "code": None, "tok_s": None, "file": None, "changed": []}
            continue
        entries = [{"state": "missing", "code": None, "tok_s": None, "file": None, "changed": []}]
        for name, row in passing.get(config, []):
            changed = row_changes(root, config, row, lazy)
            state = "unknown_code" if changed is None else ("stale" if changed else "shipped")
            entries.append(
                {
                    "state": state,
                    "code": row.get("code"),
                    "tok_s": row.get("tok_s"),
                    "file": name,
                    "changed": changed or [],
                }
            )
        for name, row in failing.get(config, []):  # (an old failure may be fixed)
            changed = row_changes(root, config, row, lazy)
            if changed == []:
                failed = sorted(k for k, ok in row.get("checks", {}).items() if not ok) or ["no checks recorded"]
                entries.append(
                    {
                        "state": "failing",
                        "code": row["code"],
                        "tok_s": None,
                        "file": name,
                        "changed": [],
                        "failed": failed,
                    }
                )
        out[config] = min(entries, key=lambda e: rank.get(e["state"], 4))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--results",
        type=Path,
        action="append",
        help=f"bench/configs_check.py's results file (repeat for several; default: every {RESULTS_GLOB})",
    )
    ap.add_argument("--strict", action="store_true", help="exit 1 while a config has no passing row from this code")
    args = ap.parse_args(argv)
    results = args.results or sorted(REPO_ROOT.glob(RESULTS_GLOB))
    for path in results:
        if not path.is_file():
            print(f"error: --results {path}: no such file (bench/configs_check.py --out writes one)", flush=True)
            return 2
    table = status(REPO_ROOT, results)
    for config, e in table.items():
        detail = {
            "shipped": f"row of {e['code']} in {e['file']}, {e['tok_s']} tok/s",
            "stale": f"row of {e['code']}; changed since: {', '.join(e['changed'][:4])}"
            + (f" and {len(e['changed']) - 4} more" if len(e["changed"]) > 4 else ""),
            "failing": f"row of {e['code']} in {e['file']} failed: {', '.join(e.get('failed', []))}",
            "missing": "no passing row",
            "unknown_code": f"row of {e['code']}, a commit this checkout does not have",
            "several_gpus": "needs a machine of several GPUs (bench/configs_check.py runs the single-device recipe)",
        }[e["state"]]
        print(f"{config:34s} {e['state']:12s} {detail}")
    need = [c for c, e in table.items() if e["state"] in ("failing", "stale", "missing", "unknown_code")]
    counts = {
        s: sum(e["state"] == s for e in table.values()) for s in dict.fromkeys(e["state"] for e in table.values())
    }
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    if need:
        print(f"need a row: --configs {','.join(need)}")
    return 1 if args.strict and need else 0


if __name__ == "__main__":
    sys.exit(main())
