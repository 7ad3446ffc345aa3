"""What the guard's live check costs the training thread at a save: the sampled check against testing every value.

    .venv/bin/python bench/bench_live_check.py                      # a 124M-parameter GPT-2-shaped set, AdamW
    .venv/bin/python bench/bench_live_check.py --layers 24 --hidden 1024 --repeat 20

The masters: float32 tensors of a GPT-2-shaped model (``--layers`` blocks of ``--hidden``; embeddings of 50257
tokens), each stepped once by AdamW so their low bits are set, as a run's masters are. Measured, median of
``--repeat`` calls on the training thread (this process, ``--threads`` torch threads):

(a) ``observe_live``: the guard's check at each save (a sample of ``SAMPLE_PER_TENSOR`` values per tensor, one
    buffer, one copy to the host; a tensor whose sample looks rounded is then tested whole);
(b) the full test: every value of every master tested for bf16-representability (one reduction per tensor), what
    a check without the sample would cost;
(c) ``observe_live`` when one tensor (the largest) has been rounded in place: the sample plus that tensor's
    confirmation.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time


def _median_s(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from ckptaudit.integrations.guard_lineage import SAMPLE_PER_TENSOR, observe_live

    torch.set_num_threads(args.threads)
    h = args.hidden
    shapes = [(args.vocab, h), (1024, h)]
    for _ in range(args.layers):
        shapes += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    shapes += [(h,), (h,)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    n = sum(p.numel() for p in params)

    def full() -> bool:
        flags = [p.detach().reshape(-1).view(torch.int16)[0::2].ne(0).any() for p in params]
        return bool(torch.stack(flags).all())

    assert observe_live(opt) is not None and not observe_live(opt).damaged  # type: ignore[union-attr]
    sampled = _median_s(lambda: observe_live(opt), args.repeat)
    whole = _median_s(full, max(3, args.repeat // 3))
    biggest = max(params, key=lambda p: p.numel())
    with torch.no_grad():
        biggest.copy_(biggest.to(torch.bfloat16).float())
    seen = observe_live(opt)
    assert seen is not None and len(seen.rounded) == 1, seen
    damaged = _median_s(lambda: observe_live(opt), max(3, args.repeat // 3))
    print(f"masters: {len(params)} float32 tensors, {n / 1e6:.1f}M values ({n * 4 / 2**20:.0f} MiB); torch threads "
          f"{args.threads}; {platform.processor() or platform.machine()}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"(a) observe_live, {SAMPLE_PER_TENSOR} values per tensor: {sampled * 1e3:.2f} ms")
    print(f"(b) every value tested (bf16 only):      {whole * 1e3:.2f} ms ({whole / sampled:.0f}x the sample)")
    print(f"(c) observe_live, the largest tensor ({biggest.numel() / 1e6:.1f}M values) rounded in place: "
          f"{damaged * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
