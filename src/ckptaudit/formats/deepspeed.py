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
which reports DeepSpeed's pickled classes as not loaded); this module only interprets their trees. Pure.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.formats.base import Part, Unreadable
from ckptaudit.formats.tensors import Piece, TensorData
from ckptaudit.model import Finding

__all__ = [
    "DeepSpeedRead",
    "is_deepspeed_root",
    "is_deepspeed_step_dir",
    "read_deepspeed",
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
_MAX_RANK_DIMS = 32

_OWN_KEYS = frozenset(
    "module buffer_names optimizer param_shapes frozen_param_shapes shared_params frozen_param_fragments "
    "lr_scheduler data_sampler random_ltd sparse_tensor_module_names skipped_steps global_steps global_samples "
    "dp_world_size mp_world_size ds_config ds_version checkpoint_parallel_dimensions universal_checkpoint_info "
    "autoep_layers ds_autoep_layers".split()
)
"""Top-level keys of a model-states file that DeepSpeed itself writes; the rest is the user's ``client_state``."""


class _LayoutError(ValueError):
    """The files' own bookkeeping does not add up (damaged or hand-edited): the masters cannot be rebuilt."""


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


def _tree(part: Part | None) -> dict[str, Any] | None:
    return part.tree if part is not None and isinstance(part.tree, dict) else None


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
    rank0 = _tree(model_parts.get(0))
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
    config = _dict(rank0.get("ds_config"))
    raw_stage = _dict(config.get("zero_optimization")).get("stage")
    stage = raw_stage if isinstance(raw_stage, int) and not isinstance(raw_stage, bool) else 0
    dtype = next((d for d in ("bf16", "fp16") if _dict(config.get(d)).get("enabled")), "fp32")
    facts.update({k: rank0.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "dp_world_size",
                                             "mp_world_size", "ds_version") if k in rank0})
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
                by_fqn[name_prefix + names[key]] = {str(k): v for k, v in entry.items()}
    out_groups = []
    for g in raw_groups if isinstance(raw_groups, list) else []:
        if isinstance(g, dict):
            ps = [name_prefix + names[i] for i in g.get("params") or () if isinstance(i, int)
                  and not isinstance(i, bool) and 0 <= i < len(names)]
            out_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
    _add_optimizer(tree, by_fqn, out_groups)
    tree["deepspeed"]["masters_where"] = (f"{where} (module: an fp32 engine trains its weights directly)"
                                          if inner is opt else f"{where} (optimizer/fp32_groups)")


def _missing(findings: list[Finding], subject: str, why: str) -> None:
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
    absent = [dp for dp in range(world) if dp not in mine]
    unreadable = [mine[dp][0] for dp in sorted(mine) if _tree(mine[dp][1]) is None]
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
        t = _tree(mine[dp][1])
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
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise _LayoutError("param_shapes of the model states is not a list of name -> shape maps")
        groups = [[(str(n), _shape(s)) for n, s in g.items()] for g in shapes]
        if "fp32_flat_groups" in states[0]:
            _zero3(name_prefix, groups, states, tree)
        elif "single_partition_of_fp32_groups" in states[0]:
            _zero12(name_prefix, groups, states, tree)
        else:
            raise _LayoutError("no fp32 partitions (single_partition_of_fp32_groups / fp32_flat_groups) in "
                               f"{mine[0][0]}")
        if stage == 3:
            _zero3_frozen(name_prefix, rank0, model_parts, world, tree)
        else:
            _zero12_frozen(name_prefix, rank0, tree)
    except _LayoutError as exc:
        for key in [k for k in tree["fp32_masters"] if k.startswith(name_prefix)]:
            del tree["fp32_masters"][key]  # this tensor-parallel rank's, not the others'
        if isinstance(tree["optimizer"], dict):
            for key in [k for k in tree["optimizer"]["state"] if k.startswith(name_prefix)]:
                del tree["optimizer"]["state"][key]
        _missing(findings, subject, f"the flat partitions cannot be mapped back to parameters ({exc})")
        return
    tree["deepspeed"]["masters_where"] = (f"{prefix}*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt "
                                          f"({world} ranks' flat partitions)")


