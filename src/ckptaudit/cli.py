"""The command line: argument parsing and exit codes, nothing else.

Exit codes: 0 nothing at or above the fail level; 1 findings at or above it; 2 usage or I/O error.
Reports go to stdout (or ``--output``); progress and diagnostics to stderr.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from ckptaudit.options import AUDIT_OPTIONS, COMPARE_OPTIONS, FAIL_ON, IGNORE, MASTER_DTYPES, Option, resolve
from ckptaudit.version import __version__

if TYPE_CHECKING:  # imported by the commands that run: ``--help`` needs none of it
    from ckptaudit.findings import RawReport

__all__ = ["main"]

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments or an unusable path: exit code 2, message on stderr."""


class _ArgumentError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the default is empty or the help already states it."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        # argparse makes a formatter for every add_argument, and its default width imports shutil (and bz2, lzma,
        # fnmatch: a few ms of every command's start-up) for shutil.get_terminal_size, whose rule this restates.
        super().__init__(prog, indent_increment, max_help_position, _terminal_columns() - 2 if width is None else width)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or default in (None, False, [], "")
                or default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _terminal_columns() -> int:
    """``shutil.get_terminal_size().columns``: ``COLUMNS`` when a positive number, else the terminal's width, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Parser(argparse.ArgumentParser):
    """Reports usage errors by raising, so ``main`` writes them to its own stderr and returns 2; shows defaults in
    ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgumentError(self, message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ckptaudit",
        description="Is this checkpoint really my training state, and can I resume from it?",
    )
    p.add_argument("--version", action="version", version=f"ckptaudit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    a = sub.add_parser("audit", help="audit a checkpoint offline (file or directory)")
    a.add_argument("path", help="checkpoint file or directory")
    _output_args(a)
    _option_args(a, AUDIT_OPTIONS)
    a.add_argument("--dist-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="under torchrun: how long ranks wait for each other (default 1800)")

    r = sub.add_parser("resume-test", help="differential resume test of exporters on a recipe")
    r.add_argument("--recipe", default="ckptaudit.recipes.tinygpt:recipe",
                   help="module:attr or path.py:attr of the recipe (default: the built-in tiny GPT)")
    r.add_argument("--exporter", action="append", dest="exporters", metavar="MODULE:ATTR",
                   help="exporter under test, module:attr or path.py:attr (repeatable; default "
                   "ckptaudit.exporters:documented)")
    r.add_argument("--nproc", type=int, default=2, help="ranks that train and save (default 2)")
    r.add_argument("--resume-nproc", type=int, metavar="M",
                   help="ranks that resume (default: --nproc); DCP reshards, other exporters go through their loaders")
    r.add_argument("--save-at", type=int, default=8, help="training steps before the checkpoint (default 8)")
    r.add_argument("--steps", type=int, default=8, help="steps after resuming (default 8)")
    r.add_argument("--margin", type=float, default=10.0,
                   help="drift at step k when deviation > margin x the reference's floor at step k (default 10)")
    r.add_argument("--borrow-state", action="store_true",
                   help="restore each candidate over the reference (optimizer, scheduler, RNG, data position "
                   "borrowed from it): judges the parameters alone")
    r.add_argument("--workdir", help="keep the checkpoints here (default: a temporary directory, removed)")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for each phase (default 600)")
    r.add_argument("--export-timeout", type=float, metavar="SECONDS",
                   help="seconds allowed for each candidate's export before it is called hung (default: --timeout)")
    r.add_argument("--debug", action="store_true",
                   help="every frame of the tracebacks of failing user code, not only your own")
    _output_args(r)

    e = sub.add_parser("export-serving", help="export the model weights for serving (bf16/fp16 safetensors) behind "
                       "an output-quality gate, marked as a serving artifact")
    e.add_argument("path", metavar="CKPT", help="the training checkpoint (any format `audit` reads)")
    e.add_argument("--recipe", required=True,
                   help="module:attr or path.py:attr of the recipe: build_model() and the evaluation batch")
    e.add_argument("--dtype", default="bfloat16", choices=SERVING_DTYPES, help="export dtype (default bfloat16)")
    e.add_argument("--out", required=True, help="directory to create for the artifact (must not exist, or be empty)")
    e.add_argument("--keep-fp32", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="glob(s) of tensor names kept in fp32, e.g. '*ln*' '*norm*'")
    e.add_argument("--force", action="store_true",
                   help="write even when the gate fails (the failure is recorded in the metadata; exit code still 1)")
    e.add_argument("--max-shard-size", default="2GiB", help="shard the safetensors above this size (default 2GiB)")
    e.add_argument("--eval-batch", metavar="FILE.pt",
                   help="torch.save file with the batch the recipe's forward takes (default: the recipe's "
                   "eval_batch)")
    e.add_argument("--device", default="cpu", help="where both models run for the gate (default cpu)")
    e.add_argument("--convert", metavar="MODULE:ATTR",
                   help="custom conversion (name, tensor, dtype) -> tensor (default: tensor.to(dtype))")
    e.add_argument("--passport-key", metavar="PRIVATE_KEY",
                   help="sign the artifact's passport with this PEM EC key (default: digest-only; docs/passport.md)")
    g = e.add_argument_group("quality gate thresholds (defaults justified in docs/export-serving.md)")
    g.add_argument("--max-abs-diff", type=float, help="largest absolute output difference")
    g.add_argument("--max-rel-diff", type=float, help="largest output difference relative to the row's max |output|")
    g.add_argument("--min-cosine", type=float, help="smallest per-row cosine similarity of the outputs")
    g.add_argument("--min-top1", type=float, help="smallest share of rows whose top-1 class or token agrees (logits)")
    g.add_argument("--max-loss-diff", type=float,
                   help="largest loss difference (the recipe's eval_loss, or next-token cross-entropy in nats)")
    _output_args(e)

    c = sub.add_parser("compare", help="compare a candidate checkpoint with a reference, tensor by tensor")
    c.add_argument("reference", help="the reference checkpoint (e.g. saved the documented way)")
    c.add_argument("candidate", help="the checkpoint to judge against it (any layout the audit reads)")
    _output_args(c)
    _option_args(c, COMPARE_OPTIONS)

    lt = sub.add_parser("latest", help="the newest resumable checkpoint under a directory, and why newer ones "
                        "are rejected")
    lt.add_argument("root", help="directory or s3://, gs:// prefix holding step-N/, checkpoint-N/, *.pt, *.ckpt ... "
                    "(or one checkpoint)")
    lt.add_argument("--format", default="table", choices=["table", "json"], help="report format")
    lt.add_argument("--output", "-o", help="write the report to this file instead of stdout")
    lt.add_argument("--verify", default="quick", choices=["sizes", "hashes", "quick", "full"],
                    help="sizes: commit markers and file sizes; hashes: also the manifest's hashes where there is "
                    "one (integrity only: precision is not judged); quick (default): also a quick audit, every "
                    "tensor's precision from its first chunk, so a bf16-rounded checkpoint is never LATEST; full: "
                    "run the whole audit on each candidate")
    lt.add_argument("--require", default="",
                    help="comma-separated components whose absence rejects a candidate: scheduler,rng,data-progress; "
                    "passport (or passport=KEY.pub): only a candidate whose passport verifies (docs/passport.md)")
    lt.add_argument("--master-dtype", default="auto", choices=MASTER_DTYPES,
                    help="the master dtype the quick and full audits hold parameters to (auto: read it from each "
                    "candidate); a mixed-precision run's is float32")
    lt.add_argument("--no-run-evidence", action="store_true",
                    help="judge each candidate alone: do not hold it to the master dtype its run's other checkpoints "
                    "establish (by default a candidate cast to bf16 beside float32 siblings is rejected)")
    lt.add_argument("--allow-damaged-lineage", action="store_true",
                    help="do not pass over a checkpoint whose passport says its training state descends from damage "
                    "(an earlier save failed while the live masters were rounded in memory): the old choice")
    lt.add_argument("--all", action="store_true", help="validate every candidate, not only down to the latest")
    lt.add_argument("--verbose", "-v", action="store_true", help="list every finding")
    lt.add_argument("--fail-on", choices=FAIL_ON.choices,
                    help="also exit 1 when a finding (a rejected candidate, a stale pointer) reaches this severity; "
                    "without it, exit 1 only when no checkpoint is resumable")
    lt.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    _ignore_arg(lt, "; an ignored error does not reject a candidate")

    at = sub.add_parser("attest", help="audit a checkpoint and write its passport: the verdict bound to its bytes "
                        "(docs/passport.md)")
    at.add_argument("path", help="checkpoint file or directory (local)")
    at.add_argument("--output", "-o", metavar="FILE",
                    help="where to write the passport (default: DIR/ckptaudit.passport.json, FILE.passport.json)")
    at.add_argument("--key", metavar="PRIVATE_KEY",
                    help="PEM EC private key to sign with (the [sign] extra); without it the passport is digest-only")
    at.add_argument("--cert", metavar="CERT", help="PEM signing certificate issued for --key: sign under it (model-"
                    "signing's certificate mode; the passport carries the certificate and --cert-chain)")
    at.add_argument("--cert-chain", metavar="CERT", action="append", default=[],
                    help="PEM file of certificates linking --cert to your CA (repeatable)")
    at.add_argument("--expect", default="training", choices=["training", "serving"],
                    help="what the checkpoint is: a resumable training checkpoint (default) or a serving export")
    at.add_argument("--digest", default=None, choices=["sha256", "blake3"],
                    help="the file digests' algorithm, one model-signing verifies (default blake3 where installed, "
                    "else sha256)")
    at.add_argument("--master-dtype", default="auto", choices=MASTER_DTYPES,
                    help="the master dtype the audit holds parameters to (auto: read it from the checkpoint)")
    at.add_argument("--jobs", "-j", type=_jobs, default=None, metavar="N", help="threads (default: every core)")
    at.add_argument("--format", default="table", choices=["table", "json"], help="what to print")
    _ignore_arg(at)

    ve = sub.add_parser("verify", help="check a copy (local, s3://, gs://) against its passport: every byte, the "
                        "signature, the verdict")
    ve.add_argument("path", help="checkpoint file or directory, or its s3:// / gs:// URL")
    ve.add_argument("--passport", metavar="FILE", help="the passport (default: the one the checkpoint carries)")
    ve.add_argument("--key", metavar="PUBLIC_KEY",
                    help="the signer's PEM public key: the signature must verify (a digest-only passport is refused)")
    ve.add_argument("--cert-chain", metavar="CERT", action="append", default=[],
                    help="PEM file of the certificates you trust (your CA; repeatable): the passport must be signed "
                    "under a certificate that chains to them (attest --cert); instead of --key")
    ve.add_argument("--expect", default="training", choices=["training", "serving"],
                    help="what the checkpoint is used as; its recorded verdict must be a pass for that")
    ve.add_argument("--jobs", "-j", type=_jobs, default=None, metavar="N", help="files read at once")
    ve.add_argument("--format", default="table", choices=["table", "json"], help="what to print")
    ve.add_argument("--verbose", "-v", action="store_true", help="list every finding")

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


SERVING_DTYPES = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]
"""``ckptaudit.serving.export.EXPORT_DTYPES`` (listed here so that parsing arguments does not import torch)."""


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--jobs takes a whole number of threads, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--jobs must be at least 1, got {n}")
    return n


def _option_args(p: argparse.ArgumentParser, table: Mapping[str, Option]) -> None:
    """The flags of the option table's command-line options (:mod:`ckptaudit.options`: name, choices, default,
    help); ``--fail-on`` comes with the output flags. The values are checked again by the table when they are
    resolved (:func:`_resolved`)."""
    for opt in table.values():
        if not opt.cli or opt.name == "fail_on":
            continue
        if opt.name == "jobs":
            p.add_argument(opt.flag, "-j", type=_jobs, default=None, metavar="N", help=opt.help)
        elif opt.annotation == "bool":
            p.add_argument(opt.flag, dest=opt.name, action="store_false" if opt.default else "store_true",
                           help=opt.help)
        elif opt.choices:
            p.add_argument(opt.flag, default=opt.default, choices=opt.choices, help=opt.help)
        else:  # a list: comma-separated on the command line
            p.add_argument(opt.flag, default="", metavar="CODE[,CODE...]" if opt.name == "ignore" else None,
                           help=opt.help)


def _ignore_arg(p: argparse.ArgumentParser, more: str = "") -> None:
    p.add_argument("--ignore", default="", metavar="CODE[,CODE...]", help=IGNORE.help + more)


def _ignore(text: str) -> tuple[str, ...]:
    from ckptaudit.catalogue import parse_ignore

    try:
        return parse_ignore(text)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="table", choices=["table", "json", "html"], help="report format")
    p.add_argument("--output", "-o", help="write the report to this file instead of stdout")
    p.add_argument("--fail-on", default=FAIL_ON.default, choices=FAIL_ON.choices,
                   help="exit 1 when a finding reaches this severity (default: error)")
    p.add_argument("--verbose", "-v", action="store_true", help="list every finding and tensor")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _resolved(args: argparse.Namespace, table: Mapping[str, Option]) -> dict[str, Any]:
    """The table's options (:func:`ckptaudit.options.resolve`) from the command line's flags: the lists parsed
    with the command line's messages first, every value then checked by the table as the API checks it."""
    given: dict[str, Any] = {}
    for opt in table.values():
        if opt.cli:
            given[opt.name] = getattr(args, opt.name)
    if "require" in given:
        given["require"] = sorted(_require(given["require"]))
    if "ignore" in given:
        given["ignore"] = _ignore(given["ignore"])
    try:
        return resolve(f"ckptaudit {args.command}", given, table)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _require(text: str, *, passport: bool = False) -> frozenset[Any]:
    from ckptaudit.findings import ComponentKind

    kinds: set[Any] = set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        if passport and (item == "passport" or item.startswith("passport=")):  # latest: docs/passport.md
            kinds.add(item)
            continue
        try:
            kinds.add(ComponentKind(item))
        except ValueError:
            choices = ", ".join(k.value for k in ComponentKind)
            raise UsageError(f"--require: unknown component {item!r}; choose from {choices}") from None
    return frozenset(kinds)


