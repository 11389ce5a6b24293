"""Progress wherever a job takes more than a few seconds (issue 50): a Rich progress bar on a terminal;
elsewhere (a pipe, a log file, a CI job) one line every 30 s to stderr with done/total, rate and ETA,
and a last line when the job ends. Ctrl-C says whether a rerun resumes (exit 130)."""

from __future__ import annotations

import os
import sys
import threading
import time

import typer

EVERY_ENV = "PRIVALIGN_PROGRESS_SECONDS"  # the interval of the lines off a terminal (default 30)
STARTS_OVER = "interrupted: nothing was written (results are written whole at the end); a rerun starts over"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


class LineProgress:
    """Rich ``Progress``'s interface (``add_task``, ``update``) printed as lines to stderr: every
    ``every`` seconds, whether or not anything advanced, and once when the job ends."""

    def __init__(self, every: float, stream=None):
        self.every, self.stream = every, stream or sys.stderr
        self.tasks: dict[int, dict] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, kind, *_):
        self._stop.set()
        self._thread.join()
        if kind is None:
            self._say("done")
        return False

    def add_task(self, description: str, total=None, **fields) -> int:
        with self._lock:
            key = len(self.tasks)
            self.tasks[key] = {"description": description, "total": total, "completed": 0, "fields": fields,
                               "t0": time.monotonic()}
        return key

    def update(self, key: int, *, completed=None, total=None, advance=None, description=None, **fields) -> None:
        with self._lock:
            t = self.tasks[key]
            if completed is not None:
                t["completed"] = completed
            if advance is not None:
                t["completed"] += advance
            if total is not None:
                t["total"] = total
            if description is not None:
                t["description"] = description
            t["fields"].update(fields)

    def line(self, t: dict, state: str = "") -> str:
        elapsed = time.monotonic() - t["t0"]
        done, total = t["completed"], t["total"]
        if not total and not done:  # a job with no count: that it still works, and for how long
            return f"{t['description']}: {'finished' if state else 'working'}, {_clock(elapsed)} elapsed"
        parts = [f"{t['description']}: {done:g}/{total:g}" if total else f"{t['description']}: {done:g} done"]
        rate = done / elapsed if elapsed > 0 else 0.0
        parts.append(f"{rate:.3g}/s")
        if state:
            parts.append(f"{state} in {_clock(elapsed)}")
        elif total and rate > 0:
            parts.append(f"ETA {_clock((total - done) / rate)}")
        else:
            parts.append(f"{_clock(elapsed)} elapsed")
        info = t["fields"].get("info")
        return ", ".join(parts) + (f" ({info})" if info else "")

    def _say(self, state: str = "") -> None:
        with self._lock:
            lines = [self.line(t, state) for t in self.tasks.values()]
        for line in lines:
            print(line, file=self.stream, flush=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self._say()


class _Guarded:
    """A progress display that turns Ctrl-C into one line saying whether a rerun resumes, exit 130."""

    def __init__(self, inner, on_interrupt: str):
        self.inner, self.on_interrupt = inner, on_interrupt

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, kind, value, tb):
        self.inner.__exit__(kind, value, tb)
        if kind is KeyboardInterrupt:
            print(self.on_interrupt, file=sys.stderr, flush=True)
            raise typer.Exit(130)
        return False


def progress(console, columns, on_interrupt: str = STARTS_OVER):
    """A Rich progress bar with ``columns`` on a terminal, else ``LineProgress``; Ctrl-C says
    ``on_interrupt`` and exits 130."""
    if console.is_terminal:
        from rich.progress import Progress

        inner = Progress(*columns, console=console)
    else:
        inner = LineProgress(float(os.environ.get(EVERY_ENV, "30")))
    return _Guarded(inner, on_interrupt)


class _Working:
    """A job with no count of its own: a spinner on a terminal, else a line every 30 s saying it still works."""

    def __init__(self, console, description: str):
        self.console, self.description = console, description

    def __enter__(self):
        if self.console.is_terminal:
            self.inner = self.console.status(self.description)
        else:
            self.inner = LineProgress(float(os.environ.get(EVERY_ENV, "30")))
            self.inner.add_task(self.description)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def working(console, description: str, on_interrupt: str = STARTS_OVER):
    return _Guarded(_Working(console, description), on_interrupt)