def _add_optimizer(tree: dict[str, Any], state: dict[str, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Merge one tensor-parallel rank's optimizer state (names already prefixed) into the tree's."""
    if not isinstance(tree["optimizer"], dict):
        tree["optimizer"] = {"state": {}, "param_groups": []}
    tree["optimizer"]["state"].update(state)
    tree["optimizer"]["param_groups"].extend(groups)


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > _MAX_RANK_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in value):
        raise _LayoutError(f"parameter shape {value!r} is not a tuple of non-negative ints")
    return tuple(value)


def _flat(value: Any, what: str) -> TensorData:
    """A saved flat partition: a 1-D tensor in one contiguous piece."""
    if not isinstance(value, TensorData):
        raise _LayoutError(f"{what} is {'unreadable' if isinstance(value, Unreadable) else 'not a tensor'}")
    if len(value.shape) != 1 or len(value.pieces) != 1 or not value.pieces[0].is_contiguous():
        raise _LayoutError(f"{what} is not a flat contiguous tensor (shape {list(value.shape)})")
    return value


# A segment: elements [src_start, src_start + length) of the flat ``src`` hold elements
# [logical_start, logical_start + length) of the parameter (row-major).
_Segment = tuple[TensorData, int, int, int]


def _assemble(shape: tuple[int, ...], segments: list[_Segment]) -> TensorData:
    """A lazy tensor of ``shape`` made of rectangular pieces of the flat partitions (nothing is read)."""
    numel = math.prod(shape)
    if sum(s[3] for s in segments) != numel:
        raise _LayoutError(f"partitions hold {sum(s[3] for s in segments)} elements of a parameter with {numel}")
    dtype = segments[0][0].dtype if segments else None
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    pieces: list[Piece] = []
    for src, src_start, logical_start, length in segments:
        if src.dtype != dtype:
            raise _LayoutError("the partitions of one parameter have different dtypes")
        if src_start < 0 or src_start + length > src.numel:
            raise _LayoutError(f"a slice [{src_start}, {src_start + length}) exceeds its partition's "
                               f"{src.numel} elements")
        p0 = src.pieces[0]
        for offsets, sizes in _blocks(shape, logical_start, length):
            first = sum(o * s for o, s in zip(offsets, strides, strict=True))
            pieces.append(Piece(p0.file, p0.data_offset, p0.storage_offset + src_start + (first - logical_start),
                                sizes, strides, offsets))
    if dtype is None:
        raise _LayoutError("a parameter with no elements has no partition to take its dtype from")
    return TensorData(dtype, shape, tuple(pieces))


def _blocks(shape: tuple[int, ...], start: int, length: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangular blocks (offsets, sizes) covering the row-major element range ``[start, start + length)``."""
    if length <= 0:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (length,))]
    inner = math.prod(shape[1:])
    end = start + length
    row, col = divmod(start, inner)
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if col:
        take = min(inner - col, length)
        out += [((row, *o), (1, *s)) for o, s in _blocks(shape[1:], col, take)]
        start += take
        row += 1
    full = (end - start) // inner
    if full > 0:
        out.append(((row, *(0 for _ in shape[1:])), (full, *shape[1:])))
        start += full * inner
        row += full
    if end > start:
        out += [((row, *o), (1, *s)) for o, s in _blocks(shape[1:], 0, end - start)]
    return out


def _base_state(osd: dict[str, Any], key: str, group: int) -> dict[str, Any]:
    """The base optimizer's state entry of flat group ``group`` (keyed by the group's one param index)."""
    base = osd.get(key)
    if not isinstance(base, dict):
        return {}
    state, groups = base.get("state"), base.get("param_groups")
    index: Any = group
    if isinstance(groups, list) and group < len(groups) and isinstance(groups[group], dict):
        ps = groups[group].get("params")
        if isinstance(ps, list) and len(ps) == 1:
            index = ps[0]
    entry = state.get(index) if isinstance(state, dict) else None
    return entry if isinstance(entry, dict) else {}


def _param_groups(osd: dict[str, Any], key: str, names: list[list[str]]) -> list[dict[str, Any]]:
    base = osd.get(key)
    raw = base.get("param_groups") if isinstance(base, dict) else None
    out = []
    for g, ns in enumerate(names):
        hyper = raw[g] if isinstance(raw, list) and g < len(raw) and isinstance(raw[g], dict) else {}
        out.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": list(ns)})
    return out


