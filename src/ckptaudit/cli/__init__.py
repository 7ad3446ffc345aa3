"""The command line: argument parsing and exit codes, nothing else (the parser in :mod:`ckptaudit.cli.parser`, one
function per command in :mod:`ckptaudit.cli.commands`, the report's way out in :mod:`ckptaudit.cli.output`).

Exit codes: 0 nothing at or above the fail level; 1 findings at or above it; 2 usage or I/O error.
Reports go to stdout (or ``--output``); progress and diagnostics to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ckptaudit.cli.output import EXIT_USAGE, PipeSafe, silence_stdout
from ckptaudit.cli.parser import SERVING_DTYPES, ArgumentError, UsageError, build_parser, command_of, parse

__all__ = ["SERVING_DTYPES", "main"]


def _parser() -> argparse.ArgumentParser:
    """The whole parser, every command's flags built (what the docs' and the option table's tests read)."""
    return build_parser()


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    out = PipeSafe(stdout or sys.stdout)
    stderr = stderr or sys.stderr
    try:
        return _main(argv, out, stderr)
    finally:
        if out.broken and stdout is None:
            silence_stdout()


def _main(argv: Sequence[str] | None, stdout: Any, stderr: TextIO) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    parser = build_parser(command_of(argv))
    try:
        args = parse(parser, argv)
    except ArgumentError as exc:
        exc.parser.print_usage(stderr)
        stderr.write(f"{exc.parser.prog}: error: {exc}\n")
        return EXIT_USAGE
    except SystemExit as exc:  # --help and --version exit 0
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if not args.command:
        parser.print_help(stderr)
        return EXIT_USAGE
    from ckptaudit.cli.commands import COMMANDS, NEEDS_TORCH
    from ckptaudit.extras import torch_missing, torch_older_than_tested

    if args.command in NEEDS_TORCH:
        missing = torch_missing(f"ckptaudit {args.command}")
        if missing is not None:
            stderr.write(f"ckptaudit {args.command}: error: {missing}\n")
            return EXIT_USAGE
        old = torch_older_than_tested(f"ckptaudit {args.command}")
        if old is not None:
            stderr.write(f"warning: {old}\n")
    args.diagnostics = stderr  # where output.emit says the verdict when the report goes to --output
    try:
        return COMMANDS[args.command](args, stdout, stderr)
    except ModuleNotFoundError as exc:  # a path into torch not foreseen above (the audit under torchrun)
        if exc.name != "torch" and not (exc.name or "").startswith("torch."):
            raise
        stderr.write(f"ckptaudit {args.command}: error: {torch_missing(f'ckptaudit {args.command}') or exc}\n")
        return EXIT_USAGE
    except UsageError as exc:
        stderr.write(f"ckptaudit {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except BrokenPipeError:
        if not (isinstance(stdout, PipeSafe) and stdout.broken):
            raise
        return EXIT_USAGE  # output cut short before a verdict: an I/O error, and nobody left to tell
    except PermissionError as exc:
        stderr.write(f"ckptaudit {args.command}: error: {exc.filename}: permission denied\n")
        return EXIT_USAGE
    except OSError as exc:  # the top-level path itself cannot be read (files inside become findings)
        where = f"{exc.filename}: " if exc.filename else ""
        stderr.write(f"ckptaudit {args.command}: error: {where}{exc.strerror or exc}\n")
        return EXIT_USAGE
    except MemoryError:
        stderr.write(f"ckptaudit {args.command}: error: out of memory; please report the checkpoint that caused "
                     "it (readers are meant to check every declared size first)\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        stderr.write("interrupted\n")
        return 130

