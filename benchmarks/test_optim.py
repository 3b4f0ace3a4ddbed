"""The Adam step of a whole Transformer's parameters: fastformer's fused Adam (fastformer.training.optim.Adam)
beside torch.optim.Adam's foreach and fused implementations, without and with bfloat16 copies of the weights.

The parameter set is the size profile's model (``TransformerConfig.small`` at the default sizes: 7.6 M float32
parameters; ``tiny`` for --bench-sizes smoke), with random gradients; each call is one ``optimizer.step()``.
The copies are those issue 52 gives the projections: a bfloat16 copy of every 2-D weight (the embedding
included), written by the step itself (``fastformer+bf16 copies``) or, beside torch, by its fused step and then
one ``torch._foreach_copy_`` (``torch fused+bf16 copies``: what a model keeping such copies pays with torch).
On the CPU each fastformer variant is timed in alternation with the torch steps of its group (``turns_with``:
its speedups come from the same rounds), at one thread and at torch's thread count.

Bytes (extra_info "GB/s"), the same for every implementation of a group, what the step must move: per element
param, grad, exp_avg and exp_avg_sq read (16 B) and param, exp_avg and exp_avg_sq written (12 B), plus 2 B
written per copied element. Memory-bound: each records its fraction of the session's copy bandwidth.
"""
import pytest
import torch

from fastformer.nn import Transformer
from fastformer.training.optim import Adam

BASELINES = ("torch foreach", "torch fused", "torch fused+bf16 copies")
VARIANTS = ("fastformer", "fastformer+bf16 copies") + BASELINES
HYPER = dict(lr=1e-4, betas=(0.9, 0.98), eps=1e-9)


def step_of(variant, params, copies):
    """One optimizer step of ``variant`` on ``params`` (copies: {2-D param: its bfloat16 copy})."""
    if variant == "fastformer":
        return Adam(params, **HYPER).step
    if variant == "fastformer+bf16 copies":
        return Adam(params, compute_copies=copies, **HYPER).step
    optimizer = torch.optim.Adam(params, foreach=variant == "torch foreach", fused=variant != "torch foreach",
                                 **HYPER)
    if variant != "torch fused+bf16 copies":
        return optimizer.step
    targets, sources = list(copies.values()), list(copies)

    def step():
        optimizer.step()
        torch._foreach_copy_(targets, sources)

    return step


@pytest.mark.parametrize("threads", [1, None], ids=["1 thread", "threads"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_adam_step(bench, ctx, variant, threads):
    config = ctx.model_config()
    params = [p for p in Transformer(config).to(ctx.device).parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    copied = [p for p in params if p.dim() == 2]
    copies = {p: torch.empty(p.shape, dtype=torch.bfloat16, device=ctx.device) for p in copied}
    with_copies = "copies" in variant
    group_baselines = [b for b in BASELINES if ("copies" in b) == with_copies]
    turns = None if ctx.cuda or variant in BASELINES else {b: step_of(b, params, copies) for b in group_baselines}
    step = step_of(variant, params, copies)
    n = sum(p.numel() for p in params)
    moved = 28 * n + (2 * sum(p.numel() for p in copied) if with_copies else 0)
    count = torch.get_num_threads() if threads is None else threads
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        bench(step, op="adam", shape=f"{ctx.sizes.model}: {len(params)} parameters, {n / 1e6:.2f} M elements",
              pass_=f"step{', bf16 copies' if with_copies else ''}, {count} thread{'s' if count > 1 else ''}",
              impl=variant, bytes_moved=moved, memory_bound=True, turns_with=turns)
    finally:
        torch.set_num_threads(before)