def _attach(name: str, shape: tuple[int, ...], numel: int, entries: list[dict[str, Any]],
            spans: Callable[[str, list[dict[str, Any]]], list[_Segment] | None]) -> dict[str, Any]:
    """The optimizer state of one parameter: per-element state rebuilt like the master, scalars from rank 0."""
    state: dict[str, Any] = {}
    for sname, value in entries[0].items():
        if isinstance(value, TensorData) and len(value.shape) == 1 and numel > 0:
            segments = spans(str(sname), entries)
            if segments is not None:
                state[str(sname)] = _assemble(shape, segments)
        elif isinstance(value, TensorData | Unreadable) or not isinstance(value, dict | list):
            state[str(sname)] = value
    return state


def _zero12(name_prefix: str, groups: list[list[tuple[str, tuple[int, ...]]]], states: list[dict[str, Any]],
            tree: dict[str, Any]) -> None:
    """ZeRO-1/2: per group, the ranks' saved partitions concatenated are the group's flat buffer (padding
    dropped); parameters follow in ``param_shapes`` order, each followed by its alignment padding."""
    parts: list[Any] = [s.get("single_partition_of_fp32_groups") for s in states]
    if not all(isinstance(p, list) and len(p) == len(groups) for p in parts):
        raise _LayoutError(f"single_partition_of_fp32_groups does not hold {len(groups)} group(s) on every rank")
    paddings = states[0].get("param_alignment_paddings")
    paddings = paddings if isinstance(paddings, list) else []
    state_tree: dict[str, dict[str, Any]] = {}
    for g, params in enumerate(groups):
        flats = [_flat(p[g], f"rank {r}'s partition of group {g}") for r, p in enumerate(parts)]
        bounds = [0]
        for f in flats:
            bounds.append(bounds[-1] + f.numel)
        pads = paddings[g] if g < len(paddings) else None
        if not (isinstance(pads, list) and len(pads) == len(params) and all(isinstance(x, int) for x in pads)):
            pads = [0] * len(params)
        entries = [_base_state(s, "base_optimizer_state", g) for s in states]

        def spans_of(lo: int, hi: int, sources: list[TensorData], bounds: list[int] = bounds) -> list[_Segment]:
            out: list[_Segment] = []
            for r, src in enumerate(sources):
                a, b = max(lo, bounds[r]), min(hi, bounds[r + 1])
                if a < b:
                    out.append((src, a - bounds[r], a - lo, b - a))
            return out

        offset = 0
        for (name, shape), pad in zip(params, pads, strict=True):
            numel = math.prod(shape)
            if offset + numel > bounds[-1]:
                raise _LayoutError(f"{name} would end at element {offset + numel} of group {g}, whose partitions "
                                   f"hold {bounds[-1]}")
            lo, hi = offset, offset + numel
            fqn = name_prefix + name
            tree["fp32_masters"][fqn] = (_assemble(shape, spans_of(lo, hi, flats)) if numel else
                                         TensorData(flats[0].dtype, shape, ()))

            def moment(sname: str, ents: list[dict[str, Any]], lo: int = lo, hi: int = hi,
                       flats: list[TensorData] = flats, spans_of: Any = spans_of) -> list[_Segment] | None:
                # The moments keep the partition padding the saved masters drop (last rank: longer by the pad).
                srcs = [e.get(sname) for e in ents]
                if not all(isinstance(s, TensorData) and len(s.shape) == 1 and s.numel >= f.numel
                           for s, f in zip(srcs, flats, strict=True)):
                    return None
                return spans_of(lo, hi, [_flat(s, sname) for s in srcs])  # type: ignore[no-any-return]

            state_tree[fqn] = _attach(fqn, shape, numel, entries, moment)
            offset = hi + max(0, pad)
        align = 2 * len(states)
        if align * math.ceil(offset / align) != align * math.ceil(bounds[-1] / align):
            raise _LayoutError(f"group {g}'s parameters use {offset} elements, its partitions hold {bounds[-1]}")
    _add_optimizer(tree, state_tree, _param_groups(states[0], "base_optimizer_state",
                                                   [[name_prefix + n for n, _ in ps] for ps in groups]))


