"""Why a run stops before its end: a stop signal (SIGTERM, SIGUSR1: save at the next step boundary, exit 0) or too
many non-finite steps in a row (a one-line error, after the last good checkpoint)."""

import signal
from typing import Any, Dict, Optional

from tqdm import tqdm

from recipes._checkpoint import NonFiniteStop

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """Records a stop signal; the training loop saves and stops at the next step boundary.

    ``with StopSignal() as stop:`` installs the handlers for the loop and restores the previous ones after."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    @property
    def received(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> Optional[str]:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def _on_signal(self, signum, frame) -> None:
        self.signum = signum
        tqdm.write(f"{signal.Signals(signum).name}: saving a checkpoint at the end of this step, then stopping")

    def __enter__(self) -> "StopSignal":
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class SkipCounter:
    """Non-finite steps: counted in total (kept across a resume) and in a row; ``max_in_a_row`` in a row stop."""

    def __init__(self, max_in_a_row: int, log, skipped: int = 0):
        self.max_in_a_row, self.log = max_in_a_row, log
        self.skipped, self.in_a_row = skipped, 0

    def count(self, skipped: bool, step: int, loss: float, grad_norm: Optional[float]) -> None:
        """After step ``step`` (1-based): a skipped step is counted and warned about; a good one resets the row."""
        if not skipped:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        self.log.warning(f"step {step}: loss {loss}, grad norm {grad_norm}: not finite, step skipped (no optimizer "
                         f"update; {self.in_a_row} in a row)")
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteStop(
                f"{self.in_a_row} steps in a row had a non-finite loss or gradient (last: step {step}, loss {loss}, "
                f"grad norm {grad_norm}): training diverged; resume from the last checkpoint with a lower optimizer.lr "
                f"or clip_grad_norm=1.0 (max_consecutive_skipped_steps={self.max_in_a_row} sets the limit)")
