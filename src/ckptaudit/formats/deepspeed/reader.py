"""DeepSpeed checkpoints: a ``global_stepN/`` folder (or the root above it), read without executing anything.

What ``engine.save_checkpoint(root)`` writes (DeepSpeed 0.x, checked against 0.19.8) and where each part lives:

- ``root/latest``: a text file naming the tag folder ``load_checkpoint`` resumes from (``global_stepN``);
  ``root/zero_to_fp32.py``: DeepSpeed's own converter script (never run here).
- ``root/<tag>/mp_rank_XX_model_states.pt`` (ZeRO 0-2; ZeRO-3: ``zero_pp_rank_R_mp_rank_XX_model_states.pt``,
  one per data-parallel rank): ``module`` (the **bf16/fp16 compute copies**; empty placeholders under ZeRO-3),
  ``buffer_names``, ``param_shapes`` (per param group, name -> shape, in flat-buffer order),
  ``frozen_param_shapes``/``frozen_param_fragments``, ``shared_params`` (tied names), ``lr_scheduler``,
  ``data_sampler``, ``global_steps``, ``global_samples``, ``ds_config``, and the user's ``client_state`` keys
  merged into the top level. ZeRO-0 keeps the optimizer here too (``optimizer``: ``fp32_groups``, one fp32
  master per parameter, and an index-keyed ``optimizer_state_dict``).
- ``root/<tag>/[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt`` (ZeRO 1-3, one per data-parallel rank): the
  **fp32 masters** as flat partitions (ZeRO-1/2 ``single_partition_of_fp32_groups``: the group's flat buffer cut
  into per-rank slices, padding dropped on save; ZeRO-3 ``fp32_flat_groups``: every parameter cut into
  ``ceil(numel / world)`` elements per rank, the last slice padded) and the base optimizer's state of those flat
  partitions (``exp_avg``, ``exp_avg_sq``, ``step``).

:func:`read_deepspeed` rebuilds each parameter's fp32 master the way DeepSpeed's ``deepspeed/utils/
zero_to_fp32.py`` does (shapes and order from ``param_shapes``, per-parameter alignment padding, per-rank
slices), but lazily: a master is a :class:`TensorData` whose :class:`Piece` s point into the ranks' flat
partitions, so it is streamed like any other tensor, never materialised. The moments are rebuilt the same way
and keyed by parameter name. The result is one :class:`Part` (format ``deepspeed``) whose tree
:mod:`ckptaudit.layouts` reads:

``{"fp32_masters": {fqn: tensor}, "module": {fqn: compute copy}, "buffers": {fqn: tensor},
"frozen": {fqn: tensor}, "optimizer": {"state": {fqn: {...}}, "param_groups": [...]},
"lr_scheduler": ..., "client_state": {...}, "deepspeed": {...facts...}}``

The files themselves are read by the caller's ``read_file`` (the ordinary restricted ``torch.save`` reader,
which reports DeepSpeed's pickled classes as not loaded); this module only interprets their trees (the ZeRO partition arithmetic is
:mod:`ckptaudit.formats.deepspeed.zero`). Pure.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding, safe_str, text
from ckptaudit.formats.base import Part, Unreadable
from ckptaudit.formats.deepspeed.zero import (
    ZeroLayoutError,
    ZeroLimitError,
    add_optimizer,
    count_empty,
    part_tree,
    shape_of,
    zero3,
    zero3_frozen,
    zero12,
    zero12_frozen,
)
from ckptaudit.formats.io.tensors import TensorData

if TYPE_CHECKING:
    from ckptaudit.formats.contract import Reading

__all__ = [
    "DeepSpeedRead",
    "is_deepspeed_root",
    "is_deepspeed_step_dir",
    "read_deepspeed",
    "read_deepspeed_into",
    "recognises",
    "resolve_tag",
    "step_of",
]

TAG_FILE = "latest"
"""The file ``save_checkpoint`` writes last, naming the tag ``load_checkpoint`` resumes from."""
CONVERTER = "zero_to_fp32.py"

MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(?:(?P<prec>bf16|fp16|fp32)_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)"
                          r"_optim_states\.pt$")
STEP_DIR = re.compile(r"^global_step(\d+)$")
_MAX_TAG = 255
_MAX_RANKS = 1 << 16

_OWN_KEYS = frozenset(
    "module buffer_names optimizer param_shapes frozen_param_shapes shared_params frozen_param_fragments "
    "lr_scheduler data_sampler random_ltd sparse_tensor_module_names skipped_steps global_steps global_samples "
    "dp_world_size mp_world_size ds_config ds_version checkpoint_parallel_dimensions universal_checkpoint_info "
    "autoep_layers ds_autoep_layers".split()
)
"""Top-level keys of a model-states file that DeepSpeed itself writes; the rest is the user's ``client_state``."""


