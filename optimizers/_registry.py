"""The registry of our AdamW variants: what the tests, the benches and the docs iterate over.

A new variant is its file (a format and a ~10-line public class) plus one ``register(Variant(...))`` line in
``optimizers/__init__.py``; tests/optimizers/test_optimizer_contract.py fails for a class exported in ``__all__`` but not
registered. No torchtune or Triton import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Variant:
    """One registered optimizer variant (``optimizers.VARIANTS[key]``)."""

    key: str  # short name: the benches' --variants, the loss-parity rows, test ids
    component: str  # the config path, as in ``optimizer._component_=optimizers.AdamW8bit``
    cls: type
    bytes_per_param: float  # optimizer state per parameter (both moments, block scales included)
    state: str  # one line: what it stores
    kwargs: dict = field(default_factory=dict)  # constructor arguments the variant's tests and benches pass
    # Test bounds: relative error of the total update against fp32 torch.optim.AdamW on the spec problem of
    # tests/optimizers/test_optimizers.py (fp32 and bf16 weights) and on the contract tests' few-step problems
    tol_fp32: float = 0.05
    tol_bf16: float = 0.08
    tol_contract: float = 0.05
    exact_codes: bool = True  # the Triton and PyTorch paths write the same codes (integer-coded formats)

    @property
    def overrides(self) -> list:
        """The recipe's command-line overrides that select this variant."""
        return [f"optimizer={self.component}"] + [f"optimizer.{k}={v}" for k, v in self.kwargs.items()]


VARIANTS: dict = {}  # key -> Variant, in registration order


def register(variant: Variant) -> Variant:
    """Add ``variant`` to ``VARIANTS`` (a ValueError if its key is taken) and return it."""
    if variant.key in VARIANTS:
        raise ValueError(
            f"an optimizer variant is already registered as {variant.key!r}: {VARIANTS[variant.key].component}"
        )
    VARIANTS[variant.key] = variant
    return variant
