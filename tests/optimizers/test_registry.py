"""optimizers.VARIANTS: the one list of our variants that the tests, the benches and the docs read.

A new variant must be its file plus one ``register(...)`` line: these tests check the registry's API, that every
exported optimizer class is registered, and that a variant registered from outside (a throwaway subclass here) is
picked up by the spec matrix, the contract tests, the recipe matrix and the DTensor test without any other edit
(bench/optimizer_step.py and bench/compare.py: tests/bench/).
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import optimizers
from conftest import REPO_ROOT, THROWAWAY_KEY, ThrowawayAdamW

# A pytest plugin (``-p throwaway_variant``) that registers a variant before the test modules are collected, as a
# user's own package registering one at import would.
PLUGIN = '''
import optimizers


class ThrowawayAdamW(optimizers.AdamW8bit):
    """8-bit AdamW under another name."""


optimizers.register(optimizers.Variant("throwaway", "throwaway_variant.ThrowawayAdamW", ThrowawayAdamW, 2.03125,
                                       "as ours8", tol_contract=0.05))
'''
# A second plugin (``-p collect_then_run``) for one pytest process to do what ``--collect-only`` and a run of a few
# cases would do in two: it writes the node ids of everything collected to $COLLECTED (as --collect-only -q lists
# them, after every other plugin's changes) and deselects all but the ids in $RUN (each pytest process spends most
# of its time importing torch, torchtune and the test modules).
COLLECT_THEN_RUN = """
import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    with open(os.environ["COLLECTED"], "w") as f:
        f.write("\\n".join(item.nodeid for item in items))
    run = set(os.environ["RUN"].split())
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in run])
    items[:] = [item for item in items if item.nodeid in run]
"""
MATRICES = [
    "tests/optimizers/test_optimizers.py",
    "tests/optimizers/test_optimizer_contract.py",
    "tests/optimizers/test_optimizers_dtensor.py",
    "tests/recipes/test_recipe.py",
]


def test_the_registry_holds_our_four_variants_in_order():
    assert list(optimizers.VARIANTS) == ["ours16", "ours8", "ours4", "oursfp8"]
    for key, v in optimizers.VARIANTS.items():
        assert v.key == key and v.component == f"optimizers.{v.cls.__name__}"
        assert v.bytes_per_param == 2 * v.cls.FORMAT.bytes_per_element and v.state
    assert [v.bytes_per_param for v in optimizers.VARIANTS.values()] == [4.0, 2.03125, 1.0625, 2.03125]
    with pytest.raises(dataclasses.FrozenInstanceError):
        optimizers.VARIANTS["ours8"].key = "x"


def test_every_exported_optimizer_class_is_registered():
    registered = {v.cls for v in optimizers.VARIANTS.values()}
    for name in optimizers.__all__:
        obj = getattr(optimizers, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
            assert obj in registered, f"optimizers.{name} is exported but not in optimizers.VARIANTS: register it"


def test_register_refuses_a_taken_key(throwaway):
    assert optimizers.VARIANTS[THROWAWAY_KEY] is throwaway and list(optimizers.VARIANTS)[-1] == THROWAWAY_KEY
    assert throwaway.cls is ThrowawayAdamW
    with pytest.raises(ValueError, match="already registered"):
        optimizers.register(dataclasses.replace(throwaway, component="elsewhere.AdamW"))
    assert optimizers.VARIANTS[THROWAWAY_KEY] is throwaway


def test_the_registry_imports_neither_torchtune_nor_needs_triton():
    code = (
        "import sys\nsys.modules['triton'] = None\nimport optimizers\n"
        "assert 'torchtune' not in sys.modules, 'optimizers imported torchtune'\n"
        "print(list(optimizers.VARIANTS))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ours16" in proc.stdout


def pytest_with_the_variant(tmp_path, run: list, *args: str) -> subprocess.CompletedProcess:
    """pytest on this checkout's tests, in one process, with PLUGIN's variant registered before collection; of what
    it collects (the ids are left in tmp_path/collected.txt), only the ids in ``run`` run."""
    (tmp_path / "throwaway_variant.py").write_text(PLUGIN)
    (tmp_path / "collect_then_run.py").write_text(COLLECT_THEN_RUN)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p),
        "COLLECTED": str(tmp_path / "collected.txt"),
        "RUN": " ".join(run),
    }
    plugins = ["-p", "throwaway_variant", "-p", "collect_then_run", "-p", "no:cacheprovider"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *plugins, "-n0", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )


def test_a_registered_variant_is_picked_up_everywhere(tmp_path):
    """Collected by the real test modules (pytest in a subprocess): a case in the spec matrix, the contract tests,
    the DTensor test and the recipe matrix; then the DTensor check passes on it (2 spawned ranks) and its recipe case
    runs and fails until its losses are recorded. (One pytest process collects the four modules and runs those two
    cases.)"""
    ran = pytest_with_the_variant(
        tmp_path,
        [
            "tests/optimizers/test_optimizers_dtensor.py::test_sharded_step_equals_local_step[throwaway]",
            "tests/recipes/test_recipe.py::test_optimizer_losses[ours-ThrowawayAdamW]",
        ],
        "-q",
        "-rA",
        *MATRICES,
    )
    out = ran.stdout + ran.stderr
    assert (tmp_path / "collected.txt").is_file(), out[-3000:]
    ids = (tmp_path / "collected.txt").read_text().splitlines()
    for module in MATRICES:
        mine = [i for i in ids if i.startswith(module + "::") and ("throwaway" in i or "ThrowawayAdamW" in i)]
        assert mine, f"{module} has no case for a registered variant"
    assert "tests/recipes/test_recipe.py::test_optimizer_losses[ours-ThrowawayAdamW]" in ids

    assert "PASSED tests/optimizers/test_optimizers_dtensor.py::test_sharded_step_equals_local_step[throwaway]" in out
    assert "no recorded losses for ['optimizer=throwaway_variant.ThrowawayAdamW']: add [" in out, out[-3000:]
    assert ran.returncode == 1 and "1 failed, 1 passed" in out, out[-3000:]
