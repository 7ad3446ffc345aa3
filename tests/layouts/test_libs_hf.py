"""The audit on what Hugging Face Trainer, Accelerate ``save_state`` and ``save_pretrained`` really write.

Checkpoints come from the real libraries (tiny GPT-2 / Llama configs, CPU, 2 steps; see ``lib_writers.py``), written
once per module in a fresh interpreter. ``<checkpoint>.truth.json`` holds what the live optimizer really held.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.judge import run_audit
from ckptaudit.findings import ComponentKind, RawReport, Severity
from ckptaudit.formats.torchload import safe_torch_load
from ckptaudit.formats.zip.archive import read_torch_zip
from configurations import Written

pytestmark = pytest.mark.libs

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Written:
    import lib_writers

    out = tmp_path_factory.mktemp("hf")
    written: Written = lib_writers.run_writer("hf", str(out))
    return written


def codes(report: RawReport, severity: Severity | None = None) -> set[str]:
    return {f.code for f in report.findings if severity is None or f.severity is severity}


def one(report: RawReport, code: str) -> Any:
    found = [f for f in report.findings if f.code == code]
    assert len(found) == 1, [f.message for f in report.findings]
    return found[0]


def where(report: RawReport) -> dict[ComponentKind, tuple[str, ...]]:
    return {c.kind: c.where for c in report.components}


def truth(checkpoint: Path) -> dict[str, Any]:
    return json.loads(Path(str(checkpoint) + ".truth.json").read_text())


def truth_by_key(checkpoint: Path, optimizer_file: str) -> dict[int, str]:
    """Index key -> parameter name, from the saved groups' integer lists and the live optimizer's groups."""
    osd = safe_torch_load(checkpoint / optimizer_file)
    groups = truth(checkpoint)["groups"]
    return {k: n for g, names in zip(osd["param_groups"], groups, strict=True)
            for k, n in zip(g["params"], names, strict=True)}


def attached(report: RawReport) -> dict[int, str | None]:
    """Index key -> the parameter the audit attached that entry's exp_avg to."""
    return {int(t.name.split("/")[-2]): t.param for t in report.tensors
            if t.component == "optimizer" and t.role == "exp_avg"}


# ---------------------------------------------------------------------------------------------------------------
# Trainer


def test_trainer_checkpoint_components_contract_and_step(hf: Written) -> None:
    ckpt = hf / "trainer-safetensors" / "checkpoint-2"
    report = run_audit(str(ckpt))
    assert report.format == "huggingface-trainer"
    assert where(report) == {
        ComponentKind.MODEL: ("model.safetensors",),
        ComponentKind.OPTIMIZER: ("optimizer.pt",),
        ComponentKind.SCHEDULER: ("scheduler.pt",),
        ComponentKind.RNG: ("rng_state.pth",),
        ComponentKind.DATA_PROGRESS: ("trainer_state.json",),
    }
    assert report.extra["step"] == 2
    assert report.contract is not None and report.contract.master_dtype == "float32"
    assert report.contract.source == "optimizer-state"
    assert not codes(report, Severity.ERROR), [f.message for f in report.findings]
    params = [t for t in report.tensors if t.component == "model" and t.role == "parameter"]
    assert sorted(t.name.split("/", 1)[1] for t in params) == sorted(truth(ckpt)["params"])


def test_rng_states_load_through_the_allowlist(hf: Written) -> None:
    for path, keys in ((hf / "trainer-safetensors" / "checkpoint-2" / "rng_state.pth", {"python", "numpy", "cpu"}),
                       (hf / "accelerate" / "random_states_0.pkl", {"random_state", "numpy_random_seed"})):
        tz = read_torch_zip(str(path))
        # They do need NumPy's RNG globals, and our allowlist admits them: loaded, nothing unsafe.
        assert any(g.startswith("numpy.") for g in tz.scan.globals), tz.scan.globals
        assert tz.loaded and not tz.scan.unsafe
        state = safe_torch_load(path)
        assert keys <= set(state)
        report = run_audit(str(path.parent))
        assert not [f for f in report.findings if f.subject == path.name], [f.message for f in report.findings]
        assert where(report)[ComponentKind.RNG] == (path.name,)