def _zero3(name_prefix: str, groups: list[list[tuple[str, tuple[int, ...]]]], states: list[dict[str, Any]],
           tree: dict[str, Any]) -> None:
    """ZeRO-3: in each group's flat partition every parameter takes ``ceil(numel / world)`` elements per rank;
    rank r's slice holds elements ``[r * part, (r + 1) * part)`` of the parameter, the last one padded."""
    world = len(states)
    flats_all: list[Any] = [s.get("fp32_flat_groups") for s in states]
    if not all(isinstance(f, list) and len(f) == len(groups) for f in flats_all):
        raise _LayoutError(f"fp32_flat_groups does not hold {len(groups)} group(s) on every rank")
    state_tree: dict[str, dict[str, Any]] = {}
    for g, params in enumerate(groups):
        flats = [_flat(f[g], f"rank {r}'s flat group {g}") for r, f in enumerate(flats_all)]
        if len({f.numel for f in flats}) != 1:
            raise _LayoutError(f"the ranks' flat partitions of group {g} differ in length "
                               f"({', '.join(str(f.numel) for f in flats)})")
        entries = [_base_state(s, "optimizer_state_dict", g) for s in states]
        offset = 0
        for name, shape in params:
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if offset + part > flats[0].numel:
                raise _LayoutError(f"{name} would end at element {offset + part} of group {g}, whose partitions "
                                   f"hold {flats[0].numel} per rank")

            def spans(sources: list[TensorData], offset: int = offset, part: int = part,
                      numel: int = numel) -> list[_Segment]:
                out: list[_Segment] = []
                for r, src in enumerate(sources):
                    n = min(part, numel - r * part)
                    if n > 0:
                        out.append((src, offset, r * part, n))
                return out

            fqn = name_prefix + name
            tree["fp32_masters"][fqn] = (_assemble(shape, spans(flats)) if numel else
                                         TensorData(flats[0].dtype, shape, ()))

            def moment(sname: str, ents: list[dict[str, Any]], spans: Any = spans,
                       flats: list[TensorData] = flats) -> list[_Segment] | None:
                srcs = [e.get(sname) for e in ents]
                if not all(isinstance(s, TensorData) and s.shape == flats[0].shape for s in srcs):
                    return None
                return spans([_flat(s, sname) for s in srcs])  # type: ignore[no-any-return]

            state_tree[fqn] = _attach(fqn, shape, numel, entries, moment)
            offset += part
        if offset != flats[0].numel:
            raise _LayoutError(f"group {g}'s parameters use {offset} elements per rank, its partitions hold "
                               f"{flats[0].numel}")
    _add_optimizer(tree, state_tree, _param_groups(states[0], "optimizer_state_dict",
                                                   [[name_prefix + n for n, _ in ps] for ps in groups]))


def _zero12_frozen(name_prefix: str, rank0: dict[str, Any], tree: dict[str, Any]) -> None:
    """ZeRO-1/2 frozen parameters: saved whole in ``frozen_param_fragments`` (no optimizer state, no master)."""
    frags = rank0.get("frozen_param_fragments")
    if isinstance(frags, dict):
        for name, value in frags.items():
            if isinstance(name, str) and isinstance(value, TensorData | Unreadable):
                tree["frozen"][name_prefix + name] = value


def _zero3_frozen(name_prefix: str, rank0: dict[str, Any], model_parts: dict[int, Part | None], world: int,
                  tree: dict[str, Any]) -> None:
    """ZeRO-3 frozen parameters: every rank's model states holds its slice in ``frozen_param_fragments``."""
    shapes = rank0.get("frozen_param_shapes")
    if not isinstance(shapes, dict) or not shapes:
        return
    trees = [_tree(model_parts.get(dp)) for dp in range(world)]
    for name, raw in shapes.items():
        if not isinstance(name, str):
            continue
        shape = _shape(raw)
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        frags = [t.get("frozen_param_fragments", {}).get(name) if t is not None and
                 isinstance(t.get("frozen_param_fragments"), dict) else None for t in trees]
        if not all(isinstance(f, TensorData) and len(f.shape) == 1 and f.numel >= min(part, numel - r * part)
                   for r, f in enumerate(frags)):
            tree["frozen"][name_prefix + name] = Unreadable(
                f"ZeRO-3 frozen parameter {name}: a rank's fragment is missing or unreadable")
            continue
        segments: list[_Segment] = []
        for r, f in enumerate(frags):
            n = min(part, numel - r * part)
            if n > 0:
                assert isinstance(f, TensorData)
                segments.append((_flat(f, name), 0, r * part, n))
        tree["frozen"][name_prefix + name] = _assemble(shape, segments)
