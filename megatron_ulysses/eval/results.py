"""The passkey run's results: the accuracy of each (length, depth) cell, as a markdown table,
passkey.json (every trial's record too) and the heat map passkey.png."""

import json
import os
from typing import List, Optional


def summarize(records: List[dict], lengths: List[int], depths: List[float], trials: int,
              load: str, iteration: Optional[int]) -> dict:
    """passkey.json: `accuracy[i][j]` is the share of right answers at lengths[i], depths[j]."""
    accuracy = [[sum(r["correct"] for r in records if r["length"] == length
                     and r["depth"] == depth) / trials for depth in depths]
                for length in lengths]
    return {"load": load, "iteration": iteration, "lengths": lengths, "depths": depths,
            "trials": trials, "accuracy": accuracy,
            "mean": [sum(row) / len(row) for row in accuracy], "records": records}


def format_table(result: dict) -> str:
    """Markdown: a row per length, a column per depth (accuracy over the trials), the mean."""
    header = ["length"] + [f"depth {depth:g}" for depth in result["depths"]] + ["mean"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for length, row, mean in zip(result["lengths"], result["accuracy"], result["mean"]):
        lines.append("| " + " | ".join([str(length)] + [f"{a:.3f}" for a in row + [mean]])
                     + " |")
    return "\n".join(lines)


def plot_heatmap(result: dict, path: str) -> None:
    import matplotlib  # only rank 0 draws, once: not imported with the package

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = result["lengths"], result["depths"]
    grid = [[result["accuracy"][i][j] for i in range(len(lengths))] for j in range(len(depths))]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(lengths) + 2.5),
                                    max(3.0, 0.5 * len(depths) + 2.0)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{depth:g}" for depth in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    for j in range(len(depths)):
        for i in range(len(lengths)):
            ax.text(i, j, f"{grid[j][i]:.2f}", ha="center", va="center", fontsize=9)
    fig.colorbar(image, ax=ax, label=f"accuracy ({result['trials']} trials)")
    ax.set_title(f"passkey retrieval: {os.path.basename(os.path.normpath(result['load']))}"
                 f" (iteration {result['iteration']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(result: dict, output_dir: str) -> None:
    """output_dir/passkey.json (replaced whole, never half written) and passkey.png."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "passkey.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    plot_heatmap(result, os.path.join(output_dir, "passkey.png"))
