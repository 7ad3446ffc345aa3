"""What each training stack records about its precision, read as plain data where the library keeps it, and what
that record means for the master dtype (:class:`~ckptaudit.layouts.view.ContractRecord`).

- DeepSpeed: the saved ``ds_config`` (``mp_rank_*_model_states.pt``). ``bf16.enabled`` / ``fp16.enabled``: the
  engine trains 16-bit copies and keeps fp32 masters in the optimizer's partitions (ZeRO 1-3, ``BF16_Optimizer``,
  the fp16 optimizers), unless ``bf16_master_weights_and_grads`` / ``fp16_master_weights_and_grads`` keep them
  16-bit. Neither enabled: an fp32 engine steps the module's own weights, whatever dtype they were given
  (not decided).
- Megatron-LM: the saved ``args`` (``common.pt``). ``bf16`` / ``fp16``: its mixed-precision optimizers
  (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``) keep fp32 main params, or
  ``main_params_dtype`` with ``use_precision_aware_optimizer``; neither: ``params_dtype`` is fp32 and the
  ``FP32Optimizer`` steps the parameters themselves.
- A saved GradScaler state: the Trainer's and Accelerate's ``scaler.pt``, Lightning's ``MixedPrecision`` /
  ``FSDPPrecision`` entry (``precision="16-mixed"``). A GradScaler refuses to unscale fp16 gradients
  (``GradScaler.unscale_``: "Attempting to unscale FP16 gradients"), and these libraries create one only for fp16
  mixed precision over the model's own (fp32) parameters: the masters are fp32.
- The Trainer's ``training_args.bin`` (read inertly: its declared fields as plain data, nothing run): ``bf16`` /
  ``fp16`` turn on autocast over the model's own parameters, which are fp32 masters when the model was loaded in
  fp32 and 16-bit ones when it was loaded in bf16 (pure bf16 training): shown, never deciding.
- The model's ``config.json`` beside the Trainer's ``training_args.bin``: ``save_pretrained`` writes the model's
  dtype at save time (``dtype``; ``torch_dtype`` before transformers 5). ``float32`` there with ``bf16`` or
  ``fp16`` in the arguments (and no DeepSpeed) is autocast over float32 parameters, which the Trainer's optimizer
  steps: float32 masters (``trainer-autocast``), whatever dtype the saved weights have.
- Lightning saves no precision setting other than the GradScaler's state: ``bf16-mixed``, ``bf16-true``,
  ``16-true`` and ``32-true`` leave no record in the ``.ckpt``.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from ckptaudit.layouts.view import ContractRecord

__all__ = ["LIGHTNING_SCALER_KEYS", "deepspeed_record", "megatron_record", "model_config_record", "scaler_record",
           "trainer_autocast_record", "training_args_record"]

LIGHTNING_SCALER_KEYS = ("MixedPrecision", "FSDPPrecision", "native_amp_scaling_state")
"""Where Lightning keeps its precision plugin's state in a ``.ckpt`` (the plugin's class name; the last one is
Lightning 1.x's name): only a GradScaler's state, saved with ``precision="16-mixed"``."""

_SIXTEEN = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


def _fields(obj: Any) -> dict[str, Any]:
    """The pickled fields of an inertly loaded object (``Opaque``: its ``BUILD`` state, kept as data), or of a
    plain dict; ``{}`` for anything else."""
    if isinstance(obj, dict):
        return obj
    if type(obj).__name__ == "Opaque":
        state = getattr(obj, "state", None)
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = state[0]
        return state if isinstance(state, dict) else {}
    return {}


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _name(value: Any) -> str | None:
    """A plain string, an enum read inertly (``Opaque`` of ``Enum(value)``), or a torch dtype stand-in
    (``torch.bfloat16``), as text."""
    if isinstance(value, str):
        return value
    args = getattr(value, "args", None)
    if type(value).__name__ == "Opaque" and isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], str):
        return args[0]
    if type(value).__name__ == "dtype" and isinstance(getattr(value, "name", None), str):
        return str(value.name)
    return None


def deepspeed_record(config: Any, where: str) -> ContractRecord | None:
    """DeepSpeed's saved ``ds_config`` (its precision sections), or ``None`` when it holds none."""
    if not isinstance(config, dict) or not config:
        return None
    sections = {"bf16": config.get("bf16", config.get("bfloat16")), "fp16": config.get("fp16")}
    for name, own_masters in (("bf16", "bf16_master_weights_and_grads"), ("fp16", "fp16_master_weights_and_grads")):
        section = sections[name]
        if not isinstance(section, dict) or section.get("enabled") is not True:
            continue
        if section.get(own_masters) is True:
            dtype = _SIXTEEN[name]
            return ContractRecord("deepspeed-config", where, f"{name}.enabled=true, {name}.{own_masters}=true", dtype,
                                  f"DeepSpeed keeps {dtype} masters in the optimizer's partitions", in_optimizer=True)
        return ContractRecord("deepspeed-config", where, f"{name}.enabled=true", "float32",
                              f"DeepSpeed's {name} engine trains {name} copies and keeps fp32 masters in the "
                              "optimizer's partitions", in_optimizer=True)
    return ContractRecord("deepspeed-config", where, "neither bf16 nor fp16 enabled", None,
                          "an fp32 engine steps the module's own weights, in whatever dtype they were given")


