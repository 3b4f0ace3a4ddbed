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


def set_attention_dropout(model, p: float) -> None:
    """Dropout ``p`` on the attention probabilities of every attention layer (no flag sets it: the --config
    presets have none); read at each forward, so it holds for graphs captured later."""
    from fastformer.nn.attention import MultiHeadAttention

    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.attention_dropout = p


def train_updates(run, steps: int) -> tuple[list[float], list[int], list[tuple]]:
    """``steps`` updates of fastformer.training.step.train_step: each update's loss per target token and its
    number of micro-batches, and every host batch drawn, in order."""
    from fastformer.training.step import train_step

    losses, micro, drawn = [], [], []
    draw = run.batches.next_tensors
    run.batches.next_tensors = lambda: drawn.append(draw()) or drawn[-1]
    try:
        for _ in range(steps):
            before = len(drawn)
            update = train_step(run)
            losses.append(update["sums"][0].item() / update["tokens"])
            micro.append(len(drawn) - before)
    finally:
        del run.batches.next_tensors
    return losses, micro, drawn


# The captured step against the eager one (tests/gpu/test_cuda_graph_step.py, and its CPU stand-in in
# tests/train/test_sync_free_step.py): (extra flags, attention dropout) per case. --update-tokens 400
# (tiny_run_args) is below a batch's 600 tokens, so nearly every update is one micro-batch; 1500 accumulates
# 4 micro-batches in every update on the fixture. Packed batches (--batching packed) come in one shape.
GRAPH_CASES = {"update of one micro-batch": ((), 0.0),
               "accumulated micro-batches": (("--update-tokens", "1500"), 0.0),
               "attention dropout": ((), 0.2),
               "packed batches": (("--batching", "packed"), 0.0)}
