"""A run's log.jsonl (one JSON object per line: ``kind`` train, dev, test or summary (the run's result and
where it was measured: fastformer.runtime.provenance), and ``step``) and its loss
plot. Only the main process writes. A resumed run first drops the records of updates after its
checkpoint (written before a crash), so the log holds each update once."""
from __future__ import annotations

import json
import os
import sys


class RunLog:
    def __init__(self, path: str, enabled: bool):
        self.path, self.enabled = path, enabled

    def start(self, resumed_step: int | None) -> None:
        """A fresh run starts an empty log; a resumed one keeps the records up to its checkpoint's step."""
        if not self.enabled:
            return
        keep = [] if resumed_step is None else [r for r in self.records() if r.get("step", 0) <= resumed_step]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def plot(self, png_path: str) -> None:
        """The train loss and dev NLL per update, as a PNG (skipped when nothing was logged)."""
        train = [(r["step"], r["loss"]) for r in self.records() if r.get("kind") == "train"]
        dev = [(r["step"], r["dev_loss"]) for r in self.records() if r.get("kind") == "dev"]
        if not self.enabled or not (train or dev):
            return
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no loss.png (pip install matplotlib)", file=sys.stderr)
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), label="train (label-smoothed, per token)")
        if dev:
            ax.plot(*zip(*dev), marker="o", label="dev NLL (per token)")
        ax.set_xlabel("update")
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
        plt.close(fig)
