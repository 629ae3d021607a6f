"""Loss curves of one or more training runs (each a `train.py --save-losses` JSON) in one PNG.

    python examples/flax_moe/plot.py run_f32.json run_bf16.json --out loss.png

Each run is drawn as its per-step loss (faint) and a moving average, labelled with its dtype,
expert matmul and devices; the first run's expected loss of the rules (data.py) is a dashed
line. Comparing runs shows whether a change (another matmul, another dtype) moves the curve beyond
step-to-step noise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def run_label(run: dict) -> str:
    return f"{run['config']['dtype']}, {run['matmul']} matmul, {run['devices']}"


def plot_runs(runs: list[dict], path: str) -> None:
    """Writes the runs' per-step losses, their moving averages and the rules' expected loss
    (examples/flax_moe/data.py) to a PNG."""
    import matplotlib  # noqa: PLC0415 - only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(runs):
        losses = np.asarray(run["losses"], np.float32)
        steps = np.arange(1, len(losses) + 1)
        window = max(1, len(losses) // 30)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        color = f"C{i}"
        ax.plot(steps, losses, alpha=0.25, color=color)
        ax.plot(steps[window - 1:], smooth, color=color,
                label=f"{run_label(run)} (moving average {window})")
    ax.axhline(runs[0]["expected_rule_loss"], color="gray", linestyle="--",
               label="the rules' expected loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("Flax NNX MoE transformer trained with jax_ep")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="train.py --save-losses JSON files")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    runs = [json.loads(Path(r).read_text()) for r in args.runs]
    plot_runs(runs, args.out)
    for run in runs:
        losses = np.asarray(run["losses"])
        print(f"{run_label(run)}: loss of the last 50 steps {losses[-50:].mean():.4f} "
              f"(std {losses[-50:].std():.4f}), eval loss {run['eval_loss']:.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
