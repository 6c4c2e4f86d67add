"""Progress on long work: rich's bars on a terminal, nothing when piped or asked to be quiet.

A command (or a runner: bench, the conformance runs) opens one display around its long work with
``shown``; whatever runs inside reports to it through ``task`` (a bar of known length: measured
placement's partitions, compile's partitions, bench's rounds) or ``count`` (an open-ended tally:
CpuAcc's routes, measured as its workloads are created, in a number known only at the end). With no
display open, or one that is off (stderr not a terminal, ``quiet``), both do nothing: library code
reports unconditionally, and a library user who opened nothing sees nothing.

    with progress.shown(quiet=args.quiet), progress.task("timed runs", total=10) as step:
        for _ in range(10):
            run()
            step()
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported by the first display: a session opens none (its import cost)
    from rich.console import Console
    from rich.progress import Progress, TaskID

Step = Callable[..., None]
"""``step(description=None, advance=1)``: one more unit done; a description replaces the bar's."""

_lock = threading.Lock()
_open: list[Progress] = []  # the displays open now, innermost last; one shows, the others reuse it
_counts: dict[str, TaskID] = {}  # count()'s tallies on the display open now, by description


@functools.cache
def _done_column() -> type:
    """The column class, made at the first display (it subclasses rich's)."""
    from rich.progress import ProgressColumn, Task
    from rich.text import Text

    class _Done(ProgressColumn):
        """``3/8`` for a bar of known length, ``3`` for an open-ended tally, nothing before the
        first."""

        def render(self, task: Task) -> Text:
            done = int(task.completed)
            if task.total is None:
                return Text(str(done) if done else "", style="progress.download")
            return Text(f"{done}/{int(task.total)}", style="progress.download")

    return _Done


def display(console: Console | None = None, quiet: bool = False) -> Progress:
    """A display on ``console`` (stderr by default), off unless it is a terminal and not ``quiet``;
    transient: gone when done, the output after it starting where it began."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    done: Any = _done_column()()
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), done,
                    TimeElapsedColumn(), console=console, transient=True,
                    disable=quiet or not console.is_terminal)


@contextlib.contextmanager
def shown(console: Console | None = None, quiet: bool = False) -> Iterator[Progress]:
    """The display, open while the block runs; tasks and counts reported inside show on it. Inside
    another ``shown`` the outer display is reused (an outer one that is off keeps the inner off)."""
    if _open:
        yield _open[-1]
        return
    progress = display(console, quiet)
    with progress:
        _open.append(progress)
        try:
            yield progress
        finally:
            _open.remove(progress)
            _counts.clear()


def active() -> Progress | None:
    """The display tasks go to now: None where none is open or the one open is off."""
    return _open[-1] if _open and not _open[-1].disable else None


@contextlib.contextmanager
def task(description: str, total: int | None = None) -> Iterator[Step]:
    """A bar for one piece of work, on the display open now, removed when the block ends; yields
    its ``step``. ``total`` None: no known length (a pulsing bar)."""
    progress = active()
    if progress is None:
        yield _nothing
        return
    task_id = progress.add_task(description, total=total)
    progress.refresh()  # shown now, however short the work (a refresh is otherwise 0.1 s away)

    def step(description: str | None = None, advance: int = 1) -> None:
        progress.update(task_id, advance=advance,
                        **({"description": description} if description else {}))

    try:
        yield step
    finally:
        progress.remove_task(task_id)


def count(description: str) -> None:
    """One more of an open-ended tally on the display open now (it stays until the display ends)."""
    progress = active()
    if progress is None:
        return
    with _lock:
        new = description not in _counts
        if new:
            _counts[description] = progress.add_task(description, total=None)
    progress.advance(_counts[description])
    if new:
        progress.refresh()


def _nothing(description: str | None = None, advance: int = 1) -> None:
    """The step of a task with no display to show it."""
