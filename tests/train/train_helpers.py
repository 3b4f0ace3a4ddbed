"""Shared settings of the training tests: the committed fixture (480 short Bible verse pairs, German and
English, from the public-domain Elberfelder 1932 and World English Bible texts) and a tiny fast run."""
import pathlib

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def tiny_run_args(out, *extra, test=False):
    """Arguments of a seconds-long training run on the fixture (the final test translation only if ``test``)."""
    return ["--config", "tiny", "--vocab-size", "300", "--out", str(out),
            "--train-src", str(DATA / "train.de"), "--train-tgt", str(DATA / "train.en"),
            "--valid-src", str(DATA / "dev.de"), "--valid-tgt", str(DATA / "dev.en"),
            "--test-src", str(DATA / "test.de"), "--test-tgt", str(DATA / "test.en"),
            "--max-tokens", "600", "--update-tokens", "400", "--warmup", "20", "--lr-factor", "0.2",
            "--eval-every", "0", "--log-every", "1", "--checkpoint-minutes", "100", *([] if test else ["--no-test"]),
            *extra]
