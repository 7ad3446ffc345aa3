"""Installs where users are: the wheel, built by the standard front end (``python -m build``), installed into clean
virtual environments as a user would, then run.

- Without torch (``pip install ckptaudit``: numpy, safetensors, rich, xxhash and nothing else): ``audit``,
  ``compare`` and ``latest`` give byte-identical JSON and the same exit code as the full install (this test
  process's ckptaudit, torch present) on real checkpoints: single-process DCP, ``torch.save``, a Hugging Face
  Trainer folder, a lossy bf16-rounded export, hostile files (a pickle payload, a DCP whose ``.metadata`` is one)
  and a torn DCP; the commands and APIs that need torch stop at one line naming the extra.
- Beside a torch the environment already holds (``pip install ckptaudit[torch]``): pip keeps that torch, and the
  installed wheel runs ``audit`` and ``demo``, whose output and time are held to the README's and
  ``docs/demo.md``'s sample (``tests/test_docs.py``).

The wheel's declared dependencies are resolved by pip from the configured index (the machine's local one in CI, as
``make`` installs), under ``constraints.txt`` and pinned to the versions this environment runs.

Run: ``.venv/bin/python -m pytest -q tests/test_install.py``
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import real_checkpoints as rc
from ckptaudit.extras import install_line
from demo_pages import DEMO_PAGES, demo_sample, demo_sample_differences, stated_demo_seconds
from local_s3 import environment, s3_server

ROOT = Path(__file__).resolve().parents[1]
LIGHT = ("numpy", "safetensors", "rich", "xxhash", "markdown-it-py", "mdurl", "pygments")
"""The torch-free install's whole dependency closure (rich brings markdown-it-py, mdurl and pygments)."""

pytestmark = pytest.mark.timeout(900)


def _run(argv: list[str], timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)


