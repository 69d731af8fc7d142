"""A Chrome-trace / Perfetto timeline of a run's phases (generate, reward, train, weight sync, eval,
checkpoint) per process, written to `RUN_DIR/timeline_rank{R}.json` (open in ui.perfetto.dev or
chrome://tracing). Spans are complete events ("ph": "X") in microseconds since the run started.

Trace viewers nest complete events of one track by time and draw spans that overlap without nesting
wrongly, so a span that may overlap others of its kind (concurrent prompt groups being generated) is
given `lane=`: it goes on the first track of that lane family where it overlaps nothing ("generate 0",
"generate 1", ...). The file is rewritten atomically at most every `flush_every_s` seconds as events
arrive, so a killed run keeps its trace up to its last few seconds, and it is always valid JSON.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Iterator

_LANE_TRACK_BASE = 10_000_000  # lane tracks sit above every thread track (thread ident mod 10^6)


class Timeline:
    def __init__(self, path: str | None, *, process_name: str = "controller", flush_every_s: float = 5.0):
        self.path = path
        self.process_name = process_name
        self.flush_every_s = flush_every_s
        self._origin = time.perf_counter()
        self._last_write = self._origin
        self._events: list[dict] = []
        self._lanes: dict[str, list[list[tuple[float, float]]]] = {}  # family -> per lane, its intervals
        self._tracks: dict[int, str] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def span(self, name: str, category: str = "phase", **args) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), category, **args)

    def add(self, name: str, start: float, end: float, category: str = "phase", *, lane: str | None = None,
            **args) -> None:
        """Record one span on the calling thread's track, where spans must nest (the loop's phases
        do); spans that may overlap without nesting name a `lane` family instead."""
        event = {"name": name, "cat": category, "ph": "X", "pid": os.getpid(),
                 "ts": (start - self._origin) * 1e6, "dur": max(end - start, 0.0) * 1e6}
        if args:
            event["args"] = args
        with self._lock:
            if lane is None:
                event["tid"] = threading.get_ident() % 1_000_000
                self._tracks.setdefault(event["tid"], threading.current_thread().name)
            else:
                event["tid"] = self._free_lane(lane, start, end)
            self._events.append(event)
            due = self.path is not None and end - self._last_write >= self.flush_every_s
        if due:
            self.write()

    def _free_lane(self, family: str, start: float, end: float) -> int:
        lanes = self._lanes.setdefault(family, [])
        for index, intervals in enumerate(lanes):
            if all(end <= s or start >= e for s, e in intervals):
                intervals.append((start, end))
                return self._lane_track(family, index)
        lanes.append([(start, end)])
        return self._lane_track(family, len(lanes) - 1)

    def _lane_track(self, family: str, index: int) -> int:
        families = list(self._lanes)
        track = _LANE_TRACK_BASE * (1 + families.index(family)) + index
        self._tracks[track] = f"{family} {index}"
        return track

    def write(self) -> str | None:
        if self.path is None:
            return None
        pid = os.getpid()
        with self._lock:
            meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": self.process_name}}]
            meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                     for tid, name in sorted(self._tracks.items())]
            events = meta + list(self._events)
            self._last_write = time.perf_counter()
        tmp = f"{self.path}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
        return self.path
