"""The suite's own machinery for machines of the same kind: the CPU switch, per-configuration outcomes, and session
fixtures whose failure names what failed (``cpu_features.py``, ``configurations.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import launch_jobs
from configurations import Outcomes, Refused, Written, fixture_launch, in_progress

SUPPORT = Path(__file__).resolve().parent / "support"


def _features(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    return subprocess.run([sys.executable, str(SUPPORT / "cpu_features.py")], env={**clean, **env}, capture_output=True,
                          text=True, timeout=300, check=False)


def test_the_avx2_switch_makes_onednn_and_deepspeed_refuse_fp16() -> None:
    out = _features({"CKPTAUDIT_TEST_CPU": "avx2"})
    assert out.returncode == 0, out.stderr
    assert "CKPTAUDIT_TEST_CPU=avx2" in out.stdout and "ATen CPU capability AVX2" in out.stdout
    assert "oneDNN fp16 False, bf16 False" in out.stdout
    if "DeepSpeed CPU accelerator fp16 None" not in out.stdout:  # DeepSpeed installed: it asks oneDNN
        assert "DeepSpeed CPU accelerator fp16 False" in out.stdout


def test_the_switch_refuses_an_unknown_profile_or_a_conflicting_environment() -> None:
    out = _features({"CKPTAUDIT_TEST_CPU": "zen5"})
    assert out.returncode == 2 and "CKPTAUDIT_TEST_CPU='zen5': use one of native, avx2" in out.stderr
    out = _features({"CKPTAUDIT_TEST_CPU": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert out.returncode == 2 and "ONEDNN_MAX_CPU_ISA=AVX512_CORE: unset one of them" in out.stderr


def _refused() -> None:
    raise Refused("Type fp16 is not supported on your device.")


def _broken() -> None:
    raise ValueError("the optimizer has no state")


def test_each_configuration_has_its_own_outcome(tmp_path: Path) -> None:
    outcomes = Outcomes(str(tmp_path), ["s2-bf16", "s2-fp16", "s3-bf16", "s0-fp32"])
    assert outcomes.run("s2-bf16", lambda: "DeepSpeedZeroOptimizer") == "DeepSpeedZeroOptimizer"
    assert outcomes.run("s2-fp16", _refused) is None
    assert outcomes.run("s3-bf16", _broken) is None
    written = Written(tmp_path, "deepspeed")
    assert written / "s2-bf16" == tmp_path / "s2-bf16"
    assert written / "s2-bf16.zero_to_fp32.pt" == tmp_path / "s2-bf16.zero_to_fp32.pt"
    with pytest.raises(pytest.skip.Exception, match="deepspeed configuration s2-fp16: refused on this CPU: Type fp16"):
        written / "s2-fp16"
    with pytest.raises(pytest.fail.Exception) as failed:
        written / "s3-bf16"
    assert "deepspeed configuration s3-bf16 was not written (failed)" in str(failed.value)
    assert "ValueError: the optimizer has no state" in str(failed.value)
    with pytest.raises(pytest.fail.Exception, match="s0-fp32 was not written \\(pending\\)"):
        written / "s0-fp32"


def test_a_writer_that_dies_leaves_the_configuration_it_was_in(tmp_path: Path) -> None:
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from configurations import Outcomes; "
            "o = Outcomes(sys.argv[2], ['trainer-bin', 'accelerate']); o.run('trainer-bin', lambda: None); "
            "o.run('accelerate', os.abort)")
    proc = subprocess.run([sys.executable, "-c", code, str(SUPPORT), str(tmp_path)], capture_output=True, timeout=120,
                          check=False)
    assert proc.returncode == -6
    assert in_progress(tmp_path) == "accelerate"


@pytest.mark.dist
def test_a_session_fixtures_failure_names_the_fixture_job_and_configuration() -> None:
    with pytest.raises(RuntimeError) as err:
        fixture_launch("fsdp_run", launch_jobs.abort_inside_a_configuration, 2, (), timeout_s=120, pg_timeout_s=60,
                       start_method="forkserver", preload=("torch", "launch_jobs"))
    message = str(err.value)
    assert message.startswith("fixture fsdp_run: the 2-rank job launch_jobs.abort_inside_a_configuration failed, "
                              "so every test that uses fsdp_run errors with this message:")
    assert "(rank 1 first)" in message and "killed by SIGABRT" in message
    assert "| configuration s2-fp16: writing" in message  # the dead rank's own last words
    assert "configuration 'faithful.pt' failed" in message  # the surviving rank's exception


_SHARED = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from shared_fixtures import build_once

class Factory:  # what build_once asks of pytest's TempPathFactory: this worker's base folder
    def getbasetemp(self):
        return Path(sys.argv[2]) / ("popen-" + os.environ["PYTEST_XDIST_WORKER"])

def build(out):
    (out / ("built-by-" + os.environ["PYTEST_XDIST_WORKER"])).write_text("")
    time.sleep(1.0)  # the other worker asks meanwhile
    if sys.argv[3] == "fail":
        raise ValueError("the writer refused")
    return {"paths": [str(out / "a")]}

try:
    out, got = build_once(Factory(), "thing", build, wait_s=120)
    print(json.dumps({"out": str(out), "got": got}))
except Exception as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_a_session_fixture_is_built_once_for_every_xdist_worker(tmp_path: Path, outcome: str) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", _SHARED, str(SUPPORT), str(tmp_path), outcome],
                              env={**os.environ, "PYTEST_XDIST_WORKER": f"gw{i}"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert len(list((tmp_path / "shared-thing").glob("built-by-*"))) == 1  # one writer, whoever came first
    if outcome == "ok":
        assert results[0] == results[1] == {"out": str(tmp_path / "shared-thing"),
                                            "got": {"paths": [str(tmp_path / "shared-thing" / "a")]}}
    else:  # the builder's own error, and the other worker's naming the fixture with the builder's traceback
        assert sorted(r["error"].splitlines()[0] for r in results) == [
            "fixture thing failed in the worker that built it:", "the writer refused"]
        assert all("ValueError: the writer refused" in r["error"] for r in results
                   if r["error"].startswith("fixture"))
