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
