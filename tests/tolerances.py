"""The one tolerance table of the test suite.

Every parity test compares a backend's result in some dtype with the float64 torch reference computed on
float64 copies of the *same* (already rounded) inputs, so the error measured is the kernel's own: its
accumulation order, its intermediate precision and the final rounding to ``dtype``.
"""
import torch

# dtype of the tested result -> allowed error against the float64 reference.
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def assert_close(actual, expected, dtype, what=""):
    """Asserts that ``actual`` (a result in ``dtype``) matches the float64 reference ``expected``.

    The absolute tolerance is scaled by the magnitude of the reference (``atol * max(1, max|expected|)``):
    gradients that sum over long rows or many rows (dweight, dk, dv) grow with the shape, and their
    rounding error grows with them.
    """
    assert expected.dtype == torch.float64, f"{what}: the reference must be float64, got {expected.dtype}"
    assert actual.dtype == dtype, f"{what}: result has dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: result holds non-finite values"
    tol = TOLERANCES[dtype]
    magnitude = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double(),
        expected,
        atol=tol["atol"] * max(1.0, magnitude),
        rtol=tol["rtol"],
        msg=lambda m: f"{what} ({dtype}): {m}",
    )


# The peer matrices (tests/ops/test_*_matrix.py) use FlashAttention's criterion instead
# (tests/test_flash_attn.py: `(out - out_ref).abs().max() <= 2 * (out_pt - out_ref).abs().max() + atol`):
# a backend's error against the float64 reference may be at most ``factor`` times the error of PyTorch
# eager run in the same dtype on the same inputs, plus ``floor`` ulps of the dtype at the reference's
# magnitude (the floor covers outputs that eager rounds exactly, and the float32 exp polynomials:
# at::vec's exp_u20 in the cpu softmax errs by up to 2^-20, about 8 ulps), times the condition number of
# a softmax at its logits, max(1, max |s|): a logit s is known to |s| ulp whatever the order of the
# arithmetic, and e^s carries that error; two correct orders differ by it (at scale 100 the cpu kernel's
# scores and eager's differ by 2-3x in either direction), so the floor grows with |s|; likewise a layer
# norm's (s - mean) rstd at max |s| rstd.
MATRIX = {
    torch.float64: dict(factor=2.0, floor=64),
    torch.float32: dict(factor=2.0, floor=32),
    torch.float16: dict(factor=2.0, floor=2),
    torch.bfloat16: dict(factor=2.0, floor=2),
}


def matrix_bound(eager_error, expected, dtype, condition=1.0):
    """The largest error the matrix criterion allows, for a reference ``expected`` (float64) of an op whose
    condition number at the inputs is ``condition`` (the largest |logit| of a softmax, |s| rstd of a
    layer norm)."""
    tol = MATRIX[dtype]
    magnitude = expected.abs().max().item() if expected.numel() else 0.0
    floor = tol["floor"] * torch.finfo(dtype).eps * max(1.0, magnitude) * max(1.0, condition)
    return tol["factor"] * eager_error + floor


def product_bound(a, b, accumulate_dtype):
    """The rounding error a product ``a @ b`` (float64 copies of the rounded inputs) may carry when each
    element is a chain of k multiply-adds rounded to ``accumulate_dtype``: the forward error bound of
    recursive summation, |C - AB| <= gamma_k |A||B| with gamma_k = k u / (1 - k u), u the unit roundoff (the
    products of the bf16 variants are exact in float32, so the same bound holds for them)."""
    k = a.shape[1]
    u = torch.finfo(accumulate_dtype).eps / 2
    gamma = k * u / (1 - k * u)
    return gamma * (a.abs() @ b.abs())