class _PipeSafe:
    """``stdout`` whose reader may go away (``ckptaudit audit X --verbose | head``). The write that finds the pipe
    closed marks it ``broken`` and raises :class:`BrokenPipeError`, and so does every later write, so that a
    renderer stops at its next batch instead of formatting rows nobody reads; :func:`_emit` then returns the
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


def _silence_stdout() -> None:
    """After a closed pipe: point fd 1 at /dev/null, so that the interpreter's final flush finds no pipe either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _emit(report: RawReport, args: argparse.Namespace, stdout: TextIO) -> int:
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
            if not (isinstance(stdout, _PipeSafe) and stdout.broken):
                raise
    from ckptaudit.findings import Severity

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
    from ckptaudit.api import audit_options
    from ckptaudit.auditing.judge import run_audit

    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):  # torchrun_rank's test, first: the
        from ckptaudit.auditing.distributed import torchrun_rank  # distributed audit is imported only under torchrun

        try:
            place = torchrun_rank()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if place is not None and place.world_size > 1:
            return _audit_distributed(args, place.rank, place.world_size, stdout)
    if not _exists(args.path):
        raise UsageError(f"{args.path}: no such file or directory; give the path of a checkpoint file or directory")
    options = audit_options(_resolved(args, AUDIT_OPTIONS))
    prog, update = _progress(not args.no_progress, stderr)
    if prog is not None:
        with prog:
            report = run_audit(args.path, options, progress=update)
    else:
        report = run_audit(args.path, options)
    return _emit(report, args, stdout)


