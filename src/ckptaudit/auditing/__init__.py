"""The audit engine: a checkpoint path in, a :class:`~ckptaudit.findings.RawReport` out.

files -> readers (:mod:`ckptaudit.formats`) -> interpretation (:mod:`ckptaudit.layouts`) -> the scan
(:mod:`~ckptaudit.auditing.scan`: the plan, each tensor's role, then one streaming pass per tensor on threads,
:mod:`~ckptaudit.auditing.tensor_scan`) -> the judgement (:mod:`~ckptaudit.auditing.judge`: the checks of
:mod:`ckptaudit.checks` run on the records) -> the report. :mod:`~ckptaudit.auditing.distributed` runs the same
steps with the scan shared between the ranks of a ``torchrun`` job, each rank sent its share
(:mod:`~ckptaudit.auditing.share`) by rank 0.
"""
