"""The command line: argument parsing and exit codes, nothing else.

Exit codes: 0 nothing at or above the fail level; 1 findings at or above it; 2 usage or I/O error.
Reports go to stdout (or ``--output``); progress and diagnostics to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from ckptaudit import __version__
from ckptaudit.model import ComponentKind, Report, Severity

__all__ = ["main"]

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments or an unusable path: exit code 2, message on stderr."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptaudit",
        description="Is this checkpoint really my training state, and can I resume from it?",
    )
    p.add_argument("--version", action="version", version=f"ckptaudit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    a = sub.add_parser("audit", help="audit a checkpoint offline (file or directory)")
    a.add_argument("path", help="checkpoint file or directory")
    _output_args(a)
    a.add_argument("--master-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the master dtype parameters are held to (auto: read it from the checkpoint)")
    a.add_argument("--expect", default="training", choices=["training", "serving"],
                   help="what the checkpoint is meant to be (default: training)")
    a.add_argument("--require", default="",
                   help="comma-separated components whose absence is an error: scheduler,rng,data-progress")

    d = sub.add_parser("demo", help="run the whole story on the built-in recipe (CPU, 2 ranks)")
    d.add_argument("--out", default="ckptaudit-demo", help="directory for checkpoints and reports")
    d.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    d.add_argument("--steps", type=int, default=8, help="training steps before the checkpoint")

    pr = sub.add_parser("probe", help="run a recipe with the live probe: masters, compute copies, saved state")
    pr.add_argument("--recipe", default="ckptaudit.recipes.tinygpt:recipe",
                    help="module:attr or path/to/file.py:attr of the recipe (default: the built-in tiny GPT)")
    pr.add_argument("--exporter", default="ckptaudit.exporters:documented",
                    help="module:attr of the exporter under test (default: get_state_dict + DCP save)")
    pr.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    pr.add_argument("--steps", type=int, default=4, help="training steps before the probe and the save")
    pr.add_argument("--out", help="keep the saved checkpoint under this directory (default: a temporary one)")
    pr.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are stopped")
    _output_args(pr)
    return p


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="table", choices=["table", "json", "html"], help="report format")
    p.add_argument("--output", "-o", help="write the report to this file instead of stdout")
    p.add_argument("--fail-on", default="error", choices=["error", "warning", "info"],
                   help="exit 1 when a finding reaches this severity (default: error)")
    p.add_argument("--verbose", "-v", action="store_true", help="list every finding and tensor")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _require(text: str) -> frozenset[ComponentKind]:
    kinds: set[ComponentKind] = set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            kinds.add(ComponentKind(item))
        except ValueError:
            choices = ", ".join(k.value for k in ComponentKind)
            raise UsageError(f"--require: unknown component {item!r}; choose from {choices}") from None
    return frozenset(kinds)


def _emit(report: Report, args: argparse.Namespace, stdout: TextIO) -> int:
    from ckptaudit.report import OutputFormat, render

    fmt = OutputFormat(args.format)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                render(report, fmt, fh, verbose=args.verbose)
        except OSError as exc:
            raise UsageError(f"--output {args.output}: cannot write ({exc.strerror})") from None
    else:
        render(report, fmt, stdout, verbose=args.verbose)
    return EXIT_FINDINGS if report.fails(Severity.parse(args.fail_on)) else EXIT_CLEAN


def _progress(enabled: bool, stderr: TextIO):  # type: ignore[no-untyped-def]
    if not enabled or not stderr.isatty():
        return None, None
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    prog = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), transient=True)
    task = prog.add_task("scanning", total=None)

    def update(done: int, total: int) -> None:
        prog.update(task, completed=done, total=total)

    return prog, update


def _cmd_audit(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.audit import AuditOptions, audit

    if not os.path.exists(args.path):
        raise UsageError(f"{args.path}: no such file or directory; give the path of a checkpoint file or directory")
    options = AuditOptions(master_dtype=args.master_dtype, expect=args.expect, require=_require(args.require))
    prog, update = _progress(not args.no_progress, stderr)
    if prog is not None:
        with prog:
            report = audit(args.path, options, progress=update)
    else:
        report = audit(args.path, options)
    return _emit(report, args, stdout)


def _cmd_demo(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.demo import run_demo

    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    return run_demo(args.out, nproc=args.nproc, steps=args.steps, out=stdout, err=stderr).exit_code


def _cmd_probe(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.dist.launch import DistributedError
    from ckptaudit.probe.run import run_probe

    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    if args.steps < 0:
        raise UsageError(f"--steps must be 0 or more, got {args.steps}")
    stderr.write(f"probing {args.recipe} on {args.nproc} rank(s): {args.steps} steps, then saving through "
                 f"{args.exporter}...\n")
    try:
        report = run_probe(args.recipe, args.exporter, nproc=args.nproc, steps=args.steps, out_dir=args.out,
                           timeout_s=args.timeout)
    except ValueError as exc:
        raise UsageError(f"{exc}") from None
    except DistributedError as exc:
        raise UsageError(f"the probed job failed: {exc}") from None
    return _emit(report, args, stdout)


COMMANDS = {"audit": _cmd_audit, "demo": _cmd_demo, "probe": _cmd_probe}


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    parser = _parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if not args.command:
        parser.print_help(stderr)
        return EXIT_USAGE
    try:
        return COMMANDS[args.command](args, stdout, stderr)
    except UsageError as exc:
        stderr.write(f"ckptaudit {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except PermissionError as exc:
        stderr.write(f"ckptaudit {args.command}: error: {exc.filename}: permission denied\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