def _audit_distributed(args: argparse.Namespace, rank: int, world_size: int, stdout: TextIO) -> int:
    """Under torchrun: every rank scans its share; rank 0 prints the one report, the others print nothing.
    (No existence check before joining: a rank that returned early would leave the others waiting.)"""
    from ckptaudit.api import audit_options
    from ckptaudit.auditing.distributed import DistributedAuditError, audit_distributed
    from ckptaudit.auditing.scan import default_jobs

    if not args.dist_timeout > 0:
        raise UsageError(f"--dist-timeout must be a positive number of seconds, got {args.dist_timeout}")
    if args.quick:
        raise UsageError("--quick audits in one process: run it without torchrun (a distributed audit is a full one)")
    # Ranks on one node share its cores.
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    except ValueError:
        local = 1
    values = _resolved(args, AUDIT_OPTIONS)
    options = audit_options({**values, "jobs": values["jobs"] or max(1, default_jobs() // max(1, local))})
    try:
        report = audit_distributed(args.path, options, rank=rank, world_size=world_size,
                                   timeout_s=args.dist_timeout)
    except DistributedAuditError as exc:
        raise UsageError(str(exc)) from None
    if report is None:
        return EXIT_CLEAN
    return _emit(report, args, stdout)


def _exists(path: str) -> bool:
    """Local paths (and ``file://`` URLs) are checked here; other URLs when they are opened (as the API does)."""
    from ckptaudit.api import reachable

    return reachable(path)


def _cmd_resume(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.recipes import RecipeError, load_object, load_recipe
    from ckptaudit.resume import DEFAULT_EXPORTER, ResumeConfig, ResumeError, run_resume_test

    exporters = tuple(args.exporters or (DEFAULT_EXPORTER,))
    try:
        load_recipe(args.recipe)
        for spec in exporters:
            load_object(spec)
        cfg = ResumeConfig(recipe=args.recipe, exporters=exporters, nproc=args.nproc,
                           resume_nproc=args.resume_nproc, save_at=args.save_at, steps=args.steps,
                           margin=args.margin, workdir=args.workdir, timeout_s=args.timeout,
                           export_timeout_s=args.export_timeout, borrow_state=args.borrow_state, debug=args.debug)
    except ValueError as exc:
        if (args.verbose or args.debug) and exc.__cause__ is not None:
            import traceback

            stderr.write("".join(traceback.format_exception(exc.__cause__)))
        raise UsageError(str(exc)) from None

    def log(msg: str) -> None:
        if not args.no_progress:
            stderr.write(f"resume-test: {msg}\n")

    try:
        report = run_resume_test(cfg, log=log)
    except RecipeError as exc:
        f = exc.failure
        stderr.write(f"ckptaudit resume-test: error: the recipe {args.recipe} failed: {f.function}: {f.rule}"
                     + (f": {f.error}" if f.error and f.error != f.rule else "") + "\n")
        if args.verbose or args.debug:
            stderr.write((f.traceback if args.debug else f.frames or f.traceback).rstrip() + "\n")
        else:
            stderr.write("(--verbose shows your frames of the traceback, --debug all of them)\n")
        return EXIT_USAGE
    except ResumeError as exc:
        stderr.write(f"ckptaudit resume-test: error: {exc}\n")
        return EXIT_USAGE
    return _emit(report, args, stdout)


def _cmd_export_serving(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.recipes import load_object
    from ckptaudit.serving.export import ExportError, ExportOptions, export_serving, parse_size
    from ckptaudit.serving.gate import GateThresholds

    if not os.path.exists(args.path):
        raise UsageError(f"{args.path}: no such file or directory; give the path of a training checkpoint")
    limits = {k: getattr(args, k) for k in ("max_abs_diff", "max_rel_diff", "min_cosine", "min_top1",
                                            "max_loss_diff") if getattr(args, k) is not None}
    try:
        convert = load_object(args.convert) if args.convert else None
        if convert is not None and not callable(convert):
            raise ValueError(f"--convert {args.convert} is not callable; name a function (name, tensor, dtype)")
        options = ExportOptions(recipe=args.recipe, out=args.out, dtype=args.dtype, keep_fp32=tuple(args.keep_fp32),
                                force=args.force, max_shard_bytes=parse_size(args.max_shard_size),
                                eval_batch=args.eval_batch, device=args.device, thresholds=GateThresholds(**limits),
                                convert=convert, passport_key=args.passport_key)
    except ValueError as exc:  # ExportError is a ValueError
        raise UsageError(str(exc)) from None

    def log(msg: str) -> None:
        if not args.no_progress:
            stderr.write(f"export-serving: {msg}\n")

    try:
        result = export_serving(args.path, options, log=log)
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    return _emit(result.report(), args, stdout)


def _cmd_compare(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.api import compare_options
    from ckptaudit.comparing import run_compare

    for role, path in (("reference", args.reference), ("candidate", args.candidate)):
        if not _exists(path):
            raise UsageError(f"{role} {path}: no such file or directory; give the path of a checkpoint file or "
                             "directory")
    options = compare_options(_resolved(args, COMPARE_OPTIONS), verbose=args.verbose)
    prog, update = _progress(not args.no_progress, stderr)
    if prog is not None:
        with prog:
            report = run_compare(args.reference, args.candidate, options, progress=update)
    else:
        report = run_compare(args.reference, args.candidate, options)
    return _emit(report, args, stdout)


def _cmd_latest(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.formats.remote import is_url, local_path
    from ckptaudit.latest import latest_report

    if not is_url(args.root):
        args.root = local_path(args.root)
    if not is_url(args.root) and not os.path.exists(args.root):
        raise UsageError(f"{args.root}: no such file or directory; give the directory your checkpoints are saved in")
    def progress(msg: str) -> None:
        stderr.write(f"latest: {msg}\n")
        stderr.flush()

    show = not args.no_progress and stderr.isatty()
    report = latest_report(args.root, verify=args.verify, require=_require(args.require, passport=True),
                           check_all=args.all,
                           progress=progress if show else None,
                           ignore=_ignore(args.ignore) + (("guard.descends-from-damage",) if args.allow_damaged_lineage
                                                          else ()),
                           master_dtype=args.master_dtype, run_evidence=not args.no_run_evidence)
    fail_on = args.fail_on
    args.fail_on = fail_on or "error"
    code = _emit(report, args, stdout)
    # Without --fail-on, exit 1 exactly when nothing is resumable: rejected newer candidates are the normal case
    # after a crash. With it, findings at or above that severity fail too.
    if report.extra["latest"] is None:
        return EXIT_FINDINGS
    return code if fail_on else EXIT_CLEAN


def _cmd_attest(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.passport import PassportError, attest
    from ckptaudit.passport.render import attest_json, attest_text, dumps

    if not _exists(args.path):
        raise UsageError(f"{args.path}: no such file or directory; give the path of a checkpoint file or directory")
    try:
        options = AuditOptions(master_dtype=args.master_dtype, ignore=_ignore(args.ignore))
        p = attest(args.path, key=args.key, output=args.output, artifact=args.expect, options=options,
                   jobs=args.jobs, algorithm=args.digest, certificate=args.cert, cert_chain=args.cert_chain)
    except PassportError as exc:
        raise UsageError(str(exc)) from None
    stdout.write(dumps(attest_json(p, args.path)) if args.format == "json" else attest_text(p, args.path))
    return EXIT_CLEAN if p.verdict == "pass" else EXIT_FINDINGS


def _cmd_verify(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.passport import PassportError, verify
    from ckptaudit.passport.render import dumps, verify_json, verify_text

    try:
        result = verify(args.path, args.passport, key=args.key, expect=args.expect, jobs=args.jobs,
                        cert_chain=args.cert_chain)
    except PassportError as exc:  # the passport itself is unreadable, or the key: one line, exit 2
        raise UsageError(" ".join(str(exc).split())) from None
    stdout.write(dumps(verify_json(result)) if args.format == "json" else verify_text(result, args.verbose))
    return result.exit_code


def _cmd_demo(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.demo import run_demo

    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    return run_demo(args.out, nproc=args.nproc, steps=args.steps, out=stdout, err=stderr).exit_code


def _cmd_probe(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.launch import DistributedError
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


COMMANDS = {"attest": _cmd_attest, "audit": _cmd_audit, "compare": _cmd_compare, "demo": _cmd_demo,
            "export-serving": _cmd_export_serving, "latest": _cmd_latest, "probe": _cmd_probe,
            "resume-test": _cmd_resume, "verify": _cmd_verify}

NEEDS_TORCH = frozenset({"demo", "export-serving", "probe", "resume-test"})
"""The commands that run PyTorch: without it installed they stop at one line naming the extra to install."""


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parse_args``, except that flags the command does not know are reported with the command's own usage
    (argparse leaves them to the top-level parser, whose usage lists only the commands)."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = _subparsers(parser).get(getattr(args, "command", None) or "", parser)
        sub.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    out = _PipeSafe(stdout or sys.stdout)
    stderr = stderr or sys.stderr
    try:
        return _main(argv, out, stderr)
    finally:
        if out.broken and stdout is None:
            _silence_stdout()


def _main(argv: Sequence[str] | None, stdout: Any, stderr: TextIO) -> int:
    parser = _parser()
    try:
        args = _parse(parser, list(argv) if argv is not None else None)
    except _ArgumentError as exc:
        exc.parser.print_usage(stderr)
        stderr.write(f"{exc.parser.prog}: error: {exc}\n")
        return EXIT_USAGE
    except SystemExit as exc:  # --help and --version exit 0
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if not args.command:
        parser.print_help(stderr)
        return EXIT_USAGE
    from ckptaudit.extras import torch_missing, torch_older_than_tested

    if args.command in NEEDS_TORCH:
        missing = torch_missing(f"ckptaudit {args.command}")
        if missing is not None:
            stderr.write(f"ckptaudit {args.command}: error: {missing}\n")
            return EXIT_USAGE
        old = torch_older_than_tested(f"ckptaudit {args.command}")
        if old is not None:
            stderr.write(f"warning: {old}\n")
    args.diagnostics = stderr  # where _emit says the verdict when the report goes to --output
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
        if not (isinstance(stdout, _PipeSafe) and stdout.broken):
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


if __name__ == "__main__":
    sys.exit(main())
