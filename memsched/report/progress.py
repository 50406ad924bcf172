"""Training progress: loss, step time, tokens/s and H2D/D2H bytes per step.

On a terminal (or in a notebook) a rich progress bar. Anywhere else (a log file, CI) a bar redrawn in place
means nothing, and rich would print only its last state; there the progress is one plain log line every few
steps instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from memsched.report.console import make_console
from policies.units import format_bytes

#: Log lines a run prints when not on a terminal, besides the first step's: one every ``total / LOG_LINES``
#: steps (at least every step), and the last step always.
LOG_LINES = 10


@dataclass(frozen=True)
class StepStats:
    """What one training step did.

    Attributes:
        loss: training loss of the step (nats per token).
        seconds: wall time of the step (forward, backward, optimizer), seconds.
        tokens: tokens processed in the step.
        h2d_bytes: host-to-device bytes copied in the step, bytes.
        d2h_bytes: device-to-host bytes copied in the step, bytes.
    """

    loss: float
    seconds: float
    tokens: int
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class TrainingProgress:
    """``with TrainingProgress(total_steps) as bar: ... bar.update(StepStats(...))``.

    Args:
        total_steps: steps the run will take (> 0).
        description: the bar's (or each log line's) first word.
        console: where to draw (default: a new stdout console).
        log_every: when the console is not a terminal, print a line every this many steps (and at the first
            and the last step); default ``ceil(total_steps / LOG_LINES)``.

    Raises:
        ValueError: ``total_steps`` or ``log_every`` is not a positive int (names the value).
    """

    def __init__(self, total_steps: int, *, description: str = "training",
                 console: Console | None = None, log_every: int | None = None) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
        if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int)
                                      or log_every <= 0):
            raise ValueError(f"log_every must be a positive int or None, got {log_every!r}")
        self.console = console or make_console()
        self.total = total_steps
        self.description = description
        self.log_every = log_every or max(1, math.ceil(total_steps / LOG_LINES))
        self.step = 0
        self._t0 = 0.0
        # A bar needs a cursor that can go back up: a terminal, or a notebook's widget.
        self.logging = not (self.console.is_terminal or self.console.is_jupyter)
        self.progress: Progress | None = None
        if self.logging:
            return
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            TextColumn("{task.fields[step_time]}/step"),
            TextColumn("{task.fields[tokens_per_s]} tok/s"),
            TextColumn("H2D {task.fields[h2d]} D2H {task.fields[d2h]} /step"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task: TaskID = self.progress.add_task(description, total=total_steps, loss="-", step_time="-",
                                                   tokens_per_s="-", h2d="-", d2h="-")

    def update(self, stats: StepStats) -> None:
        """Advance one step and show its figures."""
        self.step += 1
        fields = {"loss": f"{stats.loss:.3f}", "step_time": f"{stats.seconds:.2f} s",
                  "tokens_per_s": f"{stats.tokens_per_s:,.0f}", "h2d": format_bytes(stats.h2d_bytes),
                  "d2h": format_bytes(stats.d2h_bytes)}
        if self.progress is not None:
            self.progress.update(self.task, advance=1, **fields)
            return
        if self.step == 1 or self.step % self.log_every == 0 or self.step == self.total:
            s = int(time.monotonic() - self._t0)
            self.console.print(
                f"{self.description} step {self.step}/{self.total}: loss {fields['loss']}, "
                f"{fields['step_time']}/step, {fields['tokens_per_s']} tok/s, H2D {fields['h2d']} "
                f"D2H {fields['d2h']} /step, elapsed {s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}",
                markup=False, highlight=False, soft_wrap=True)

    def __enter__(self) -> TrainingProgress:
        self._t0 = time.monotonic()
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
