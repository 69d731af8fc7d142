"""The one `megatron-rl` command. Every subcommand is a module of this package exposing
`add_arguments(parser)` and `run(args) -> int`; it drives code that lives in the package named for it."""
from __future__ import annotations

import argparse
import errno
import importlib
import io
import os
import signal
import sys
import threading
import warnings

from megatron_rl.config import ConfigError, InfrastructureError
from megatron_rl.observability.logs import configure_logging

# OSErrors about the user's files, directories and disks (a path that is not there, not writable, a
# directory where a file was expected, a full disk), as opposed to a bug of ours.
USER_OS_ERRORS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENOSPC,
                  errno.EDQUOT, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP, errno.EFBIG, errno.EEXIST,
                  errno.ENOTEMPTY}

# name -> (module, one-line help). Only the module of the command being run is imported.
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("megatron_rl.cli.convert", "convert GGUF / HF safetensors <-> Megatron checkpoints (any TP/PP)"),
    "bench": ("megatron_rl.cli.bench", "time our code against its baseline in one run; last line is JSON"),
    "config": ("megatron_rl.cli.config", "print a recipe with overrides applied, or describe every field"),
    "generate": ("megatron_rl.cli.generate", "complete chat prompts with the native rollout engine"),
    "chat": ("megatron_rl.cli.chat", "chat with a model, optionally with a WaltzRL feedback agent in the loop"),
    "serve": ("megatron_rl.cli.serve", "serve the native engine over OpenAI-compatible /v1 and SGLang-native HTTP APIs"),
    "train": ("megatron_rl.cli.train", "run RL training from a YAML recipe (add --resume to continue)"),
    "plan": ("megatron_rl.cli.plan", "validate a cluster layout; per-GPU memory and predicted step time (no GPU)"),
    "parity": ("megatron_rl.cli.parity", "trainer / converter / engine vs transformers for every model family"),
    "eval": ("megatron_rl.cli.eval", "held-out greedy accuracy (and mean@k) of a model or checkpoint"),
    "safety-report": ("megatron_rl.cli.safety_report",
                      "a WaltzRL run's held-out safety before vs after, prompt by prompt, with McNemar p-values"),
}

# What megatron-core says on import where the optional Transformer Engine / Apex are not installed (our
# trainer does not use them): half a dozen lines in front of every command's output, a one-line
# error's included. Only these messages: other warnings still show.
IMPORT_WARNINGS = (r"Transformer Engine and Apex are not installed",
                   r"Apex is not installed")


def quiet_import_warnings() -> None:
    for message in IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `megatron-rl` parser. Only `command`'s module is imported, for its arguments; the others are
    listed by name and help, so `megatron-rl --help` starts without importing torch."""
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_import_warnings()  # before build_parser imports the command's module (and megatron-core)
    configure_logging()
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    previous_sigterm = _stop_cleanly_on_sigterm()
    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except (KeyboardInterrupt, Terminated) as exc:
        if os.environ.get("MEGATRON_RL_DEBUG"):
            raise
        # Checkpoints are committed atomically and the run's finally-blocks have released its engines
        # and shared memory: what is on disk is the last committed step.
        hint = "; the run directory keeps its last checkpoint: continue with --resume" if args.command == "train" else ""
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"megatron-rl {args.command}: {what}{hint}", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except InfrastructureError as exc:
        if os.environ.get("MEGATRON_RL_DEBUG"):
            raise
        hint = "; the run directory keeps its last checkpoint: continue with --resume" if args.command == "train" else ""
        print(f"megatron-rl {args.command}: failed: {_one_line(str(exc))}{hint}", file=sys.stderr)
        return 1
    except Exception as exc:
        message = user_error(exc)
        # Bad input is the user's to fix: one clear line, no traceback (MEGATRON_RL_DEBUG=1 shows it).
        # Anything else is a bug of ours and keeps its traceback.
        if message is None or os.environ.get("MEGATRON_RL_DEBUG"):
            raise
        print(f"megatron-rl {args.command}: error: {_one_line(message)}", file=sys.stderr)
        return 2
    finally:
        if previous_sigterm is not _NOT_INSTALLED:
            signal.signal(signal.SIGTERM, previous_sigterm or signal.SIG_DFL)


class Terminated(BaseException):
    """SIGTERM (a scheduler's preemption, `kill`): raised in the main thread so that the run unwinds like
    on Ctrl-C, closing its engines and freeing its shared memory, instead of dying on the spot."""


_NOT_INSTALLED = object()


def _stop_cleanly_on_sigterm():
    """Install the SIGTERM handler for the command's duration; return the previous handler
    (_NOT_INSTALLED off the main thread, where Python cannot handle signals)."""
    if threading.current_thread() is not threading.main_thread():
        return _NOT_INSTALLED

    def terminate(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminate)


def user_error(exc: BaseException) -> str | None:
    """The one-line message of a user-caused error (bad config, data, checkpoint, file, encoding, full
    disk), or None for anything else."""
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in USER_OS_ERRORS:
        where = exc.filename if exc.filename is not None else "a file"
        if exc.filename2 is not None:
            where = f"{where} -> {exc.filename2}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{where}: {exc.strerror} (the disk is full: free space; a run continues from its last checkpoint with --resume)"
        return f"{where}: {exc.strerror}"
    if isinstance(exc, UnicodeDecodeError):
        return f"{_file_being_decoded(exc) or 'a file'}: not {exc.encoding} text (byte {exc.start}: {exc.reason})"
    if "No space left on device" in str(exc):  # libraries that wrap ENOSPC in their own error (safetensors)
        return (f"{type(exc).__name__}: no space left on device (the disk is full: free space; nothing half-written "
                "is kept, and a run continues from its last checkpoint with --resume)")
    return None


# Characters that end a line (str.splitlines), e.g. in a key or value quoted from the user's file.
_LINE_BREAKS = {c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


def _one_line(message: str) -> str:
    return message.translate(str.maketrans(_LINE_BREAKS))


def _file_being_decoded(exc: UnicodeDecodeError) -> str | None:
    """The name of the text file whose read raised `exc`: the innermost frame holding an open text file
    (a decode error carries the bytes, not the file they came from)."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, io.TextIOWrapper) and isinstance(getattr(value, "name", None), str):
                return value.name
    return None


if __name__ == "__main__":
    sys.exit(main())