def megatron_record(args: Any, where: str) -> ContractRecord | None:
    """Megatron-LM's saved ``args`` (an ``argparse.Namespace``, read inertly), or ``None`` when it says nothing
    about precision."""
    fields = _fields(args)
    bf16, fp16 = _flag(fields.get("bf16")), _flag(fields.get("fp16"))
    if bf16 is None and fp16 is None:
        return None
    if bf16 or fp16:
        half = "bf16" if bf16 else "fp16"
        main = _name(fields.get("main_params_dtype"))
        aware = fields.get("use_precision_aware_optimizer") is True
        if aware and main is not None and main.removeprefix("torch.") in _SIXTEEN:
            dtype = _SIXTEEN[main.removeprefix("torch.")]
            return ContractRecord("megatron-args", where, f"{half}=True, use_precision_aware_optimizer=True, "
                                  f"main_params_dtype={main}", dtype,
                                  f"the precision-aware optimizer keeps {dtype} main params", in_optimizer=True)
        return ContractRecord("megatron-args", where, f"{half}=True", "float32",
                              f"Megatron's mixed-precision optimizers keep fp32 main params of the {half} weights",
                              in_optimizer=True)
    return ContractRecord("megatron-args", where, "bf16=False, fp16=False", "float32",
                          "Megatron trains fp32 parameters (params_dtype follows --bf16/--fp16) with its FP32Optimizer")


def scaler_record(state: Any, where: str) -> ContractRecord | None:
    """A saved GradScaler state (``{"scale": ..., "growth_factor": ...}``; an enabled scaler's), or ``None``."""
    if not isinstance(state, dict):
        return None
    scale = state.get("scale")
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        return None
    return ContractRecord("grad-scaler", where, f"a GradScaler state (scale {scale:g})", "float32",
                          "fp16 mixed precision, whose GradScaler refuses to unscale fp16 gradients: the parameters "
                          "the optimizer steps are fp32 masters")


def training_args_record(obj: Any, where: str) -> ContractRecord | None:
    """The Trainer's ``TrainingArguments`` (read inertly): what its precision fields say; never decides."""
    fields = _fields(obj)
    bf16, fp16 = _flag(fields.get("bf16")), _flag(fields.get("fp16"))
    if bf16 is None and fp16 is None:
        return None
    said = [f"bf16={bf16}", f"fp16={fp16}"]
    optim = _name(fields.get("optim"))
    if optim is not None:
        said.append(f"optim={optim}")
    if fields.get("deepspeed"):
        why = "a DeepSpeed run: its own ds_config (in the global_step folder) records the masters"
    elif bf16 or fp16:
        why = ("autocast over the model's own parameters: fp32 masters when the model was loaded in fp32, 16-bit "
               "ones when it was loaded in 16 bits; does not decide")
    else:
        why = "no autocast: the masters are the model's own parameters, in the dtype it was loaded in; does not decide"
    return ContractRecord("training-args", where, ", ".join(said), None, why)


def model_config_record(obj: Any, where: str) -> ContractRecord | None:
    """A model's ``config.json``: the dtype ``save_pretrained`` recorded (the model's at save time); never decides
    alone (a plain ``save_pretrained`` folder may hold weights of any origin)."""
    if not isinstance(obj, dict):
        return None
    dtype = obj.get("dtype", obj.get("torch_dtype"))
    if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in ("float32", "bfloat16", "float16"):
        return None
    dtype = dtype.removeprefix("torch.")
    return ContractRecord("model-config", where, f"dtype={dtype}", None,
                          "the model's dtype when save_pretrained wrote it; decides with the Trainer's arguments")


def trainer_autocast_record(records: list[ContractRecord]) -> ContractRecord | None:
    """``config.json`` says the model was float32 when saved and ``training_args.bin`` turns on bf16/fp16 autocast
    (no DeepSpeed): the Trainer stepped float32 parameters, so the masters are float32."""
    config = next((r for r in records if r.source == "model-config"), None)
    args = next((r for r in records if r.source == "training-args"), None)
    if config is None or args is None or config.says != "dtype=float32" or "DeepSpeed" in args.why:
        return None
    flags = [f for f in ("bf16=True", "fp16=True") if f in args.says.split(", ")]
    if not flags:
        return None
    return ContractRecord("trainer-autocast", f"{config.where} + {args.where}",
                          f"dtype=float32 in {config.where}, {flags[0]} in {args.where}", "float32",
                          "the Trainer's autocast over the model's own parameters, which were float32 when it saved: "
                          "its optimizer steps float32 masters")
