"""optimizers.VARIANTS: the one list of our variants that the tests, the benches and the docs read.

A new variant must be its file plus one ``register(...)`` line: these tests check the registry's API, that every
exported optimizer class is registered, and that a variant registered from outside (a throwaway subclass here) is
picked up by the spec matrix, the contract tests, the recipe matrix, the DTensor test, bench/optimizer_step.py and
bench/compare.py without any other edit.
"""

import dataclasses
import subprocess
import sys

import pytest
import torch

import optimizers
from conftest import REPO_ROOT

KEY = "throwaway"
COMPONENT = f"{__name__}.ThrowawayAdamW"  # importable wherever tests/ is on sys.path (spawned ranks included)


class ThrowawayAdamW(optimizers.AdamW8bit):
    """A variant that exists only for these tests: 8-bit AdamW under another name."""


@pytest.fixture
def throwaway():
    v = optimizers.register(optimizers.Variant(KEY, COMPONENT, ThrowawayAdamW, 2.03125, "as ours8",
                                               tol_contract=0.05))
    try:
        yield v
    finally:
        del optimizers.VARIANTS[KEY]


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
    assert optimizers.VARIANTS[KEY] is throwaway and list(optimizers.VARIANTS)[-1] == KEY
    with pytest.raises(ValueError, match="already registered"):
        optimizers.register(dataclasses.replace(throwaway, component="elsewhere.AdamW"))
    assert optimizers.VARIANTS[KEY] is throwaway


def test_the_registry_imports_neither_torchtune_nor_needs_triton():
    code = ("import sys\nsys.modules['triton'] = None\nimport optimizers\n"
            "assert 'torchtune' not in sys.modules, 'optimizers imported torchtune'\n"
            "print(list(optimizers.VARIANTS))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ours16" in proc.stdout


def test_a_registered_variant_is_picked_up_everywhere(throwaway):
    import test_optimizer_contract
    import test_optimizers
    import test_optimizers_dtensor
    import test_recipe

    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import optimizer_step

    assert KEY in [s.name for s in test_optimizers.specs()]
    assert ThrowawayAdamW in test_optimizer_contract.variants()
    case = next(c for c in test_recipe.our_cases() if c[0] == "ours-ThrowawayAdamW")
    assert case[1] == [f"optimizer={COMPONENT}"] and case[2] is None  # runs, and fails until losses are recorded
    assert COMPONENT in [p.values[0] for p in test_optimizers_dtensor.variant_params()]
    assert COMPONENT in optimizer_step.default_variants()
    assert isinstance(optimizer_step.make_variant(KEY, [torch.nn.Parameter(torch.zeros(8))]), ThrowawayAdamW)
    # and the DTensor check itself runs on it (2 spawned ranks)
    test_optimizers_dtensor.run_sharded(COMPONENT)


def test_compare_resolves_registered_variants(throwaway):
    """bench/compare.py --variants reads optimizers.VARIANTS at call time: by short key and by config path."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import compare

    for name in (KEY, COMPONENT):
        ((variant, overrides),) = compare.resolve_variants(name)
        assert variant == COMPONENT and f"optimizer={COMPONENT}" in overrides
    assert [v[0] for v in compare.resolve_variants("ours8,ours4")] == ["optimizers.AdamW8bit", "optimizers.AdamW4bit"]
