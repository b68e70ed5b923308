"""How a run stops early on its own: SIGTERM (:class:`Preemption`) and a non-finite loss (:class:`NonFiniteLoss`).

Light on purpose (no torch_xla): ``fit`` enters :class:`Preemption` before the runtime starts.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)

#: Fault injection for tests: the loop sends its own process a real SIGTERM right after dispatching this step.
SIGTERM_AT_STEP_ENV = "SPMD_RFDETR_TEST_SIGTERM_AT_STEP"


class NonFiniteLoss(RuntimeError):
    """Training stopped: a step's loss or gradient norm was NaN/inf (``trainer.on_nonfinite=stop``)."""


class Preemption:
    """SIGTERM (what a spot/preemptible TPU VM gets, about 30 s before it stops) while ``fit`` runs.

    Until :meth:`first_step_done` there is nothing to save (start-up, the data check, the first step's compile, which
    takes minutes): SIGTERM ends the process at once with a message and exit code 143. That works while XLA compiles
    too: Python runs signal handlers only between the main thread's bytecodes, so a thread woken by
    ``signal.set_wakeup_fd`` ends it. After the first step SIGTERM only sets :attr:`requested`: the loop finishes the
    current step, saves and returns. The previous handler and wakeup fd are restored on exit.
    """

    EXIT_CODE = 128 + signal.SIGTERM

    def __init__(self, resume_hint: str = "") -> None:
        self.requested = False
        self.saves = False  # False: SIGTERM exits at once (nothing to save yet)
        self.resume_hint = resume_hint
        self._exiting = threading.Lock()
        self._sigterm_at = int(os.environ.get(SIGTERM_AT_STEP_ENV, "0"))

    def first_step_done(self) -> None:
        """From now on SIGTERM saves a checkpoint after the current step."""
        self.saves = True

    def _exit_now(self) -> None:
        if self._exiting.acquire(blocking=False):
            print(f"SIGTERM before the first step finished: nothing to save, exiting now. {self.resume_hint}",
                  file=sys.stderr, flush=True)
            os._exit(self.EXIT_CODE)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.saves:
            self._exit_now()
        self.requested = True
        log.warning("SIGTERM received: finishing the current step, then saving a checkpoint")

    def _watch(self, read_fd: int) -> None:
        """Thread body: wake on every signal byte; SIGTERM before the first step exits even mid-compile."""
        with open(read_fd, "rb", buffering=0) as wakeups:
            while data := wakeups.read(64):  # b"": the write end was closed (__exit__)
                if signal.SIGTERM in data and not self.saves:
                    self._exit_now()

    def __enter__(self) -> Preemption:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="sigterm-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGTERM, self._previous)
        os.close(self._write_fd)  # the watcher reads EOF and ends

    def inject(self, step: int) -> None:
        """Fault injection (:data:`SIGTERM_AT_STEP_ENV`): a real SIGTERM to this process right after ``step``."""
        if step == self._sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)

    @staticmethod
    def stopped(step: int, saved: Path) -> Path:
        """Say that SIGTERM stopped the run after ``step`` and where it saved; returns ``saved``."""
        print(f"stopped by SIGTERM after step {step}: saved {saved}; continue with --trainer.resume auto", flush=True)
        return saved
