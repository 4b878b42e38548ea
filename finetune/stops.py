"""Why a run stops before its end: a stop signal (SIGTERM, SIGUSR1: save at the next step boundary, exit 0) or too
many non-finite steps in a row (a one-line error, after the last good checkpoint).

Under torchrun the signal reaches a rank through its launcher: ``recipes/launch.py`` passes it on and waits for the
save, and ``launch.follow_launcher`` makes a rank whose launcher dies outright stop the same way.
"""

import signal
import sys
from pathlib import Path
from typing import Any, Dict, Optional

from tqdm import tqdm

from finetune.base import BadInput, NonFiniteStop, diverged_fix

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """Records a stop signal; the training loop saves and stops at the next step boundary.

    ``with StopSignal() as stop:`` installs the handlers for the loop and restores the previous ones after;
    ``install()`` / ``uninstall()`` do the same for a recipe that listens from its setup on (a signal that arrives
    before the first step then stops the run after setup, with nothing to save).

    Ctrl-C (SIGINT) keeps Python's meaning, a KeyboardInterrupt at once, but is also remembered: Python raises it in
    whatever code runs next on the main thread, and when that is a finalizer or a weakref callback (a checkpoint
    writer's thread object being freed is one) Python prints "Exception ignored ... KeyboardInterrupt" and training
    goes on as if no Ctrl-C came. While installed, that message is not printed (``sys.unraisablehook``) and
    ``check_ctrl_c()``, at every step boundary, raises the KeyboardInterrupt again there."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.ctrl_c = False
        self._previous: Dict[int, Any] = {}
        self._unraisablehook = None

    @property
    def received(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> Optional[str]:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def _on_signal(self, signum, frame) -> None:
        self.signum = signum
        tqdm.write(f"{signal.Signals(signum).name}: stopping at the next step boundary, after a checkpoint")

    def _on_ctrl_c(self, signum, frame) -> None:
        self.ctrl_c = True
        raise KeyboardInterrupt

    def _on_unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.ctrl_c:
            return  # our Ctrl-C, swallowed where Python cannot raise: check_ctrl_c raises it
        self._unraisablehook(unraisable)

    def check_ctrl_c(self) -> None:
        """At a step boundary: a Ctrl-C whose KeyboardInterrupt was swallowed on its way (above) is raised here."""
        if self.ctrl_c:
            raise KeyboardInterrupt

    def install(self) -> "StopSignal":
        handlers = {sig: self._on_signal for sig in STOP_SIGNALS}
        # Ctrl-C only where it has Python's default meaning: a process that ignores SIGINT (nohup, a shell's
        # background job) or whose SIGINT a caller handles keeps that.
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            handlers[signal.SIGINT] = self._on_ctrl_c
        for sig, handler in handlers.items():
            if sig in self._previous:
                continue
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        if signal.SIGINT in self._previous and self._unraisablehook is None:
            self._unraisablehook, sys.unraisablehook = sys.unraisablehook, self._on_unraisable
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._unraisablehook is not None:
            sys.unraisablehook, self._unraisablehook = self._unraisablehook, None

    def __enter__(self) -> "StopSignal":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


class SkipCounter:
    """Non-finite steps: counted in total and in a row (both kept across a resume, so a run interrupted now and then
    still meets its limit); ``max_in_a_row`` in a row stop. A step with no trained token at all (every label masked)
    is non-finite too (0/0), and when that is why, the stop says so rather than blame the lr."""

    def __init__(self, max_in_a_row: int, log, skipped: int = 0):
        self.max_in_a_row, self.log = max_in_a_row, log
        self.skipped, self.in_a_row, self.empty_in_a_row = skipped, 0, 0
        # The checkpoint the run resumed from while it has written none since (the recipe clears it at its first
        # save): the stop then names it as a possible cause (finetune.base.diverged_fix)
        self.resumed_from: Optional[Path] = None

    def state(self) -> Dict[str, int]:
        """What a checkpoint keeps (plain ints in recipe_state.pt)."""
        return {"skipped_steps": self.skipped, "skipped_in_a_row": self.in_a_row, "empty_in_a_row": self.empty_in_a_row}

    def restore(self, state: Dict[str, Any], resumed_from: Optional[Path] = None) -> None:
        self.resumed_from = resumed_from
        self.skipped = int(state.get("skipped_steps", 0))
        self.in_a_row = int(state.get("skipped_in_a_row", 0))
        self.empty_in_a_row = int(state.get("empty_in_a_row", 0))

    def count(
        self, skipped: bool, step: int, loss: float, grad_norm: Optional[float], tokens: Optional[int] = None
    ) -> None:
        """After step ``step`` (1-based) with ``tokens`` trained tokens: a skipped step is counted and warned about;
        a good one resets the row."""
        if not skipped:
            self.in_a_row = self.empty_in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        empty = tokens == 0
        self.empty_in_a_row = self.empty_in_a_row + 1 if empty else 0
        if empty:
            self.log.warning(
                f"step {step}: no trained tokens (every label of its samples is masked): step skipped "
                f"({self.in_a_row} in a row)"
            )
        else:
            self.log.warning(
                f"step {step}: loss {loss}, grad norm {grad_norm}: not finite, step skipped (no "
                f"optimizer update; {self.in_a_row} in a row)"
            )
        if self.in_a_row < self.max_in_a_row:
            return
        limit = f"max_consecutive_skipped_steps={self.max_in_a_row} sets the limit"
        if self.empty_in_a_row == self.in_a_row:
            raise BadInput(
                f"{self.in_a_row} steps in a row had no trained tokens (last: step {step}): every label of their "
                "samples is masked, so there is nothing to learn; check the data (empty responses?), "
                "dataset.train_on_input=False (the prompt is masked) and tokenizer.max_seq_len (a response cut off "
                f"entirely) ({limit})"
            )
        raise NonFiniteStop(
            f"{self.in_a_row} steps in a row had a non-finite loss or gradient (last: step {step}, loss {loss}, "
            f"grad norm {grad_norm}): {'training diverged; ' * (self.resumed_from is None)}"
            f"{diverged_fix(self.resumed_from)} ({limit})"
        )
