"""The command line's parser: one set of flags per command (the audit's and compare's from the option table,
:mod:`ckptaudit.options`), and the values of the flags the commands share. Only the command that runs gets its
flags built; ``--help`` lists every command the same either way."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptaudit.options import AUDIT_OPTIONS, COMPARE_OPTIONS, FAIL_ON, IGNORE, MASTER_DTYPES, Option, resolve
from ckptaudit.version import __version__

__all__ = ["SERVING_DTYPES", "ArgumentError", "UsageError", "build_parser", "command_of", "ignore_codes", "parse",
           "require", "resolved"]


class UsageError(Exception):
    """Bad arguments or an unusable path: exit code 2, message on stderr."""


class ArgumentError(Exception):
    """argparse's complaint about the command line, with the (sub)parser whose usage to print."""

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
        raise ArgumentError(self, message)



def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command or, given one of them, the parser of that command alone: the one that runs. (The
    ~120 flags and nine sub-parsers of all commands, each sub-parser asking gettext for its words, were ~5 ms of
    every start-up.) Without a command, or with an unknown one, every command is there, for the list ``--help``
    and argparse's "invalid choice" give."""
    p = _Parser(
        prog="ckptaudit",
        description="Is this checkpoint really my training state, and can I resume from it?",
    )
    p.add_argument("--version", action="version", version=f"ckptaudit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (text, add_flags) in _COMMANDS.items():
        if command in _COMMANDS and name != command:
            continue
        add_flags(sub.add_parser(name, help=text))
    return p


def command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (its first word that is no flag: the top level takes no values), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
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


def _audit_args(a: argparse.ArgumentParser) -> None:
    a.add_argument("path", help="checkpoint file or directory")
    _output_args(a)
    _option_args(a, AUDIT_OPTIONS)
    a.add_argument("--dist-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="under torchrun: how long ranks wait for each other (default 1800)")


def _resume_test_args(r: argparse.ArgumentParser) -> None:
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


def _export_serving_args(e: argparse.ArgumentParser) -> None:
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


def _compare_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("reference", help="the reference checkpoint (e.g. saved the documented way)")
    c.add_argument("candidate", help="the checkpoint to judge against it (any layout the audit reads)")
    _output_args(c)
    _option_args(c, COMPARE_OPTIONS)


def _latest_args(lt: argparse.ArgumentParser) -> None:
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
                    "passport (or passport=KEY.pub, passport=CA.pem, or passport=SIGSTORE.json): only a candidate "
                    "whose passport verifies (docs/passport.md)")
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


def _attest_args(at: argparse.ArgumentParser) -> None:
    at.add_argument("path", help="checkpoint file or directory (local)")
    at.add_argument("--output", "-o", metavar="FILE",
                    help="where to write the passport (default: DIR/ckptaudit.passport.json, FILE.passport.json)")
    at.add_argument("--key", metavar="PRIVATE_KEY",
                    help="PEM EC private key to sign with (the [sign] extra); without it the passport is digest-only")
    at.add_argument("--cert", metavar="CERT", help="PEM signing certificate issued for --key: sign under it (model-"
                    "signing's certificate mode; the passport carries the certificate and --cert-chain)")
    at.add_argument("--cert-chain", metavar="CERT", action="append", default=[],
                    help="PEM file of certificates linking --cert to your CA (repeatable)")
    at.add_argument("--sigstore", action="store_true",
                    help="sign keylessly through Sigstore (an OIDC identity, a Fulcio certificate, logged in Rekor) "
                    "instead of with a key; needs the network and an identity token")
    at.add_argument("--identity-token", metavar="TOKEN",
                    help="the OIDC identity token for --sigstore (default: $SIGSTORE_IDENTITY_TOKEN, else an ambient "
                    "one: GitHub Actions, GCP, GitLab, Buildkite, CircleCI)")
    at.add_argument("--sigstore-trust-config", metavar="FILE",
                    help="a Sigstore client trust configuration (JSON) for an instance other than the public one")
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


def _verify_args(ve: argparse.ArgumentParser) -> None:
    ve.add_argument("path", help="checkpoint file or directory, or its s3:// / gs:// URL")
    ve.add_argument("--passport", metavar="FILE", help="the passport (default: the one the checkpoint carries)")
    ve.add_argument("--key", metavar="PUBLIC_KEY",
                    help="the signer's PEM public key: the signature must verify (a digest-only passport is refused)")
    ve.add_argument("--cert-chain", metavar="CERT", action="append", default=[],
                    help="PEM file of the certificates you trust (your CA; repeatable): the passport must be signed "
                    "under a certificate that chains to them (attest --cert); instead of --key")
    ve.add_argument("--sigstore-identity", metavar="ID",
                    help="the identity trusted to have signed keylessly (attest --sigstore): an email or a workflow "
                    "URI; with --sigstore-issuer, instead of --key")
    ve.add_argument("--sigstore-issuer", metavar="URL", help="the OIDC issuer that vouched for --sigstore-identity "
                    "(e.g. https://token.actions.githubusercontent.com)")
    ve.add_argument("--sigstore-offline", action="store_true",
                    help="use the Sigstore trusted root sigstore-python holds, without refreshing it (no network)")
    ve.add_argument("--sigstore-trust-config", metavar="FILE",
                    help="a Sigstore client trust configuration (JSON) for an instance other than the public one")
    ve.add_argument("--expect", default="training", choices=["training", "serving"],
                    help="what the checkpoint is used as; its recorded verdict must be a pass for that")
    ve.add_argument("--jobs", "-j", type=_jobs, default=None, metavar="N", help="files read at once")
    ve.add_argument("--format", default="table", choices=["table", "json"], help="what to print")
    ve.add_argument("--verbose", "-v", action="store_true", help="list every finding")


def _demo_args(d: argparse.ArgumentParser) -> None:
    d.add_argument("--out", default="ckptaudit-demo", help="directory for checkpoints and reports")
    d.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    d.add_argument("--steps", type=int, default=8, help="training steps before the checkpoint")


def _probe_args(pr: argparse.ArgumentParser) -> None:
    pr.add_argument("--recipe", default="ckptaudit.recipes.tinygpt:recipe",
                    help="module:attr or path/to/file.py:attr of the recipe (default: the built-in tiny GPT)")
    pr.add_argument("--exporter", default="ckptaudit.exporters:documented",
                    help="module:attr of the exporter under test (default: get_state_dict + DCP save)")
    pr.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    pr.add_argument("--steps", type=int, default=4, help="training steps before the probe and the save")
    pr.add_argument("--out", help="keep the saved checkpoint under this directory (default: a temporary one)")
    pr.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are stopped")
    _output_args(pr)


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
    resolved (:func:`resolved`)."""
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


def ignore_codes(text: str) -> tuple[str, ...]:
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


def resolved(args: argparse.Namespace, table: Mapping[str, Option]) -> dict[str, Any]:
    """The table's options (:func:`ckptaudit.options.resolve`) from the command line's flags: the lists parsed
    with the command line's messages first, every value then checked by the table as the API checks it."""
    given: dict[str, Any] = {}
    for opt in table.values():
        if opt.cli:
            given[opt.name] = getattr(args, opt.name)
    if "require" in given:
        given["require"] = sorted(require(given["require"]))
    if "ignore" in given:
        given["ignore"] = ignore_codes(given["ignore"])
    try:
        return resolve(f"ckptaudit {args.command}", given, table)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def require(text: str, *, passport: bool = False) -> frozenset[Any]:
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


_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "audit": ("audit a checkpoint offline (file or directory)", _audit_args),
    "resume-test": ("differential resume test of exporters on a recipe", _resume_test_args),
    "export-serving": ("export the model weights for serving (bf16/fp16 safetensors) behind an output-quality gate, "
                       "marked as a serving artifact", _export_serving_args),
    "compare": ("compare a candidate checkpoint with a reference, tensor by tensor", _compare_args),
    "latest": ("the newest resumable checkpoint under a directory, and why newer ones are rejected", _latest_args),
    "attest": ("audit a checkpoint and write its passport: the verdict bound to its bytes (docs/passport.md)",
               _attest_args),
    "verify": ("check a copy (local, s3://, gs://) against its passport: every byte, the signature, the verdict",
               _verify_args),
    "demo": ("run the whole story on the built-in recipe (CPU, 2 ranks)", _demo_args),
    "probe": ("run a recipe with the live probe: masters, compute copies, saved state", _probe_args),
}
"""Each command: its help line, and the function that adds its flags (in the order ``--help`` lists them)."""
