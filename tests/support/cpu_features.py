"""The CPU features the test suite adapts to, and the switch that makes this machine look like a CPU without them.

    CKPTAUDIT_TEST_CPU=avx2 .venv/bin/python -m pytest      # the suite as on an AVX2-only CPU (no oneDNN fp16/bf16)
    .venv/bin/python tests/support/cpu_features.py                   # what this machine is, as .ci/run prints it

The libraries decide what a CPU can do through oneDNN: ``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` and
``_is_mkldnn_bf16_supported()`` (DeepSpeed's CPU accelerator refuses an fp16 engine when the first is False). On an
AMD EPYC of the AVX2 generations both are False. ``CKPTAUDIT_TEST_CPU=avx2`` gives this machine the same answers
the way such a CPU does, not by patching the predicates: it caps oneDNN at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, so
oneDNN itself has no bf16 or fp16 kernels to offer and says so) and dispatches ATen's CPU kernels as on AVX2
(``ATEN_CPU_CAPABILITY=avx2``). Both are environment variables read once, when torch and oneDNN start, and every
process the tests start inherits them (writer subprocesses, spawned and forked ranks). ``apply`` runs in
``conftest.py`` before the test process first touches oneDNN, and refuses to run the suite if the predicates do
not come out False.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

SWITCH = "CKPTAUDIT_TEST_CPU"
PROFILES: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
"""What each value of the switch sets. ``native`` (or unset): the machine as it is."""


def profile() -> str:
    value = os.environ.get(SWITCH, "").strip() or "native"
    if value not in PROFILES:
        raise ValueError(f"{SWITCH}={value!r}: use one of {', '.join(PROFILES)} (avx2: as a CPU without oneDNN's "
                         "fp16 and bf16 kernels)")
    return value


def apply() -> str:
    """(test process, before torch starts oneDNN) Set the environment of the chosen profile; return its name.

    Raises ``RuntimeError`` when the profile cannot hold: oneDNN was already started in this process with other
    limits, or the environment already asks for something else.
    """
    name = profile()
    for key, value in PROFILES[name].items():
        if os.environ.get(key, value) != value:
            raise RuntimeError(f"{SWITCH}={name} sets {key}={value}, but the environment already has "
                               f"{key}={os.environ[key]}: unset one of them")
        os.environ[key] = value
    if name != "native":
        facts = predicates()
        if facts["onednn_fp16"] or facts["onednn_bf16"]:
            raise RuntimeError(f"{SWITCH}={name} did not take: oneDNN still reports fp16 {facts['onednn_fp16']}, bf16 "
                               f"{facts['onednn_bf16']} (oneDNN was started before conftest.py set "
                               f"{', '.join(PROFILES[name])}; set them in the environment instead)")
    return name


def predicates() -> dict[str, Any]:
    """(this process) What torch and oneDNN report about this CPU."""
    import torch

    return {
        "torch": torch.__version__,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
        "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


def deepspeed_predicates() -> dict[str, Any]:
    """(this process) What DeepSpeed's CPU accelerator answers, the predicates its engine checks before it builds an
    fp16 or bf16 engine (``DeepSpeedEngine._do_sanity_check``); ``None`` without DeepSpeed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return {"deepspeed_fp16": None, "deepspeed_bf16": None}
    acc = get_accelerator()
    return {"deepspeed_fp16": bool(acc.is_fp16_supported()), "deepspeed_bf16": bool(acc.is_bf16_supported())}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(*, deepspeed: bool = False) -> str:
    facts = {**predicates(), **(deepspeed_predicates() if deepspeed else {})}
    parts = [f"CPU: {cpu_model()} ({os.cpu_count()} cores)", f"{SWITCH}={profile()}",
             f"torch {facts['torch']} (ATen CPU capability {facts['aten_cpu_capability']})",
             f"oneDNN fp16 {facts['onednn_fp16']}, bf16 {facts['onednn_bf16']}"]
    if deepspeed:
        parts.append(f"DeepSpeed CPU accelerator fp16 {facts['deepspeed_fp16']}, bf16 {facts['deepspeed_bf16']}")
    return "; ".join(parts)


if __name__ == "__main__":
    try:
        apply()
    except (ValueError, RuntimeError) as exc:
        print(f"cpu_features: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(describe(deepspeed=True))
