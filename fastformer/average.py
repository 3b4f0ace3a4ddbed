"""python -m fastformer.average: average the weights of several checkpoints (the paper averaged the last 5)."""
from __future__ import annotations

import argparse

from fastformer import checkpoint as ckpt
from fastformer.cli import HelpFormatter, int_at_least


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastformer.average",
                                description="Average model weights of checkpoints: name them with --inputs, or give "
                                            "one run folder and --last N.",
                                formatter_class=HelpFormatter)
    p.add_argument("--inputs", nargs="+", required=True, metavar="P", help="checkpoint files, or one run folder")
    p.add_argument("--last", type=int_at_least(1),
                   help="with a run folder: average its last N checkpoints (default: average --inputs as named, "
                        "a run folder standing for its latest checkpoint)")
    p.add_argument("--output", required=True, metavar="P", help="the averaged checkpoint file to write")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.last is not None:
            if len(args.inputs) != 1:
                raise ckpt.CheckpointError("--last takes exactly one run folder in --inputs")
            paths = ckpt.list_checkpoints(args.inputs[0])[-args.last:]
            if len(paths) < args.last:
                raise ckpt.CheckpointError(f"{args.inputs[0]} holds {len(paths)} checkpoints, fewer than --last {args.last}")
        else:
            paths = [ckpt.resolve(p) for p in args.inputs]
        ckpt.save(ckpt.average(paths), args.output)
    except ckpt.CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from exc
    print(f"averaged {len(paths)} checkpoints into {args.output}")


if __name__ == "__main__":
    main()
