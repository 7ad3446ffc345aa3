"""DeepSpeed ``global_stepN/`` and its root: :mod:`~ckptaudit.layouts.deepspeed.layout` (the masters, compute copies,
moments and the rest of the inventory), imported only when a checkpoint holds the part
:mod:`ckptaudit.formats.deepspeed.reader` builds; its rule is registered here."""

from ckptaudit.layouts.rules import PartRule, register_rule

# After the rules by file name, before the component files and the keyed rule: the DeepSpeed part is taken whole.
register_rule(PartRule("deepspeed", order=30,
                  applies=lambda part, ctx: part.format == "deepspeed" and isinstance(part.tree, dict),
                  read="ckptaudit.layouts.deepspeed.layout:read_deepspeed_part"))
