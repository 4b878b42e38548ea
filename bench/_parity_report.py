"""The table and plot of the two loss-parity benchmarks (bench/loss_parity.py, bench/loss_parity_width2048.py).

Both record, per row, a ``label``, ``reference`` (the fp32-master row), ``losses`` (every step), ``heldout_loss``,
``gap_vs_ref`` and ``error``; the plot puts the loss curves beside the held-out gap of each row.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable, List

import _harness as harness


def table(headers: List[str], records: List[dict], cells: Callable[[dict], List[str]]) -> str:
    """One row per record: its label, then cells(r); a failed record shows its error in the last column."""
    failed = ["-"] * (len(headers) - 2)
    return harness.table(headers, [[r["label"]] + (failed + [r["error"]] if r["error"] else cells(r)) for r in records])


def moving_average(values: List[float], window: int) -> List[float]:
    """Trailing mean over up to `window` steps (the per-step loss of a small batch is noisy)."""
    return [sum(values[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def plot(records: List[dict], path: Path, title: str, window: int = 1) -> None:
    plt = harness.pyplot()
    if plt is None:
        return
    many = len(records) > 8
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 7.5 if many else 5), gridspec_kw={"width_ratios": [3, 2]})
    for r in records:
        if r.get("error") or not r.get("losses"):
            continue
        style = dict(color="black", linewidth=2.2) if r["reference"] else dict(linewidth=1.1)
        ax.plot(range(1, len(r["losses"]) + 1), moving_average(r["losses"], window), label=r["label"], **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss per step" + (f" ({window}-step moving average)" if window > 1 else ""))
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    ax.grid(alpha=0.3)
    if many:  # below the axes: over the curves it would hide them
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    else:
        ax.legend(fontsize=8)
    ok = [r for r in records if r.get("gap_vs_ref") is not None][::-1]
    ax2.barh(
        [r["label"] for r in ok],
        [100 * r["gap_vs_ref"] for r in ok],
        color=["black" if r["reference"] else "tab:blue" for r in ok],
    )
    for i, r in enumerate(ok):
        ax2.annotate(
            f"{100 * r['gap_vs_ref']:+.1f} %",
            (max(100 * r["gap_vs_ref"], 0), i),
            fontsize=7,
            xytext=(3, -3),
            textcoords="offset points",
        )
    for x in (-1, 1):
        ax2.axvline(x, color="red", linestyle=":", linewidth=1)
    ax2.set_xlabel("held-out loss gap vs fp32 reference, % (red: +-1 %)")
    ax2.tick_params(axis="y", labelsize=7)
    ax2.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")
