"""Side-by-side timing of fastformer's CPU kernels against the PyTorch code they replace, in one process.

    python benchmarks/compare_ops_cpu.py

Forward+backward, median of 15 runs after 3 warm-ups, on the shapes of the foundation issue:
attention B=32, H=8, L=64, D=64 with key padding (vs scaled_dot_product_attention and the eager
masked_fill + softmax composition); masked softmax and residual + dropout + LayerNorm on 4096 x 512.
Prints times and the ratio baseline / fastformer (> 1: fastformer is faster).
"""
import statistics
import time

import torch
import torch.nn.functional as F

from fastformer import ops


def median_ms(fn, runs=15, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def report(name, ours, baselines):
    parts = ", ".join(f"{label} {ms:.2f} ms ({ms / ours:.2f}x)" for label, ms in baselines)
    print(f"{name}: fastformer cpu {ours:.2f} ms; {parts}")


def main():
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    B, H, L, D = 32, 8, 64, 64
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[:, 50:] = True
    g = torch.randn(B, H, L, D)

    def eager():
        s = (q @ k.transpose(-1, -2)) / D ** 0.5
        return torch.softmax(s.masked_fill(pad[:, None, None, :], float("-inf")), -1) @ v

    ours = median_ms(lambda: ops.attention(q, k, v, key_padding_mask=pad, backend="cpu").backward(g))
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :]).backward(g))
    report("attention fwd+bwd 32x8x64x64, padding", ours, [("sdpa", sdpa), ("eager", median_ms(lambda: eager().backward(g)))])

    x = torch.randn(4096, 512, requires_grad=True)
    mask = torch.rand(4096, 512) < 0.1
    gy = torch.randn(4096, 512)
    ours = median_ms(lambda: ops.softmax(x, mask=mask, backend="cpu").backward(gy))
    ref = median_ms(lambda: torch.softmax(x.masked_fill(mask, float("-inf")), -1).backward(gy))
    report("softmax fwd+bwd 4096x512, masked", ours, [("masked_fill+softmax", ref)])

    r = torch.randn(4096, 512, requires_grad=True)
    w, b = torch.randn(512, requires_grad=True), torch.randn(512, requires_grad=True)
    for p in (0.0, 0.1):
        ours = median_ms(lambda: ops.layer_norm_residual(x, r, w, b, dropout_p=p, backend="cpu").backward(gy))
        ref = median_ms(lambda: F.layer_norm(r + F.dropout(x, p), (512,), w, b).backward(gy))
        report(f"layer_norm_residual fwd+bwd 4096x512, p={p}", ours, [("add+dropout+layer_norm", ref)])


if __name__ == "__main__":
    main()
