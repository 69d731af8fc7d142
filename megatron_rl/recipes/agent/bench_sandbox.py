"""`megatron-rl bench sandbox`: the latency of one sandboxed tool call (docs/performance.md).

Ours: `calls` calls of `Sandbox.run_python` and of the calculator's `Sandbox.call`, with every layer this
machine grants, and with the kernel layers off (the fallback); `run_python` through the bubblewrap backend
where `bwrap` is installed. Baseline: what a sandbox without a fork
server pays at the least, a fresh isolated interpreter per call (`python -I -c`), with no containment at
all. `ratio` = the baseline's median / ours (above 1: ours is faster).
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import statistics
import subprocess
import sys
import time

from megatron_rl.recipes.agent.sandbox import Sandbox, SandboxLimits

logger = logging.getLogger(__name__)
CODE = "print(6 * 7)"


def _median_ms(call, calls: int) -> tuple[float, float, float]:
    """Median and quartiles of `calls` timed calls (after one untimed: the fork server's start)."""
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    low, median, high = statistics.quantiles(times, n=4)
    return round(median * 1e3, 2), round(low * 1e3, 2), round(high * 1e3, 2)


def _checked(result):
    if not result.ok:
        raise RuntimeError(f"sandbox call failed: {result.error}")
    return result


def bench_sandbox(options: dict) -> dict:
    calls = int(options.pop("calls", 100))
    if options:
        raise ValueError(f"unknown options: {', '.join(options)}")
    limits = SandboxLimits(wall_time_s=30.0)
    result: dict = {"calls": calls, "containment": list(Sandbox.containment())}
    for name, isolation in (("kernel", True), ("fallback", False)):
        with Sandbox(limits, kernel_isolation=isolation) as box:
            result[f"python_{name}_ms"] = _median_ms(lambda: _checked(box.run_python(CODE)), calls)
            result[f"calculator_{name}_ms"] = _median_ms(
                lambda: _checked(box.call("megatron_rl.recipes.agent.arithmetic:calculate", {"expression": "6*7"})),
                calls)
        logger.info("sandbox (%s): run_python %s ms, calculator %s ms (median, quartiles)", name,
                    result[f"python_{name}_ms"], result[f"calculator_{name}_ms"])
    if shutil.which("bwrap"):
        with Sandbox(dataclasses.replace(limits, backend="bubblewrap")) as box:
            result["python_bubblewrap_ms"] = _median_ms(lambda: _checked(box.run_python(CODE)), calls)
        logger.info("sandbox (bubblewrap): run_python %s ms", result["python_bubblewrap_ms"])
    result["fresh_interpreter_ms"] = _median_ms(
        lambda: subprocess.run([sys.executable, "-I", "-c", CODE], check=True, capture_output=True), calls)
    logger.info("baseline, a fresh interpreter per call: %s ms", result["fresh_interpreter_ms"])
    result["ratio"] = round(result["fresh_interpreter_ms"][0] / result["python_kernel_ms"][0], 3)
    return result
