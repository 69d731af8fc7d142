"""A Chrome-trace / Perfetto timeline of a run's phases (generate, reward, train, weight sync, eval,
checkpoint) per process, written to `RUN_DIR/timeline_rank{R}.json` (open in ui.perfetto.dev or
chrome://tracing). Spans are complete events ("ph": "X") in microseconds since the run started."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Iterator


class Timeline:
    def __init__(self, path: str | None, *, process_name: str = "controller"):
        self.path = path
        self.process_name = process_name
        self._origin = time.perf_counter()
        self._events: list[dict] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def span(self, name: str, category: str = "phase", **args) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), category, **args)

    def add(self, name: str, start: float, end: float, category: str = "phase", **args) -> None:
        event = {"name": name, "cat": category, "ph": "X", "pid": os.getpid(),
                 "tid": threading.get_ident() % 1_000_000, "ts": (start - self._origin) * 1e6,
                 "dur": max(end - start, 0.0) * 1e6}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    def write(self) -> str | None:
        if self.path is None:
            return None
        meta = [{"name": "process_name", "ph": "M", "pid": os.getpid(), "args": {"name": self.process_name}}]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": meta + self._events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
        return self.path
