"""tools/profile_step.py (the GPU report's training-step profile) on tiny sizes on the CPU: both models are
profiled and reported, so the GPU session that runs it at the paper's sizes gets both tables."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_profile_step_reports_both_models(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "tools" / "profile_step.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "profile.md"
    assert tool.main(["--device", "cpu", "--config", "tiny", "--vocab", "64", "--pairs", "3", "--max-len", "6",
                      "--warmup", "1", "--steps", "1", "--rows", "200", "--out", str(out)]) == 0
    report = out.read_text()
    ours, theirs = report.split("### torch.nn.Transformer")
    assert "### fastformer" in ours
    for section in (ours, theirs):
        assert "target tokens/s" in section and "Self CPU time total" in section  # a step time and a table
    # Each profile is of its own step: the fused loss in fastformer's, PyTorch's in the baseline's.
    assert "fastformer::cross_entropy_fwd" in ours and "fastformer::" not in theirs
    assert "aten::cross_entropy_loss" in theirs


def test_translation_report_scores_every_engine(tmp_path):
    """tools/translation_report.py on the tiny trained checkpoint of tests/data: a table per batch size with
    BLEU, chrF and time for fastformer float32 and int8 (and CTranslate2's two where it is installed)."""
    spec = importlib.util.spec_from_file_location("translation_report", ROOT / "tools" / "translation_report.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "translation.md"
    tool.main([str(ROOT / "tests" / "data" / "tiny-bible-de-en.pt"), "--batch", "1", "3", "--limit", "5",
               "-o", str(out)])
    report = out.read_text()
    assert "commit " in report.splitlines()[0] and "5 test sentences" in report
    for size in (1, 3):
        assert f"Batch {size}:" in report
    rows = [line for line in report.splitlines() if line.startswith("| fastformer int8 |")]
    assert len(rows) == 2 and all(row.endswith("| 1.00x |") for row in rows)
    assert report.count("| fastformer float32 |") == 2
