"""The serving export: a training checkpoint's model weights converted for serving (bf16, fp16, fp8), written as
safetensors behind an output-quality gate and marked so that nobody resumes training from it
(:mod:`~ckptaudit.serving.export`), and the gate itself: the exported model's outputs against the full-precision
model's on one batch (:mod:`~ckptaudit.serving.gate`)."""