def test_training_args_are_reported_not_loaded_and_never_executed(hf: Written, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import TrainingArguments

    made: list[str] = []

    def tripwire(self: Any, state: Any) -> None:
        made.append(type(self).__name__)
        raise RuntimeError("TrainingArguments was unpickled")

    # Unpickling builds the object (NEWOBJ) and then fills it through __setstate__ (BUILD). Patch that, not
    # __new__: monkeypatch undoes a patched __new__ by deleting it, which leaves the class unconstructible
    # (CPython keeps a slot wrapper that forwards the arguments to object.__new__).
    assert "__setstate__" not in TrainingArguments.__dict__
    monkeypatch.setattr(TrainingArguments, "__setstate__", tripwire, raising=False)
    ckpt = hf / "trainer-bin" / "checkpoint-2"
    report = run_audit(str(ckpt))
    f = one(report, "security.not-loaded")
    assert f.subject == "training_args.bin" and f.severity is Severity.WARNING
    assert "transformers.training_args.TrainingArguments" in f.evidence["globals"]
    assert "security.unsafe-pickle" not in codes(report)
    assert made == []
    # The tripwire works: loading the file the unsafe way does construct the object.
    with pytest.raises(RuntimeError, match="unpickled"):
        torch.load(ckpt / "training_args.bin", weights_only=False)
    assert made == ["TrainingArguments"]


def test_trainer_decay_split_is_attached_by_the_unique_order_consistent_assignment(hf: Written) -> None:
    ckpt = hf / "trainer-bin" / "checkpoint-2"
    groups = truth(ckpt)["groups"]
    assert len(groups) == 2 and all(n.endswith("bias") or ".ln_" in n for n in groups[1])
    # Read in plain parameter order, most entries of this healthy checkpoint get the wrong shape.
    osd = safe_torch_load(ckpt / "optimizer.pt")
    model = safe_torch_load(ckpt / "pytorch_model.bin")
    params = truth(ckpt)["params"]
    wrong = sum(osd["state"][i]["exp_avg"].shape != model[params[i]].shape for i in range(len(params)))
    assert wrong > len(params) // 2

    report = run_audit(str(ckpt))
    f = one(report, "optimizer.index-keyed")
    assert f.severity is Severity.WARNING
    assert f.evidence["attachment"] == "unique-order" and f.evidence["groups"] == [len(g) for g in groups]
    assert report.extra["attachment"] == "unique-order"
    assert not codes(report) & {"optimizer.shape-mismatch", "optimizer.attachment-unverified", "optimizer.unmatched"}
    assert attached(report) == truth_by_key(ckpt, "optimizer.pt")
    # The tied head is the embedding's bytes under a second name, not a parameter of its own.
    (head,) = (t for t in report.tensors if t.name == "pytorch_model.bin/lm_head.weight")
    assert (head.role, head.param) == ("tied", "transformer.wte.weight")
    assert not codes(report, Severity.ERROR)


def test_trainer_safetensors_order_unknown_is_unverified_not_mismatched(hf: Written) -> None:
    report = run_audit(str(hf / "trainer-safetensors" / "checkpoint-2"))
    assert one(report, "optimizer.index-keyed").evidence["attachment"] == "unknown-order"
    assert one(report, "optimizer.attachment-unverified").severity is Severity.WARNING
    assert "optimizer.shape-mismatch" not in codes(report)


def _swap_first_entries_of_different_shapes(src: Path, dst: Path) -> tuple[int, int]:
    import torch

    shutil.copytree(src, dst)
    osd = safe_torch_load(src / "optimizer.pt")
    state = osd["state"]
    a = osd["param_groups"][0]["params"][0]
    b = next(k for k in osd["param_groups"][0]["params"] if state[k]["exp_avg"].shape != state[a]["exp_avg"].shape)
    state[a], state[b] = state[b], state[a]
    torch.save(osd, dst / "optimizer.pt")
    return a, b


def test_swapped_entries_of_different_shapes_are_a_shape_mismatch(hf: Written, tmp_path: Path) -> None:
    a, b = _swap_first_entries_of_different_shapes(hf / "trainer-bin" / "checkpoint-2", tmp_path / "swapped")
    report = run_audit(str(tmp_path / "swapped"))
    f = one(report, "optimizer.shape-mismatch")
    assert f.severity is Severity.ERROR and f.subject == "optimizer.pt"
    assert f"entry {a}," in f.message or f"entry {b}," in f.message
    assert report.extra["attachment"] == "mismatch"
    # Beside model.safetensors (no parameter order) the same swap keeps the multiset of shapes: it can only be
    # reported as unverified, never as verified.
    _swap_first_entries_of_different_shapes(hf / "trainer-safetensors" / "checkpoint-2", tmp_path / "swapped-st")
    st = run_audit(str(tmp_path / "swapped-st"))
    assert "optimizer.attachment-unverified" in codes(st)
    assert st.extra["attachment"] == "unknown-order"


def _reshape_entry(src: Path, dst: Path, shape: tuple[int, ...], avoid: tuple[int, ...] | None = None) -> int:
    """Copy the checkpoint, giving one optimizer entry (not of shape ``avoid``) moments of ``shape``."""
    import torch

    shutil.copytree(src, dst)
    osd = safe_torch_load(src / "optimizer.pt")
    key = next(k for k, v in osd["state"].items() if tuple(v["exp_avg"].shape) != avoid)
    for name in ("exp_avg", "exp_avg_sq"):
        osd["state"][key][name] = torch.zeros(shape)
    torch.save(osd, dst / "optimizer.pt")
    return int(key)


def test_unordered_model_checks_the_multiset_of_moment_shapes(hf: Written, tmp_path: Path) -> None:
    """Beside model.safetensors (no parameter order) the moments are checked as a multiset of shapes: a shape the
    model lacks, and one shape needed once more often than the model has it, are each a shape mismatch."""
    from safetensors import safe_open

    src = hf / "trainer-safetensors" / "checkpoint-2"
    with safe_open(str(src / "model.safetensors"), framework="pt") as fh:
        have = Counter(tuple(fh.get_slice(k).get_shape()) for k in fh.keys())
    osd = safe_torch_load(src / "optimizer.pt")
    need = Counter(tuple(v["exp_avg"].shape) for v in osd["state"].values())
    assert run_audit(str(src)).extra["attachment"] == "unknown-order"

    lacking = _reshape_entry(src, tmp_path / "lacking", (3, 5, 7))
    report = run_audit(str(tmp_path / "lacking"))
    f = one(report, "optimizer.shape-mismatch")
    assert f.severity is Severity.ERROR and "moment shapes the model lacks: 1 x [3, 5, 7]" in f.message, f.message
    assert report.extra["attachment"] == "mismatch" and lacking in osd["state"]

    # A shape every one of whose model tensors already has its entry: one entry more of it cannot fit.
    full = next(shape for shape, n in have.items() if need[shape] == n)
    _reshape_entry(src, tmp_path / "one-too-many", full, avoid=full)
    report = run_audit(str(tmp_path / "one-too-many"))
    f = one(report, "optimizer.shape-mismatch")
    assert f"moment shapes the model lacks: 1 x {list(full)}" in f.message, f.message
    assert report.extra["attachment"] == "mismatch"
    assert "optimizer.attachment-unverified" not in codes(report)


# ---------------------------------------------------------------------------------------------------------------
# Accelerate


def test_accelerate_save_state_components(hf: Written) -> None:
    report = run_audit(str(hf / "accelerate"))
    assert report.format == "accelerate"
    found = where(report)
    assert found[ComponentKind.MODEL] == ("model.safetensors",)
    assert found[ComponentKind.OPTIMIZER] == ("optimizer.bin",)
    assert found[ComponentKind.SCHEDULER] == ("scheduler.bin",)
    assert found[ComponentKind.RNG] == ("random_states_0.pkl",)
    # A map-style DataLoader in one process: Accelerate writes no sampler / data-loader state at all.
    assert found[ComponentKind.DATA_PROGRESS] == ()
    missing = [f for f in report.findings if f.code == "component.missing"]
    assert [(f.subject, f.severity) for f in missing] == [("data-progress", Severity.WARNING)]
    assert report.contract is not None and report.contract.master_dtype == "float32"
    assert report.extra["attachment"] == "unknown-order"
    assert not codes(report, Severity.ERROR)


def test_frozen_parameter_of_a_repeated_shape_makes_the_attachment_ambiguous(hf: Written) -> None:
    ckpt = hf / "accelerate-bin-frozen"
    frozen = truth(ckpt)["frozen"]
    sibling = frozen.replace("gate_proj", "up_proj")
    report = run_audit(str(ckpt))
    assert report.extra["attachment"] == "ambiguous"
    f = one(report, "optimizer.attachment-unverified")
    expected = truth_by_key(ckpt, "optimizer.bin")
    (loose_key,) = (k for k, n in expected.items() if n == sibling)
    assert f.evidence["unpinned"] == {str(loose_key): [frozen, sibling]}
    assert "optimizer.shape-mismatch" not in codes(report)
    # Every other entry is still pinned to the parameter the optimizer really held.
    assert attached(report) == {**expected, loose_key: None}
    names = list(itertools.chain(*truth(ckpt)["groups"]))
    assert frozen not in names and len(names) == len(truth(ckpt)["params"]) - 1


# ---------------------------------------------------------------------------------------------------------------
# Sharded save_pretrained


def test_sharded_safetensors_with_index(hf: Written, tmp_path: Path) -> None:
    src = hf / "sharded"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    report = run_audit(str(src))
    assert report.format == "huggingface-sharded"
    assert set(where(report)[ComponentKind.MODEL]) == {*shards, "model.safetensors.index.json"}
    model = sorted(t.name.split("/", 1)[1] for t in report.tensors if t.component == "model")
    assert model == sorted(truth(src)["params"]) == sorted(index["weight_map"])
    assert not {c for c in codes(report) if c.startswith("integrity.")}

    damaged = tmp_path / "sharded"
    shutil.copytree(src, damaged)
    lost = shards[1]
    (damaged / lost).unlink()
    report = run_audit(str(damaged))
    f = one(report, "integrity.incomplete")
    assert f.subject == lost and f.severity is Severity.ERROR
    assert f.evidence["tensors"] == sorted(t for t, s in index["weight_map"].items() if s == lost)


# ---------------------------------------------------------------------------------------------------------------
# PEFT LoRA through Trainer: the frozen base embedding PEFT saves beside the adapters


def test_peft_lora_frozen_base_embedding_is_not_optimised_so_no_master_is_due(hf: Written) -> None:
    ckpt = hf / "peft-lora" / "checkpoint-2"
    report = run_audit(str(ckpt))
    assert report.format == "huggingface-trainer"
    assert where(report)[ComponentKind.MODEL] == ("adapter_model.safetensors",)
    assert not report.fails(Severity.ERROR), [f.message for f in report.findings if f.severity is Severity.ERROR]
    assert report.extra["attachment"] == "unknown-order"
    embed = "adapter_model.safetensors/base_model.model.model.embed_tokens.base_layer.weight"
    roles = {t.name: (t.role, t.precision.value) for t in report.tensors if t.component == "model"}
    assert roles.pop(embed) == ("buffer", "bf16")
    # Every trainable tensor (the adapters) is a parameter, with its full fp32 precision after 2 steps.
    assert len(roles) == len(truth(ckpt)["trainable"]) == 10
    assert set(roles.values()) == {("parameter", "exact")}
    note = one(report, "precision.not-optimised")
    assert note.subject == embed and note.severity is Severity.INFO
    assert "carries no optimizer state (no entry of the index-keyed optimizer state has its shape)" in note.message
    assert codes(report, Severity.WARNING) == {"optimizer.index-keyed", "optimizer.attachment-unverified",
                                              "security.not-loaded"}


def test_peft_lora_adapter_saved_rounded_is_still_an_error(hf: Written, tmp_path: Path) -> None:
    """The same checkpoint with one trained adapter's values rounded to bf16 (low 16 bits cleared)."""
    from safetensors.numpy import load_file, save_file

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(hf / "peft-lora" / "checkpoint-2", ckpt)
    tensors = load_file(str(ckpt / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[name] = (tensors[name].view("uint32") & 0xFFFF0000).view("float32")
    save_file(tensors, str(ckpt / "adapter_model.safetensors"), metadata={"format": "pt"})
    report = run_audit(str(ckpt))
    errors = [(f.code, f.subject) for f in report.findings if f.severity is Severity.ERROR]
    assert errors == [("precision.bf16-rounded", f"adapter_model.safetensors/{name}")]
    assert one(report, "precision.not-optimised").severity is Severity.INFO


@pytest.mark.parametrize("name", ["accelerate-bin-frozen-bf16init", "accelerate-frozen-bf16init"])
def test_a_bf16_frozen_parameter_the_index_keyed_state_cannot_place_is_not_judged(hf: Written, name: str) -> None:
    """From a bf16 release, gate_proj frozen: it keeps its bf16 values, and index-keyed state cannot tell it from
    up_proj (same shape): by order beside pytorch_model.bin, by shape beside model.safetensors."""
    report = run_audit(str(hf / name))
    assert not report.fails(Severity.ERROR), [f.message for f in report.findings if f.severity is Severity.ERROR]
    assert report.extra["attachment"] == ("ambiguous" if "bin" in name else "unknown-order")
    note = one(report, "precision.not-judged")
    assert note.subject.endswith("/model.layers.0.mlp.gate_proj.weight") and note.severity is Severity.WARNING
    assert "As a frozen parameter it owes no float32 master; as a trainable one it lost its low bits" in note.message


def test_rounded_parameters_that_cannot_all_be_frozen_are_still_errors(hf: Written, tmp_path: Path) -> None:
    """up_proj rounded too: only one of the two same-shape tensors can lack an entry, so both are judged."""
    from safetensors.numpy import load_file, save_file

    ckpt = tmp_path / "accelerate"
    shutil.copytree(hf / "accelerate-frozen-bf16init", ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    up = "model.layers.0.mlp.up_proj.weight"
    tensors[up] = (tensors[up].view("uint32") & 0xFFFF0000).view("float32")
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    report = run_audit(str(ckpt))
    errors = {(f.code, f.subject) for f in report.findings if f.severity is Severity.ERROR}
    assert errors == {("precision.bf16-rounded", f"model.safetensors/{p}")
                      for p in (up, "model.layers.0.mlp.gate_proj.weight")}
    assert "precision.not-judged" not in codes(report)


# ---------------------------------------------------------------------------------------------------------------
# The master-dtype contract: what the Trainer and Accelerate record about their precision


def _export_cast_to_bf16(src: Path, dst: Path, optimizer_file: str) -> Path:
    """A copy of a checkpoint directory whose model and optimizer moments an exporter cast to bf16 (the real
    files rewritten by safetensors and torch)."""
    import safetensors.torch
    import torch

    import lib_writers

    shutil.copytree(src, dst)
    model = dst / "model.safetensors"
    safetensors.torch.save_file(lib_writers.cast_to_bf16(safetensors.torch.load_file(model)), model,
                                metadata={"format": "pt"})
    osd = torch.load(dst / optimizer_file, weights_only=True)
    torch.save(lib_writers.cast_to_bf16(osd), dst / optimizer_file)
    return dst


@pytest.mark.parametrize("name", ["trainer-fp16", "accelerate-fp16"])
def test_a_saved_grad_scaler_decides_fp32_masters(hf: Written, name: str) -> None:
    ckpt = hf / name / "checkpoint-2" if name.startswith("trainer") else hf / name
    report = run_audit(str(ckpt))
    assert report.contract is not None
    assert (report.contract.master_dtype, report.contract.source, report.contract.where) == (
        "float32", "grad-scaler", "scaler.pt")
    assert "refuses to unscale fp16 gradients" in report.contract.detail
    if name.startswith("trainer"):  # the Trainer's own arguments are shown beside it, deciding nothing
        assert any(r.startswith("training_args.bin: bf16=False, fp16=True") for r in report.contract.records)
    assert not codes(report, Severity.ERROR), [f.message for f in report.findings]


@pytest.mark.parametrize("name", ["trainer-fp16", "accelerate-fp16"])
def test_an_export_cast_to_bf16_contradicts_the_saved_grad_scaler(hf: Written, tmp_path: Path, name: str) -> None:
    ckpt = hf / name / "checkpoint-2" if name.startswith("trainer") else hf / name
    opt = "optimizer.pt" if name.startswith("trainer") else "optimizer.bin"
    report = run_audit(str(_export_cast_to_bf16(ckpt, tmp_path / name, opt)))
    mismatch = one(report, "contract.mismatch")
    assert mismatch.severity is Severity.ERROR
    assert mismatch.message.startswith("scaler.pt records a GradScaler state")
    assert "parameters are bfloat16 and optimizer moments are bfloat16" in mismatch.message
    stored = {f.subject for f in report.findings if f.code == "precision.low-precision-storage"}
    assert len(stored) == len({t.param for t in report.tensors if t.role == "parameter"})


def test_an_export_cast_to_bf16_where_nothing_records_the_masters_is_a_warning_naming_the_flag(
        hf: Written, tmp_path: Path) -> None:
    # A Trainer run without fp16 (no GradScaler): training_args.bin says bf16=False, fp16=False, which leaves the
    # masters to the dtype the model was loaded in. The all-bf16 export then looks like a bf16 run: said, not
    # called clean or broken; declared, it is an error.
    from ckptaudit.auditing.judge import AuditOptions

    ckpt = _export_cast_to_bf16(hf / "trainer-safetensors" / "checkpoint-2", tmp_path / "export", "optimizer.pt")
    report = run_audit(str(ckpt))
    assert report.contract is not None
    assert (report.contract.master_dtype, report.contract.source) == ("bfloat16", "optimizer-state")
    inferred = one(report, "contract.inferred")
    assert inferred.severity is Severity.WARNING
    assert "--master-dtype float32" in inferred.message
    assert "training_args.bin: bf16=False, fp16=False" in inferred.message
    assert not codes(report, Severity.ERROR)
    declared = run_audit(str(ckpt), AuditOptions(master_dtype="float32"))
    assert "precision.low-precision-storage" in codes(declared, Severity.ERROR)


def test_a_float32_config_beside_bf16_arguments_decides_float32_masters(hf: Written, tmp_path: Path) -> None:
    # config.json records the model's dtype when the Trainer saved it (float32), and training_args.bin turns on bf16
    # autocast: the Trainer's optimizer stepped float32 masters. model.safetensors and the moments cast to bf16 are
    # an export that lost them, which the files alone would call a bf16-masters run (a warning at most).
    import torch

    ckpt = _export_cast_to_bf16(hf / "trainer-safetensors" / "checkpoint-2", tmp_path / "export", "optimizer.pt")
    config = json.loads((ckpt / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    args = torch.load(ckpt / "training_args.bin", weights_only=False)  # the fixture's own Trainer wrote it
    args.bf16 = True
    torch.save(args, ckpt / "training_args.bin")
    report = run_audit(str(ckpt))
    assert report.contract is not None
    assert (report.contract.master_dtype, report.contract.source, report.contract.where) == (
        "float32", "trainer-autocast", "config.json + training_args.bin")
    mismatch = one(report, "contract.mismatch")
    assert mismatch.severity is Severity.ERROR
    assert mismatch.message.startswith("config.json + training_args.bin records dtype=float32 in config.json, "
                                       "bf16=True in training_args.bin")
    # A genuine bf16 run: the model was bf16 when saved (pure bf16 training); not decided, as before.
    config["dtype"] = "bfloat16"
    (ckpt / "config.json").write_text(json.dumps(config))
    genuine = run_audit(str(ckpt))
    assert genuine.contract is not None and genuine.contract.source == "optimizer-state"
    assert not codes(genuine, Severity.ERROR)
