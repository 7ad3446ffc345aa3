"""``ckptaudit demo``: the whole story on the built-in recipe, on CPU, with several real ranks.

1. (2 ranks) train the tiny GPT under FSDP2 with a bf16 ``MixedPrecisionPolicy`` for a few steps;
2. (all ranks) save a faithful checkpoint through the documented path (``get_state_dict`` + DCP);
3. (all ranks) save a lossy one through a custom exporter that captured the bf16 compute copies in forward;
4. (fresh processes) resume from each and take the same steps as the uninterrupted run;
5. (2 ranks) probe a live job: masters, compute copies and what the lossy exporter saved, side by side;
6. (this process) audit both and print the verdicts; write the reports (JSON, one HTML page) under the output
   directory.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from ckptaudit.findings import Severity

__all__ = ["DemoResult", "run_demo"]


@dataclass(frozen=True)
class DemoResult:
    out_dir: str
    exit_code: int
    html: str


def run_demo(out_dir: str, *, nproc: int = 2, steps: int = 8, out: TextIO = sys.stdout,
             err: TextIO = sys.stderr) -> DemoResult:
    """Run the demo, print the verdicts to ``out``; progress goes to ``err``.

    Exit code 0 when the story holds (the faithful checkpoint is clean and resumes bit-identically; the lossy
    one is flagged by the audit and drifts in the resume test), 1 otherwise.
    """
    from ckptaudit.auditing.judge import run_audit
    from ckptaudit.probe.run import run_probe
    from ckptaudit.report import OutputFormat, render
    from ckptaudit.report.html import render_page
    from ckptaudit.resume import DEFAULT_RECIPE, ResumeConfig, run_resume_test

    os.makedirs(out_dir, exist_ok=True)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        err.write(f"[{time.monotonic() - t0:5.1f}s] {msg}\n")
        err.flush()

    say(f"tiny GPT, FSDP2 with a bf16 MixedPrecisionPolicy (fp32 masters), {nproc} CPU ranks over gloo")
    cfg = ResumeConfig(
        exporters=("ckptaudit.exporters:compute_copy",),
        nproc=nproc,
        save_at=steps,
        steps=steps,
        workdir=out_dir,
        reference_name="faithful",
        candidate_names=("lossy-compute-copy.pt",),
    )
    resume_report = run_resume_test(cfg, log=say)
    say("probe a live job: sharded masters, bf16 compute copies in forward, and what the lossy exporter saved")
    probe_report = run_probe(DEFAULT_RECIPE, "ckptaudit.exporters:compute_copy", nproc=nproc, steps=2,
                             out_dir=os.path.join(out_dir, "probe"))
    say("audit both checkpoints offline")
    audits = {name: run_audit(os.path.join(out_dir, name)) for name in ("faithful", "lossy-compute-copy.pt")}
    labels = {"faithful": "documented path: get_state_dict + torch.distributed.checkpoint",
              "lossy-compute-copy.pt": "custom exporter: bf16 compute copies captured in forward, upcast to fp32"}
    # The files first: a reader of stdout that goes away (`| head`) cuts the printing short, not the reports.
    for name, report in audits.items():
        with open(os.path.join(out_dir, f"audit-{name.split('.')[0]}.json"), "w") as fh:
            render(report, OutputFormat.JSON, fh)
    for file_name, report in (("probe.json", probe_report), ("resume.json", resume_report)):
        with open(os.path.join(out_dir, file_name), "w") as fh:
            render(report, OutputFormat.JSON, fh)
    html_path = os.path.join(out_dir, "report.html")
    with open(html_path, "w") as fh:
        render_page([resume_report, *audits.values(), probe_report], fh, title="ckptaudit demo")
    faithful_ok = not audits["faithful"].fails(Severity.ERROR)
    lossy_caught = audits["lossy-compute-copy.pt"].fails(Severity.ERROR)
    candidates = resume_report.extra["resume"]["candidates"]
    probe_caught = any(f.code == "probe.saved-compute-copy" for f in probe_report.findings)
    drift_caught = bool(candidates) and candidates[0].get("verdict") == "drift"
    floor = resume_report.extra["resume"]["noise_floor"]
    ok = faithful_ok and lossy_caught and drift_caught and floor == 0 and probe_caught
    try:
        for name, report in audits.items():
            out.write(f"\n=== audit {name}  ({labels[name]})\n")
            render(report, OutputFormat.TABLE, out)
        out.write("\n=== live probe (the lossy exporter on a running job)\n")
        render(probe_report, OutputFormat.TABLE, out)
        out.write("\n=== differential resume test (fresh processes; each checkpoint restored alone through its "
                  "loader)\n")
        render(resume_report, OutputFormat.TABLE, out)
        out.write(f"\nverdict: faithful checkpoint {'clean' if faithful_ok else 'NOT clean'} and resumes "
                  f"{'bit-identically' if floor == 0 else f'within the noise floor {floor:.1e}'}; lossy checkpoint "
                  f"{'caught by the audit' if lossy_caught else 'MISSED by the audit'} and "
                  f"{'drifts in the resume test' if drift_caught else 'did NOT drift'}; the probe "
                  f"{'sees it save the bf16 compute copies' if probe_caught else 'did NOT catch it'}.\n")
        out.write(f"HTML report: {html_path}   ({time.monotonic() - t0:.0f} s)\n")
    except BrokenPipeError:  # the reader of stdout has gone; the reports are written and the verdict stands
        pass
    return DemoResult(out_dir, 0 if ok else 1, html_path)