def _ok(argv: list[str], timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = _run(argv, timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build --wheel`` of a copy of the sources (the build leaves nothing in the repository)."""
    src = tmp_path_factory.mktemp("sdist-tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    # --no-isolation: the build backend (setuptools) is the one this environment already has; nothing fetched.
    _ok([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)])
    (whl,) = out.glob("ckptaudit-*.whl")
    return whl


def _pins(where: Path) -> Path:
    """Constraints: the repository's, plus every distribution pinned to the version this environment runs (pip then
    resolves nothing new: it takes the same files from its cache or the configured index)."""
    pins = where / "constraints.txt"
    here = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
    pins.write_text((ROOT / "constraints.txt").read_text()
                    + "".join(f"{n}=={v}\n" for n, v in sorted(here.items()) if n.lower() not in ("ckptaudit", "torch")))
    return pins


def _venv(where: Path) -> Path:
    """A clean venv without pip of its own (fast): this environment's pip installs into it (``pip --python``)."""
    _ok([sys.executable, "-m", "venv", "--without-pip", str(where)])
    return where / "bin" / "python"


def _pip_install(py: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _ok([sys.executable, "-m", "pip", "--python", str(py), "install", "--disable-pip-version-check",
                "--progress-bar", "off", *args])


def _site_packages(py: Path) -> Path:
    return Path(_ok([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())


@pytest.fixture(scope="module")
def torch_free(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install <wheel>`` into a clean venv: the base install, which must pull no torch."""
    where = tmp_path_factory.mktemp("torch-free")
    py = _venv(where / "venv")
    _pip_install(py, "-c", str(_pins(where)), str(wheel))
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions(path=[str(_site_packages(py))])}
    assert installed == {"ckptaudit", *LIGHT}, sorted(installed)
    _ok([str(py), "-c", "import importlib.util as u; assert u.find_spec('torch') is None"])
    return where / "venv" / "bin"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real checkpoints (written by torch, DCP, the Trainer) and hostile ones mutated from them."""
    import torch

    import hostile_files

    d = tmp_path_factory.mktemp("install-ckpts")
    pt = rc.torch_save_checkpoint(d / "ckpt.pt")
    dcp = rc.dcp_checkpoint(d / "dcp")
    model, opt, sched = rc._model_and_optimizer()
    rounded = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    # The exporter that kept the bf16 compute copies, upcast to fp32, beside the real optimizer state.
    torch.save({"model": rounded, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": 2},
               d / "lossy.pt")
    hostile_files.torch_save_payload("os.system", str(d / "SENTINEL"), d / "payload.pt", pt)
    shutil.copytree(dcp, d / "dcp-payload")
    (d / "dcp-payload" / ".metadata").write_bytes(hostile_files.payload_pickle("os.system", str(d / "SENTINEL")))
    root = d / "runs"
    shutil.copytree(dcp, root / "step-1")
    shutil.copytree(dcp, root / "step-2")
    shard = sorted((root / "step-2").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # torn: a rank died mid-write
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "WANDB_DISABLED": "true", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "support")])}
    _ok([sys.executable, "-c", f"import lib_writers; lib_writers._trainer({str(d / 'trainer')!r}, bin_weights=False)"],
        env=env, cwd=str(d))
    (hf,) = (p for p in (d / "trainer").glob("checkpoint-*") if p.is_dir())
    return {"pt": pt, "dcp": dcp, "lossy": d / "lossy.pt", "payload": d / "payload.pt",
            "dcp-payload": d / "dcp-payload", "runs": root, "hf": hf, "sentinel": d / "SENTINEL"}


@pytest.fixture(scope="module")
def s3(checkpoints: dict[str, Path], torch_free: Path, wheel: Path,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A local S3 server (moto's server mode) holding the torch.save files and the DCP directory, and the torch-free
    venv with ``ckptaudit[remote]`` added (still no torch): the environment that points a client at the server."""
    pytest.importorskip("moto.server")
    import s3fs

    _pip_install(torch_free / "python", "-c", str(_pins(tmp_path_factory.mktemp("pins"))),
                 f"ckptaudit[remote] @ {wheel.as_uri()}")
    _ok([str(torch_free / "python"), "-c", "import importlib.util as u; assert u.find_spec('torch') is None"])
    with s3_server() as env:
        fs = None
        try:
            # The uploader (this process) takes its settings from the environment, as the audits will. moto keeps
            # its buckets in this process's memory, shared by every server it starts (tests/formats/test_remote.py
            # starts another): a bucket of this module's own name, removed at the end.
            with environment(env):
                fs = s3fs.S3FileSystem(skip_instance_cache=True)
                fs.mkdir(BUCKET)
                fs.put(str(checkpoints["pt"]), f"{BUCKET}/ckpt.pt")
                fs.put(str(checkpoints["lossy"]), f"{BUCKET}/lossy.pt")
                fs.put(str(checkpoints["dcp"]), f"{BUCKET}/dcp", recursive=True)
            yield env
        finally:
            if fs is not None:
                fs.rm(BUCKET, recursive=True)


BUCKET = "ckptaudit-install-test"


CASES = [
    ("audit", "pt"), ("audit", "dcp"), ("audit", "hf"), ("audit", "lossy"), ("audit", "payload"),
    ("audit", "dcp-payload"), ("audit", "runs/step-2"), ("compare", "pt lossy"), ("compare", "dcp pt"),
    ("latest", "runs"),
]


@pytest.mark.parametrize(("command", "paths"), CASES, ids=[f"{c}-{p.replace(' ', '-')}" for c, p in CASES])
def test_torch_free_reports_are_the_full_installs(torch_free: Path, checkpoints: dict[str, Path], command: str,
                                                  paths: str) -> None:
    args = [command, *(str(checkpoints[p.split("/")[0]].joinpath(*p.split("/")[1:])) for p in paths.split()),
            "--format", "json", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTAUDIT_VALIDATE_REPORTS", "PYTHONPATH")}
    full = _run([sys.executable, "-m", "ckptaudit", *args],
                env={**env, "PYTHONPATH": str(ROOT / "src")})
    lean = _run([str(torch_free / "ckptaudit"), *args], env=env)
    assert full.returncode in (0, 1), full.stderr[-3000:]
    assert (lean.returncode, lean.stdout) == (full.returncode, full.stdout), lean.stderr[-3000:]
    assert json.loads(lean.stdout)["schema_version"]
    assert not checkpoints["sentinel"].exists()


def test_the_torch_free_python_api_gives_the_full_installs_reports(torch_free: Path,
                                                                   checkpoints: dict[str, Path]) -> None:
    code = ("import sys, ckptaudit, ckptaudit.testing as t\n"
            "a = ckptaudit.audit(sys.argv[1]); c = ckptaudit.compare(sys.argv[1], sys.argv[2])\n"
            "t.assert_checkpoint_ok(sys.argv[1])\n"
            "print(a.to_json()); print(c.to_json()); print(repr(a))\n"
            "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules)\n")
    paths = [str(checkpoints["pt"]), str(checkpoints["lossy"])]
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTAUDIT_VALIDATE_REPORTS", "PYTHONPATH")}
    lean = _ok([str(torch_free / "python"), "-c", code, *paths], env=env)
    full = _ok([sys.executable, "-c", code, *paths], env={**env, "PYTHONPATH": str(ROOT / "src")})
    assert lean.stdout == full.stdout
    assert '"command": "compare"' in lean.stdout and "precision.bf16-rounded" in lean.stdout


@pytest.mark.parametrize("paths", ["ckpt.pt", "lossy.pt", "dcp"])
def test_torch_free_reports_of_s3_checkpoints_are_the_full_installs(torch_free: Path, s3: dict[str, str],
                                                                    paths: str) -> None:
    args = ["audit", f"s3://{BUCKET}/{paths}", "--format", "json", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTAUDIT_VALIDATE_REPORTS", "PYTHONPATH")}
    env.update(s3)
    full = _run([sys.executable, "-m", "ckptaudit", *args], env={**env, "PYTHONPATH": str(ROOT / "src")})
    lean = _run([str(torch_free / "ckptaudit"), *args], env=env)
    assert full.returncode in (0, 1), full.stderr[-3000:]
    assert (lean.returncode, lean.stdout) == (full.returncode, full.stdout), lean.stderr[-3000:]


@pytest.mark.parametrize("argv", [["demo"], ["probe"], ["resume-test", "--recipe", "a:b"],
                                  ["export-serving", "x.pt", "--recipe", "a:b", "--out", "o"]],
                         ids=lambda a: a[0])
def test_commands_that_need_torch_say_which_extra_in_one_line(torch_free: Path, argv: list[str],
                                                              tmp_path: Path) -> None:
    proc = _run([str(torch_free / "ckptaudit"), *argv], cwd=str(tmp_path))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"ckptaudit {argv[0]}: error: ckptaudit {argv[0]} needs PyTorch")
    assert install_line("torch") in proc.stderr


@pytest.mark.parametrize(("api", "use"), [("ckptaudit.store.save_checkpoint", ""),
                                          ("ckptaudit.store.load_checkpoint", ""),
                                          ("ckptaudit.testing.assert_resumes_faithfully", "('a:b', 'c:d')"),
                                          ("ckptaudit.load.load", "('x.pt')")])
def test_apis_that_need_torch_name_the_extra(torch_free: Path, api: str, use: str) -> None:
    module, _, name = api.rpartition(".")
    proc = _run([str(torch_free / "python"), "-c", f"import {module}; {module}.{name}{use}"])
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ckptaudit.extras.MissingExtra: {api} needs PyTorch"), proc.stderr
    assert install_line("torch") in last


def _link_installed(dists: list[str], site: Path) -> None:
    """Place this environment's installed ``dists`` into ``site`` as links (the venv then holds that torch,
    without copying it); only ever read: the test asserts pip would not touch them before it installs."""
    for name in dists:
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            target = Path(str(dist.locate_file(top)))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)


def test_installing_beside_a_users_torch_keeps_it(wheel: Path, tmp_path: Path) -> None:
    import torch

    py = _venv(tmp_path / "venv")
    site = _site_packages(py)
    deps = ["torch", "filelock", "typing_extensions", "sympy", "mpmath", "networkx", "jinja2", "MarkupSafe", "fsspec"]
    _link_installed(deps, site)
    pins = _pins(tmp_path)
    spec = f"ckptaudit[torch] @ {wheel.as_uri()}"
    # Asked first without touching anything: pip's plan must leave every linked distribution alone.
    _pip_install(py, "--dry-run", "--report", str(tmp_path / "plan.json"), "-c", str(pins), spec)
    plan = json.loads((tmp_path / "plan.json").read_text())
    planned = sorted(item["metadata"]["name"].lower() for item in plan["install"])
    assert "ckptaudit" in planned and not set(planned) & {d.lower() for d in deps}, planned
    _pip_install(py, "-c", str(pins), spec)
    probe = _ok([str(py), "-c", "import torch, ckptaudit; print(torch.__version__, torch.__file__)"]).stdout.split()
    assert probe == [torch.__version__, str(site / "torch" / "__init__.py")]
    assert (site / "torch").is_symlink()
    bin_ = py.parent
    ckpt = rc.torch_save_checkpoint(tmp_path / "ckpt.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTAUDIT_VALIDATE_REPORTS", "PYTHONPATH")}
    _ok([str(bin_ / "ckptaudit"), "audit", str(ckpt), "--no-progress"], env=env)
    # The demo as the README shows it (default options, relative --out), on a wide terminal: the pages' sample
    # output and stated duration are held to this run (tests/test_docs.py).
    load = os.getloadavg()[0]
    demo = _ok([str(bin_ / "ckptaudit"), "demo", "--out", "ckptaudit-demo"], env={**env, "COLUMNS": "400"},
               cwd=str(tmp_path))
    for page in DEMO_PAGES:
        assert demo_sample_differences(demo_sample(page), demo.stdout) == [], (page.name, demo.stdout)
    seconds = int(re.search(r"HTML report: \S+ +\((\d+) s\)", demo.stdout)[1])
    stated = stated_demo_seconds(DEMO_PAGES[0])
    assert seconds >= stated / 4, f"the demo took {seconds} s; the docs state about {stated} s"
    if max(load, os.getloadavg()[0]) < 1:  # a quiet machine: the stated time must hold
        assert seconds <= 4 * stated, f"the demo took {seconds} s on a quiet machine; the docs state about {stated} s"
