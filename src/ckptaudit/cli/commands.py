"""One function per command: it checks what the parser could not, calls the command's public engine path and
hands the report to :func:`ckptaudit.cli.output.emit`; each imports what it runs when it runs."""

from __future__ import annotations

import argparse
import os
from typing import Any, TextIO

from ckptaudit.cli.output import EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, emit, progress_bar
from ckptaudit.cli.parser import UsageError, ignore_codes, require, resolved
from ckptaudit.options import AUDIT_OPTIONS, COMPARE_OPTIONS

__all__ = ["COMMANDS", "NEEDS_TORCH"]


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
    options = audit_options(resolved(args, AUDIT_OPTIONS))
    prog, update = progress_bar(not args.no_progress, stderr)
    if prog is not None:
        with prog:
            report = run_audit(args.path, options, progress=update)
    else:
        report = run_audit(args.path, options)
    return emit(report, args, stdout)


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
    values = resolved(args, AUDIT_OPTIONS)
    options = audit_options({**values, "jobs": values["jobs"] or max(1, default_jobs() // max(1, local))})
    try:
        report = audit_distributed(args.path, options, rank=rank, world_size=world_size,
                                   timeout_s=args.dist_timeout)
    except DistributedAuditError as exc:
        raise UsageError(str(exc)) from None
    if report is None:
        return EXIT_CLEAN
    return emit(report, args, stdout)


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
    return emit(report, args, stdout)


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
    return emit(result.report(), args, stdout)


def _cmd_compare(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.api import compare_options
    from ckptaudit.comparing import run_compare

    for role, path in (("reference", args.reference), ("candidate", args.candidate)):
        if not _exists(path):
            raise UsageError(f"{role} {path}: no such file or directory; give the path of a checkpoint file or "
                             "directory")
    options = compare_options(resolved(args, COMPARE_OPTIONS), verbose=args.verbose)
    prog, update = progress_bar(not args.no_progress, stderr)
    if prog is not None:
        with prog:
            report = run_compare(args.reference, args.candidate, options, progress=update)
    else:
        report = run_compare(args.reference, args.candidate, options)
    return emit(report, args, stdout)


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
    report = latest_report(args.root, verify=args.verify, require=require(args.require, passport=True),
                           check_all=args.all,
                           progress=progress if show else None,
                           ignore=ignore_codes(args.ignore) + (("guard.descends-from-damage",) if args.allow_damaged_lineage
                                                          else ()),
                           master_dtype=args.master_dtype, run_evidence=not args.no_run_evidence)
    fail_on = args.fail_on
    args.fail_on = fail_on or "error"
    code = emit(report, args, stdout)
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
        options = AuditOptions(master_dtype=args.master_dtype, ignore=ignore_codes(args.ignore))
        p = attest(args.path, key=args.key, output=args.output, artifact=args.expect, options=options,
                   jobs=args.jobs, algorithm=args.digest, certificate=args.cert, cert_chain=args.cert_chain,
                   sigstore=_sigstore_signing(args))
    except PassportError as exc:
        raise UsageError(str(exc)) from None
    stdout.write(dumps(attest_json(p, args.path)) if args.format == "json" else attest_text(p, args.path))
    return EXIT_CLEAN if p.verdict == "pass" else EXIT_FINDINGS


def _sigstore_signing(args: argparse.Namespace) -> Any:
    """``attest --sigstore [--identity-token T] [--sigstore-trust-config F]`` (or ``None``: not keyless)."""
    from ckptaudit.passport.keyless import SigstoreSigning

    if not args.sigstore:
        if args.identity_token is not None or args.sigstore_trust_config is not None:
            raise UsageError("--identity-token and --sigstore-trust-config sign keylessly: add --sigstore")
        return None
    return SigstoreSigning(args.identity_token or os.environ.get("SIGSTORE_IDENTITY_TOKEN") or None,
                           args.sigstore_trust_config)


def _sigstore_identity(args: argparse.Namespace) -> Any:
    """``verify --sigstore-identity ID --sigstore-issuer URL [--sigstore-offline]`` (or ``None``)."""
    from ckptaudit.passport.keyless import SigstoreIdentity

    if args.sigstore_identity is None and args.sigstore_issuer is None:
        if args.sigstore_offline or args.sigstore_trust_config is not None:
            raise UsageError("--sigstore-offline and --sigstore-trust-config verify a keyless signature: give "
                             "--sigstore-identity ID and --sigstore-issuer URL")
        return None
    return SigstoreIdentity(args.sigstore_identity or "", args.sigstore_issuer or "", args.sigstore_offline,
                            args.sigstore_trust_config)


def _cmd_verify(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from ckptaudit.passport import PassportError, verify
    from ckptaudit.passport.render import dumps, verify_json, verify_text

    try:
        result = verify(args.path, args.passport, key=args.key, expect=args.expect, jobs=args.jobs,
                        cert_chain=args.cert_chain, sigstore=_sigstore_identity(args))
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
    return emit(report, args, stdout)


COMMANDS = {"attest": _cmd_attest, "audit": _cmd_audit, "compare": _cmd_compare, "demo": _cmd_demo,
            "export-serving": _cmd_export_serving, "latest": _cmd_latest, "probe": _cmd_probe,
            "resume-test": _cmd_resume, "verify": _cmd_verify}

NEEDS_TORCH = frozenset({"demo", "export-serving", "probe", "resume-test"})
"""The commands that run PyTorch: without it installed they stop at one line naming the extra to install."""
