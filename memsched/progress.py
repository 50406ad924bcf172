"""A rich progress bar for training loops: loss, step time, tokens/s and H2D/D2H bytes per step."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from policies.units import format_bytes


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

    Raises:
        ValueError: ``total_steps`` is not a positive int.
    """

    def __init__(self, total_steps: int, *, description: str = "training",
                 console: Console | None = None) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            TextColumn("{task.fields[step_time]}/step"),
            TextColumn("{task.fields[tokens_per_s]} tok/s"),
            TextColumn("H2D {task.fields[h2d]} D2H {task.fields[d2h]} /step"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task: TaskID = self.progress.add_task(description, total=total_steps, loss="-", step_time="-",
                                                   tokens_per_s="-", h2d="-", d2h="-")

    def update(self, stats: StepStats) -> None:
        """Advance one step and show its figures."""
        self.progress.update(
            self.task, advance=1, loss=f"{stats.loss:.3f}", step_time=f"{stats.seconds:.2f} s",
            tokens_per_s=f"{stats.tokens_per_s:,.0f}", h2d=format_bytes(stats.h2d_bytes),
            d2h=format_bytes(stats.d2h_bytes),
        )

    def __enter__(self) -> TrainingProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