@dataclass
class DeepSpeedRead:
    part: Part
    findings: list[Finding] = field(default_factory=list)


def is_deepspeed_step_dir(path: str) -> bool:
    """A folder holding a DeepSpeed model-states file (``mp_rank_XX_model_states.pt`` and ZeRO-3's variant)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(MODEL_STATES.match(n) for n in names)


def step_of(name: str) -> int | None:
    """The step of a tag folder named ``global_stepN`` (DeepSpeed's default tag), else ``None``."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def _tag_dirs(root: str) -> list[str]:
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [n for n in names if os.path.isdir(os.path.join(root, n)) and not os.path.islink(os.path.join(root, n))
            and is_deepspeed_step_dir(os.path.join(root, n))]


def is_deepspeed_root(path: str) -> bool:
    """A folder ``save_checkpoint`` wrote into: tag folders beside a ``latest`` tag file or ``zero_to_fp32.py``,
    or (those deleted) tag folders named ``global_stepN``."""
    tags = _tag_dirs(path)
    if os.path.isfile(os.path.join(path, TAG_FILE)) or os.path.isfile(os.path.join(path, CONVERTER)):
        return bool(tags)
    return any(step_of(t) is not None for t in tags)


def read_tag_file(root: str) -> str | None:
    """The tag the ``latest`` file names (stripped), or ``None`` when absent, unreadable or not a plain name."""
    full = os.path.join(root, TAG_FILE)
    if not os.path.isfile(full):
        return None
    try:
        with open(full, "rb") as fh:
            raw = fh.read(_MAX_TAG + 1)
    except OSError:
        return None
    text = raw.decode("utf-8", "replace").strip()
    if not text or len(raw) > _MAX_TAG or "/" in text or os.sep in text or text in (".", "..") or "\x00" in text:
        return None
    return text


def resolve_tag(root: str) -> tuple[str | None, list[Finding]]:
    """The tag folder to audit under a DeepSpeed root: the one ``latest`` names when it exists, else the newest
    ``global_stepN`` (a finding says why). ``None`` when the root holds no tag folder."""
    tags = _tag_dirs(root)
    named = read_tag_file(root)
    newest = max(tags, key=lambda t: (step_of(t) is not None, step_of(t) or 0, t), default=None)
    if named is not None and named in tags:
        return named, [finding("deepspeed.resolved-tag", TAG_FILE,
                               f"DeepSpeed root: audited {named}, the tag its {TAG_FILE} file names (the folder "
                               "load_checkpoint resumes from)", tag=named)]
    if newest is None:
        return None, []
    why = (f"its {TAG_FILE} file names {named!r}, which is not a tag folder here" if named is not None else
           f"it has no readable {TAG_FILE} file")
    return newest, [finding("integrity.incomplete", TAG_FILE,
                            f"DeepSpeed root: {why}; audited the newest tag folder, {newest}, instead "
                            "(load_checkpoint without an explicit tag would fail)", tag=newest)]


def read_deepspeed(step_dir: str, prefix: str, read_file: Callable[[str, str], Part | None]) -> DeepSpeedRead:
    """Read the tag folder ``step_dir`` (its parts named ``prefix + file name``) into one ``deepspeed`` part.

    ``read_file(full_path, name)`` reads one file the ordinary way (recording its findings and size); it
    returns ``None`` for a file that could not be read.
    """
    names = sorted(os.listdir(step_dir))
    models: dict[tuple[int, int], Part | None] = {}
    optims: dict[tuple[int, int], tuple[str, Part | None]] = {}
    for n in names:
        full = os.path.join(step_dir, n)
        m, o = MODEL_STATES.match(n), OPTIM_STATES.match(n)
        if m:
            models[(int(m["mp"]), int(m["dp"] or 0))] = read_file(full, prefix + n)
        elif o:
            optims[(int(o["mp"]), int(o["dp"]))] = (prefix + n, read_file(full, prefix + n))
    findings: list[Finding] = []
    mp_ranks = sorted({mp for mp, _ in models} | {mp for mp, _ in optims})
    tree: dict[str, Any] = {"fp32_masters": {}, "module": {}, "buffers": {}, "frozen": {},
                            "optimizer": None, "lr_scheduler": None, "client_state": {}, "deepspeed": {}}
    for mp in mp_ranks:
        name_prefix = f"mp_rank_{mp:02d}/" if len(mp_ranks) > 1 else ""
        _read_mp_rank(mp, name_prefix, prefix, models, optims, tree, findings)
    copies = [k for k, v in tree["module"].items() if isinstance(v, TensorData)]
    if copies and tree["fp32_masters"]:
        dtypes = sorted({tree["module"][k].dtype.name for k in copies})
        placeholders = all(tree["module"][k].numel == 0 for k in copies)
        where = tree["deepspeed"].get("masters_where", "the optimizer shards")
        findings.append(finding(
            "deepspeed.compute-copies", f"{prefix}module",
            f"module holds the {'/'.join(dtypes)} compute copies of {len(copies)} parameters"
            + (" (empty ZeRO-3 placeholders)" if placeholders else "")
            + f"; the fp32 masters, rebuilt from {where}, are the parameters audited",
            parameters=len(copies)))
    return DeepSpeedRead(Part(prefix.rstrip("/"), "deepspeed", tree), findings)


# ---------------------------------------------------------------------------------------------------------------
# one tensor-parallel rank


def _dict(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _opaque_value(value: Any) -> Any:
    """An enum pickled as ``Enum(value)`` and read inertly (``Opaque``): its value; plain values pass through."""
    args = getattr(value, "args", None)
    if isinstance(args, tuple) and len(args) == 1 and type(value).__name__ == "Opaque":
        return args[0]
    return value


def _read_mp_rank(mp: int, name_prefix: str, prefix: str, models: dict[tuple[int, int], Part | None],
                  optims: dict[tuple[int, int], tuple[str, Part | None]], tree: dict[str, Any],
                  findings: list[Finding]) -> None:
    model_parts = {dp: p for (m, dp), p in models.items() if m == mp}
    rank0 = part_tree(model_parts.get(0))
    facts: dict[str, Any] = tree["deepspeed"]
    if rank0 is None:
        model_name = f"{prefix}mp_rank_{mp:02d}_model_states.pt"
        findings.append(finding(
            "deepspeed.masters-missing", model_name,
            f"{model_name} (data-parallel rank 0's model states) is missing or unreadable: it holds the parameter "
            "names and shapes the fp32 masters are rebuilt with, so the masters cannot be placed; DeepSpeed's "
            "load_checkpoint cannot resume from this tag"))
        return
    module = _dict(rank0.get("module"))
    raw_buffers = rank0.get("buffer_names")
    buffer_names = {b for b in raw_buffers if isinstance(b, str)} if isinstance(raw_buffers, list) else set()
    for key, value in module.items():
        if not isinstance(key, str):
            continue
        (tree["buffers"] if key in buffer_names else tree["module"])[name_prefix + key] = value
    for key, value in rank0.items():
        if isinstance(key, str) and key not in _OWN_KEYS:
            tree["client_state"][key] = value
    if tree["lr_scheduler"] is None:
        tree["lr_scheduler"] = rank0.get("lr_scheduler")
    # The saved ds_config is a record, not what load_checkpoint reads (the resuming engine has its own config):
    # where it is damaged or silent, the files present decide the stage and the dtype.
    config = _dict(rank0.get("ds_config"))
    raw_stage = _dict(config.get("zero_optimization")).get("stage")
    has_shards = any(m == mp for m, _ in optims)
    stage = (raw_stage if isinstance(raw_stage, int) and not isinstance(raw_stage, bool) and 0 <= raw_stage <= 3
             else 1 if has_shards else 0)
    dtype = (next((d for d in ("bf16", "fp16") if _dict(config.get(d)).get("enabled")), "fp32")
             if isinstance(rank0.get("ds_config"), dict) else _compute_dtype(module, buffer_names, optims))
    facts.update({k: rank0.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "dp_world_size",
                                             "mp_world_size", "ds_version") if k in rank0})
    # What the schedule needs to be recomputed (checks/lr_history.py): the config's scheduler and optimizer; and its
    # precision settings, the run's record of where its masters are (layouts/precision.py).
    facts.setdefault("ds_config", {k: config[k] for k in ("scheduler", "optimizer", "bf16", "bfloat16", "fp16")
                                   if k in config})
    facts.setdefault("ds_config_where", f"{prefix}mp_rank_{mp:02d}_model_states.pt/ds_config")
    facts.setdefault("zero_stage", stage)
    facts.setdefault("dtype", dtype)
    facts["data_sampler"] = rank0.get("data_sampler") is not None
    shared = rank0.get("shared_params")
    shared_map = {k: v for k, v in shared.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(shared, dict) else {}
    if stage == 0 or isinstance(rank0.get("optimizer"), dict):
        _stage0(mp, name_prefix, prefix, rank0, module, buffer_names, tree, findings)
    else:
        _zero(mp, name_prefix, prefix, stage, rank0, model_parts, optims, tree, findings)
    masters = tree["fp32_masters"]
    for alias, original in shared_map.items():
        if name_prefix + original in masters:
            masters[name_prefix + alias] = masters[name_prefix + original]


def _compute_dtype(module: dict[str, Any], buffer_names: set[str],
                   optims: dict[tuple[int, int], tuple[str, Part | None]]) -> str:
    """The engine's dtype without its config: the optimizer shards' name prefix (``bf16_zero_pp_rank_...``), else
    the module weights' one dtype, else fp32."""
    names = {os.path.basename(name) for name, _ in optims.values()}
    for prec in ("bf16", "fp16"):
        if names and all(n.startswith(prec + "_") for n in names):
            return prec
    dtypes = {v.dtype.name for k, v in module.items() if k not in buffer_names and isinstance(v, TensorData)}
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dtypes.pop(), "fp32") if len(dtypes) == 1 else "fp32"


def _stage0(mp: int, name_prefix: str, prefix: str, rank0: dict[str, Any], module: dict[str, Any],
            buffer_names: set[str], tree: dict[str, Any], findings: list[Finding]) -> None:
    """ZeRO-0: one fp32 master per parameter in ``optimizer.fp32_groups``, state keyed by position. An fp32
    engine (no bf16/fp16) trains the module weights themselves: they are the masters, ``optimizer`` is the torch
    optimizer's own state dict."""
    where = f"{prefix}mp_rank_{mp:02d}_model_states.pt"
    opt = rank0.get("optimizer")
    names = [k for k, v in module.items() if isinstance(k, str) and k not in buffer_names
             and isinstance(v, TensorData | Unreadable)]
    groups = opt.get("fp32_groups") if isinstance(opt, dict) else None
    fp32_engine = tree["deepspeed"].get("dtype") == "fp32"
    if isinstance(opt, dict) and not isinstance(groups, list) and fp32_engine and "state" in opt:
        masters: list[Any] = [module[n] for n in names]
        inner: Any = opt
        for n in names:  # not compute copies: the fp32 weights are what the optimizer updates
            tree["module"].pop(name_prefix + n, None)
    elif isinstance(opt, dict) and isinstance(groups, list):
        masters = [t for g in groups if isinstance(g, list) for t in g]
        inner = opt.get("optimizer_state_dict")
    elif isinstance(opt, dict) and "fp32_groups_flat" in opt:
        findings.append(finding(
            "deepspeed.not-judged", where,
            f"{where} keeps the fp32 masters in the fused fp16 optimizer's flat groups (fp32_groups_flat), a layout "
            "this reader does not map back to parameters; the masters were not judged (their presence is not in "
            "doubt)"))
        tree["deepspeed"]["masters_unread"] = True
        return
    else:
        _missing(findings, where, "it holds no optimizer (fp32_groups) for ZeRO stage 0")
        return
    shapes_ok = len(masters) == len(names) and all(
        isinstance(t, TensorData) and isinstance(module[n], TensorData) and t.shape == module[n].shape
        for t, n in zip(masters, names, strict=False))
    if not shapes_ok:
        _missing(findings, where, f"its {len(masters)} fp32 masters (optimizer/fp32_groups) do not line up with the "
                 f"{len(names)} parameters of module by order and shape")
        return
    for n, t in zip(names, masters, strict=True):
        tree["fp32_masters"][name_prefix + n] = t
    state = inner.get("state") if isinstance(inner, dict) else None
    raw_groups = inner.get("param_groups") if isinstance(inner, dict) else None
    by_fqn: dict[str, dict[str, Any]] = {}
    if isinstance(state, dict):
        for key, entry in state.items():
            if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(names) and isinstance(entry, dict):
                by_fqn[name_prefix + names[key]] = {safe_str(k): v for k, v in entry.items()}
    out_groups = []
    for g in raw_groups if isinstance(raw_groups, list) else []:
        if isinstance(g, dict):
            ps = [name_prefix + names[i] for i in g.get("params") or () if isinstance(i, int)
                  and not isinstance(i, bool) and 0 <= i < len(names)]
            out_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
    add_optimizer(tree, by_fqn, out_groups)
    tree["deepspeed"]["masters_where"] = (f"{where} (module: an fp32 engine trains its weights directly)"
                                          if inner is opt else f"{where} (optimizer/fp32_groups)")


def _missing(findings: list[Finding], subject: str, why: str, *, limit: bool = False) -> None:
    if limit:  # a safety limit of this reader: say so, claim nothing about what DeepSpeed would do
        findings.append(finding(
            "deepspeed.masters-missing", subject, f"the fp32 masters were not rebuilt: {why}", why=why, limit=True))
        return
    findings.append(finding(
        "deepspeed.masters-missing", subject,
        f"the fp32 masters are gone: {why}. DeepSpeed's load_checkpoint would fail, or (load_optimizer_states="
        "False) rebuild the masters from the bf16/fp16 module weights, losing their low mantissa bits and the "
        "optimizer moments", why=why))


def _zero(mp: int, name_prefix: str, prefix: str, stage: int, rank0: dict[str, Any],
          model_parts: dict[int, Part | None], optims: dict[tuple[int, int], tuple[str, Part | None]],
          tree: dict[str, Any], findings: list[Finding]) -> None:
    """ZeRO 1-3: rebuild the masters and moments from every data-parallel rank's flat partitions."""
    mine = {dp: v for (m, dp), v in optims.items() if m == mp}
    world = rank0.get("dp_world_size")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= _MAX_RANKS:
        world = max(mine, default=-1) + 1  # a damaged or absurd dp_world_size: trust the files present
    subject = f"{prefix}*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt"
    if world > _MAX_RANKS:
        _missing(findings, subject, f"the optimizer shards name data-parallel rank {world - 1}, beyond any real "
                 f"job ({_MAX_RANKS} ranks); their partitions were not assembled")
        return
    beyond = sorted(dp for dp in mine if dp >= world)
    if beyond:
        # DeepSpeed's zero_to_fp32 counts the *_optim_states.pt files against the ranks the save had and refuses
        # the folder ("Possibly due to an overwrite of an old checkpoint"); load_checkpoint reads ranks 0..N-1
        # only. Which files belong to this save is not decided: an error, the masters judged as load_checkpoint
        # reads them.
        names = [mine[dp][0] for dp in beyond]
        findings.append(finding(
            "integrity.corrupt", names[0],
            f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}: optimizer shard(s) of data-parallel "
            f"rank(s) {', '.join(map(str, beyond[:8]))}, beyond the {world} ranks the model states record "
            "(dp_world_size): files of another save (an overwrite of an older checkpoint with more ranks?). "
            f"DeepSpeed's zero_to_fp32 refuses this folder (it expects {world} *_optim_states.pt files, finds "
            f"{len(mine)}); load_checkpoint reads ranks 0-{world - 1} only, which are audited",
            files=names[:64], ranks=beyond[:64], world_size=world))
        mine = {dp: v for dp, v in mine.items() if dp < world}
    absent = [dp for dp in range(world) if dp not in mine]
    unreadable = [mine[dp][0] for dp in sorted(mine) if part_tree(mine[dp][1]) is None]
    if absent or unreadable or not mine:
        bits = []
        if absent:
            bits.append(f"the optimizer shard{'s' if len(absent) > 1 else ''} of data-parallel rank"
                        f"{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} of {world} "
                        f"{'are' if len(absent) > 1 else 'is'} missing")
        if unreadable:
            bits.append(f"{', '.join(unreadable)} cannot be read (see the integrity findings)")
        _missing(findings, subject, "; ".join(bits) + f" (ZeRO stage {stage} keeps them only in the "
                 "*_optim_states.pt files)")
        return
    states = []
    for dp in range(world):
        t = part_tree(mine[dp][1])
        osd = t.get("optimizer_state_dict") if t is not None else None
        if not isinstance(osd, dict):
            _missing(findings, mine[dp][0], f"{mine[dp][0]} has no optimizer_state_dict")
            return
        states.append(osd)
    stage = _opaque_value(states[0].get("zero_stage"))
    stage = stage if isinstance(stage, int) and not isinstance(stage, bool) else tree["deepspeed"].get("zero_stage")
    tree["deepspeed"]["zero_stage"] = stage
    tree["deepspeed"]["dp_world_size"] = world
    shapes = rank0.get("param_shapes")
    try:
        counts = _opaque_value(states[0].get("partition_count"))
        counts = counts if isinstance(counts, list) else [counts] if counts is not None else []
        if counts and not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
            raise ZeroLayoutError("partition_count of the optimizer shards is not a list of ints")
        if counts and max(counts) != world:  # zero_to_fp32's world size: the files must number as many
            raise ZeroLayoutError(f"the optimizer shards record {text(max(counts))} partitions (partition_count), the "
                               f"folder holds {world} ranks' shards")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise ZeroLayoutError("param_shapes of the model states is not a list of name -> shape maps")
        groups: list[list[tuple[str, tuple[int, ...]]]] = []
        empty = 0
        for g in shapes:
            group = []
            for n, s in g.items():
                shape = shape_of(s)
                if 0 in shape:  # counted as they come: a flood of them stops here
                    empty = count_empty((shape,), empty, "param_shapes")
                group.append((str(n), shape))
            groups.append(group)
        if "fp32_flat_groups" in states[0]:
            zero3(name_prefix, groups, states, tree)
        elif "single_partition_of_fp32_groups" in states[0]:
            zero12(name_prefix, groups, states, tree)
        else:
            raise ZeroLayoutError("no fp32 partitions (single_partition_of_fp32_groups / fp32_flat_groups) in "
                               f"{mine[0][0]}")
        if stage == 3:
            zero3_frozen(name_prefix, rank0, model_parts, world, tree, empty)
        else:
            zero12_frozen(name_prefix, rank0, tree)
    except ZeroLayoutError as exc:
        for key in [k for k in tree["fp32_masters"] if k.startswith(name_prefix)]:
            del tree["fp32_masters"][key]  # this tensor-parallel rank's, not the others'
        if isinstance(tree["optimizer"], dict):
            for key in [k for k in tree["optimizer"]["state"] if k.startswith(name_prefix)]:
                del tree["optimizer"]["state"][key]
        _missing(findings, subject, f"the flat partitions cannot be mapped back to parameters ({exc})",
                 limit=isinstance(exc, ZeroLimitError))
        return
    tree["deepspeed"]["masters_where"] = (f"{prefix}*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt "
                                          f"({world} ranks' flat partitions)")


def recognises(path: str) -> bool:
    """A DeepSpeed tag folder, or the root ``save_checkpoint`` wrote."""
    return is_deepspeed_step_dir(path) or is_deepspeed_root(path)


def read_deepspeed_into(path: str, name: str, reading: Reading) -> None:
    """The DeepSpeed directory reader (:mod:`ckptaudit.formats.contract`): a tag folder, or the root
    ``save_checkpoint`` wrote (its ``latest`` tag resolved), read into ``reading`` as one ``deepspeed`` part."""
    step_dir, prefix = path, ""
    if not is_deepspeed_step_dir(path):
        tag, notes = resolve_tag(path)
        reading.findings.extend(notes)
        for extra in (TAG_FILE, CONVERTER):
            if os.path.isfile(os.path.join(path, extra)):  # recorded, never executed
                reading.files[extra] = os.path.getsize(os.path.join(path, extra))
        assert tag is not None  # is_deepspeed_root: at least one tag folder
        step_dir, prefix = os.path.join(path, tag), tag + "/"
    read = read_deepspeed(step_dir, prefix, reading.read_entry)
    reading.findings.extend(read.findings)
    reading.parts.append(read.part)
