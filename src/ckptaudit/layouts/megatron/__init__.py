"""Megatron-Core ``torch_dist`` checkpoints: :mod:`~ckptaudit.layouts.megatron.layout` (the whole checkpoint's
view), imported only when a DCP directory carries Megatron-Core's ``metadata.json`` or ``common.pt``; its rule is
registered here."""

from ckptaudit.layouts.rules import CheckpointRule, register_rule

MEGATRON_FILES = ("metadata.json", "common.pt")

register_rule(CheckpointRule(
    "megatron", order=10,
    applies=lambda ckpt: ckpt.format == "dcp" and any(p.name in MEGATRON_FILES for p in ckpt.parts),
    view="ckptaudit.layouts.megatron.layout:view_if_megatron"))
