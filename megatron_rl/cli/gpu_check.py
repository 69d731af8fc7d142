"""One-GPU check of the cluster path, in sections that each fit a time budget (docs/gpu.md).

    python -m megatron_rl.cli.gpu_check [--out FILE] [--smoke] [--deadline-s S]   (scripts/gpu_check.sh runs it)
    python -m megatron_rl.cli.gpu_check --plan [--deadline-s S]                   the sections and their budgets
    python -m megatron_rl.cli.gpu_check --rehearse MODE --budget-scale F ...     every section stubbed (tests)

The sections run in the order of what a short lease most needs to learn, each in a process of its own
(cli/gpu_sections.py) under its own budget, so a hang, a crash or a CUDA error in one costs that section only,
and the device's memory is handed back when the process ends. After each section the JSON file is rewritten
whole (a lease cut short still leaves what ran), and the last line printed is the same JSON object. A
section gets `min(budget, time left)`; one that cannot get `MIN_START_S` before the deadline is not started.
`sections` records each one's status (ok, failed, timed_out, skipped: does not apply here, not_started:
no time left), budget and wall time; the exit status is 0 only when none failed, timed out or was left
unstarted. This module imports no torch: it holds no device memory of its own.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from megatron_rl.cli import IMPORT_WARNINGS

MIN_START_S = 15.0
TAIL_LINES = 20
QUIET = [f"-Wignore:{message}:UserWarning" for message in IMPORT_WARNINGS]  # as every megatron-rl command


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    budget_s: float
    what: str


# in the order of value to a first lease; the budgets add up to 560 s. On the H200 a section's start (a fresh
# interpreter importing torch, megatron-core and transformers) alone took 20 to 25 s (docs/gpu.md).
SECTIONS = (
    Section("env", 45, "GPU, driver, CUDA, torch, free memory, package versions; copy and matmul peaks"),
    Section("decode", 90, "native engine decode, bf16, batch 32 x 128 new tokens, against HF generate"),
    Section("train_bf16", 90, "Megatron trainer step, bf16, local layers, 8 x 2048 tokens: tokens/s, MFU"),
    Section("logprob", 60, "fused Triton log-prob kernel against torch: time, peak memory"),
    Section("weight_sync", 60, "trainer -> engine weight update on the device: GB/s; vLLM's NCCL and IPC senders"),
    Section("sglang", 115, "SGLang server: start, generate, one weight update through our sender, read-back"),
    Section("te_fp8", 40, "Transformer Engine FP8 trainer step (where TE passes its self-test)"),
    Section("packing", 60, "packed (THD) rows against padded rows: log-probs and a training step"),
)
REHEARSALS = ("ok", "fail", "timeout", "crash", "mixed")


def plan(deadline_s: float, budget_scale: float = 1.0) -> dict:
    sections = [{"name": s.name, "budget_s": s.budget_s * budget_scale, "what": s.what} for s in SECTIONS]
    return {"sections": sections, "planned_s": sum(s["budget_s"] for s in sections), "deadline_s": deadline_s}


def _stub(mode: str, index: int) -> list[str]:
    """A stand-in for a section's process (`--rehearse`): it writes a result, fails, hangs or dies."""
    if mode == "mixed":
        mode = ("ok", "fail", "timeout", "crash")[index % 4]
    code = {"ok": "import json, sys; json.dump({'stub': True}, open(sys.argv[1], 'w'))",
            "fail": "raise RuntimeError('stubbed section failure')",
            "timeout": "import time; print('hanging', flush=True); time.sleep(3600)",
            "crash": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"}[mode]
    return [sys.executable, "-c", code]


def _run_section(command: list[str], out_path: str, budget_s: float) -> tuple[str, dict | None, str]:
    """Run one section's process in its own session; (status, its JSON or None, the last line it printed)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, bufsize=1)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def copy() -> None:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip())
    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        process.wait(timeout=budget_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=5)
    last = next((line for line in reversed(tail) if line.strip()), "")
    if timed_out:
        return "timed_out", None, last
    result = None
    if process.returncode == 0 and os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
    if result is None:
        code = process.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return "failed", {"error": f"{how}: {last}" if last else how}, last
    return ("skipped" if "skipped" in result else "ok"), result, last


def _write(result: dict, out: str | None) -> str:
    line = json.dumps({"gpu_check": True, **result}, default=str)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        partial = f"{out}.partial"
        with open(partial, "w") as f:
            f.write(line + "\n")
        os.replace(partial, out)
    return line


def run(deadline_s: float, out: str | None, smoke: bool = False, rehearse: str | None = None,
        budget_scale: float = 1.0) -> int:
    started = time.monotonic()
    deadline = started + deadline_s
    failed: list[str] = []
    result: dict = {"smoke": smoke, "rehearsal": rehearse, "plan": plan(deadline_s, budget_scale), "sections": {},
                    "failed_sections": failed}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        facts = os.path.join(work, "env.json")
        for index, section in enumerate(SECTIONS):
            budget = section.budget_s * budget_scale
            left = deadline - time.monotonic()
            status_of = result["sections"]
            if left < MIN_START_S * budget_scale:
                status_of[section.name] = {"status": "not_started", "budget_s": budget,
                                           "why": f"{left:.0f} s left before the deadline"}
                failed.append(section.name)
                _write(result, out)
                continue
            budget = min(budget, left)
            out_path = os.path.join(work, f"{section.name}.json")
            command = (_stub(rehearse, index) + [out_path] if rehearse else
                       [sys.executable, *QUIET, "-m", "megatron_rl.cli.gpu_sections", section.name, "--facts", facts,
                        "--out", out_path, "--budget-s", f"{budget:.0f}", *(["--smoke"] if smoke else [])])
            print(f"[gpu_check] {section.name}: {section.what} (budget {budget:.0f} s)", flush=True)
            begin = time.monotonic()
            status, data, last = _run_section(command, out_path, budget)
            wall = time.monotonic() - begin
            status_of[section.name] = {"status": status, "budget_s": round(budget, 1), "wall_s": round(wall, 1)}
            if status == "timed_out":
                data = {"error": f"timed out after {budget:.0f} s" + (f"; last output: {last}" if last else "")}
            if data is not None:
                result[section.name] = data
            if status in ("failed", "timed_out"):
                failed.append(section.name)
            if section.name == "env" and status == "ok":
                with open(facts, "w") as f:
                    json.dump(data, f)
            _write(result, out)
    result["wall_s"] = round(time.monotonic() - started, 1)
    print(_write(result, out), flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON file, rewritten after every section")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: every section runs on CPU too")
    parser.add_argument("--deadline-s", type=float, default=sum(s.budget_s for s in SECTIONS),
                        help="seconds from now by which the last section must end (scripts/gpu_check.sh passes "
                             "what its 10 minutes leave after the set-up)")
    parser.add_argument("--plan", action="store_true", help="print the sections and their budgets as JSON")
    parser.add_argument("--rehearse", choices=REHEARSALS, help="run stand-ins instead of the sections (tests)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every budget (rehearsals)")
    args = parser.parse_args(argv)
    if args.plan:
        print(json.dumps(plan(args.deadline_s, args.budget_scale)))
        return 0
    return run(args.deadline_s, args.out, smoke=args.smoke, rehearse=args.rehearse, budget_scale=args.budget_scale)


if __name__ == "__main__":
    raise SystemExit(main())
