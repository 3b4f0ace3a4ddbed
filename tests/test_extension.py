"""The compiled extension: built against the running torch, and a mismatch explained in words."""
import torch

import fastformer
from fastformer import _dispatch, _ext


def test_extension_matches_running_torch():
    C = _ext.extension()
    assert C.TORCH_VERSION == torch.__version__
    for op in ("attention", "softmax", "layer_norm_residual"):
        for phase in ("fwd", "bwd"):
            assert callable(getattr(C, f"{op}_{phase}_cpu"))
    assert fastformer.backends()["cpu"] is True


def test_torch_mismatch_gives_a_clear_error(monkeypatch):
    # What a user sees when fastformer._C was compiled against another torch: the import fails with an
    # undefined symbol, and fastformer turns it into a message naming both versions and the fix.
    def broken_import(name):
        raise ImportError("fastformer/_C.so: undefined symbol: _ZN3c1017SomethingChangedEv")

    monkeypatch.setattr(_ext, "import_module", broken_import)
    monkeypatch.setattr(_ext, "_built_against", lambda: "2.0.0")
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_error", None)
    monkeypatch.setattr(_dispatch, "_status_cache", {})
    _ext._load()
    assert not _ext.available()
    message = _ext.error()
    assert "built against torch 2.0.0" in message and torch.__version__ in message
    assert "pip install --force-reinstall --no-deps ." in message
    assert fastformer.backends()["cpu"] is False
    x = torch.randn(3, 5)
    try:
        fastformer.ops.softmax(x, backend="cpu")
    except RuntimeError as exc:
        assert "built against torch 2.0.0" in str(exc) and "'cpu'" in str(exc)
    else:
        raise AssertionError("the cpu backend must refuse to run with a mismatched extension")
    # The torch backend keeps working.
    torch.testing.assert_close(fastformer.ops.softmax(x, backend="torch"), torch.softmax(x, -1))
