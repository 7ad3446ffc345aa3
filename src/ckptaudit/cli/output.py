"""Where a command's report goes: rendered to stdout (a pipe whose reader may leave) or to ``--output``, the exit
code from its verdict; the progress bar on stderr."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import TYPE_CHECKING, Any, TextIO

from ckptaudit.cli.parser import UsageError

if TYPE_CHECKING:  # imported by the commands that run: ``--help`` needs none of it
    from ckptaudit.findings import RawReport

__all__ = ["EXIT_CLEAN", "EXIT_FINDINGS", "EXIT_USAGE", "PipeSafe", "emit", "progress_bar", "silence_stdout"]

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class PipeSafe:
    """``stdout`` whose reader may go away (``ckptaudit audit X --verbose | head``). The write that finds the pipe
    closed marks it ``broken`` and raises :class:`BrokenPipeError`, and so does every later write, so that a
    renderer stops at its next batch instead of formatting rows nobody reads; :func:`emit` then returns the
    verdict's exit code, with no error text."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self.broken = False

    def write(self, text: str) -> int:
        if self.broken:
            raise BrokenPipeError(errno.EPIPE, "the reader of stdout has gone")
        try:
            return self._out.write(text)
        except BrokenPipeError:
            self.broken = True
            raise

    def flush(self) -> None:
        if self.broken:
            return
        try:
            self._out.flush()
        except BrokenPipeError:
            self.broken = True
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def silence_stdout() -> None:
    """After a closed pipe: point fd 1 at /dev/null, so that the interpreter's final flush finds no pipe either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def emit(report: RawReport, args: argparse.Namespace, stdout: TextIO) -> int:
    from ckptaudit.report import OutputFormat, render

    fmt = OutputFormat(args.format)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                render(report, fmt, fh, verbose=args.verbose)
        except OSError as exc:
            raise UsageError(f"--output {args.output}: cannot write ({exc.strerror})") from None
        # The report went to a file: the one-line verdict still reaches the terminal (or the CI log).
        diagnostics = getattr(args, "diagnostics", None)
        if diagnostics is not None:
            diagnostics.write(f"{report.path}: {report.summary} (report: {args.output})\n")
    else:
        try:
            render(report, fmt, stdout, verbose=args.verbose)
        except BrokenPipeError:  # the reader has gone (`| head`): what it read is all it wanted
            if not (isinstance(stdout, PipeSafe) and stdout.broken):
                raise
    from ckptaudit.findings import Severity

    return EXIT_FINDINGS if report.fails(Severity.parse(args.fail_on)) else EXIT_CLEAN


def progress_bar(enabled: bool, stderr: TextIO):  # type: ignore[no-untyped-def]
    if not enabled or not stderr.isatty():
        return None, None
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    prog = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), transient=True)
    task = prog.add_task("scanning", total=None)

    def update(done: int, total: int) -> None:
        prog.update(task, completed=done, total=total)

    return prog, update
