"""Plot training runs: lm loss, learning rate, tokens/s and peak memory against iteration.

Each input is a ``pretrain_gpt.py`` log file (rank 0's stdout, Megatron-LM style lines) or a
TensorBoard directory (``--tensorboard-dir``) / event file. Several inputs are overlaid, one
colour per run, in one PNG with four panels. Validation loss, when logged, shows as markers on
the loss panel.

    python tools/plot_run.py runs/sp8.log runs/sp4/tensorboard --labels sp8 sp4 --output run.png

Exit codes: 0 written; 1 an input holds no training data; 2 bad arguments, a missing input or
an --output that cannot be written.
"""

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# Metric key -> (panel title, y-axis label). Keys are what ``parse_log`` / ``read_tensorboard``
# return; "val_loss" is drawn on the "loss" panel.
PANELS = {
    "loss": ("lm loss", "loss"),
    "lr": ("learning rate", "learning rate"),
    "throughput": ("throughput", "tokens/s"),
    "memory": ("peak memory", "GiB"),
}
METRICS = (*PANELS, "val_loss")

# Log key (text before ": " in an iteration line) -> metric key.
LOG_KEYS = {
    "lm loss": "loss",
    "learning rate": "lr",
    "throughput (tokens/s)": "throughput",
    "peak memory (GiB)": "memory",
}
VALIDATION_LOG_KEY = "lm loss value"

# TensorBoard scalar tag -> metric key ("lm loss validation" is Megatron-LM's own tag).
TB_TAGS = {
    "lm loss": "loss",
    "learning-rate": "lr",
    "throughput/tokens-per-sec": "throughput",
    "memory/peak-GiB": "memory",
    "validation/lm loss": "val_loss",
    "lm loss validation": "val_loss",
}

Series = List[Tuple[int, float]]  # (iteration, value), sorted by iteration, iterations unique
Run = Dict[str, Series]  # metric key -> series; only metrics that were logged

_TRAIN_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+")
# "validation loss at iteration 10" or, at the end of training, "... on validation set";
# "... on test set" is not validation and is skipped.
_VALID_RE = re.compile(r"\bvalidation loss at iteration\s+(\d+)(?!.*\btest set\b)")


class InputError(Exception):
    """An input exists but holds nothing to plot (message names the input)."""


def _float(text: str) -> Optional[float]:
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_line(line: str) -> Optional[Tuple[str, int, Dict[str, float]]]:
    """One log line -> ``("train" | "validation", iteration, {log key: value})``, or None.

    Fields are split on ``" | "`` then on the first ``": "``; fields whose value is not a number
    (``ETA: 0:01:23``) are dropped. Lines that are neither iteration nor validation lines give
    None, whatever precedes the iteration field (timestamps, ``[rank0]:`` prefixes).
    """
    fields = [field.strip(" \t|") for field in line.strip().split(" | ")]
    head = fields[0]
    match = _TRAIN_RE.search(head)
    kind = "train"
    if match is None:
        match = _VALID_RE.search(head)
        kind = "validation"
    if match is None:
        return None
    values = {}
    for field in fields[1:]:
        key, sep, value = field.partition(": ")
        number = _float(value) if sep else None
        if number is not None:
            values[key.strip()] = number
    return kind, int(match.group(1)), values


def _to_run(points: Dict[str, Dict[int, float]]) -> Run:
    return {key: sorted(by_iter.items()) for key, by_iter in points.items() if by_iter}


def parse_log(path) -> Run:
    """Parse a ``pretrain_gpt.py`` log into ``{metric: [(iteration, value), ...]}``.

    Metric keys are ``loss``, ``lr``, ``throughput`` (tokens/s), ``memory`` (peak GiB) and
    ``val_loss``; a metric appears only if some line logged it. Unknown keys and other lines
    are ignored; if an iteration is logged twice (a resumed run appended to the same log) the
    later line wins. Raises ``FileNotFoundError`` for a missing file and ``InputError`` when the
    file has no iteration lines.
    """
    path = Path(path)
    points: Dict[str, Dict[int, float]] = {key: {} for key in METRICS}
    found = False
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            parsed = parse_line(line)
            if parsed is None:
                continue
            kind, iteration, values = parsed
            if kind == "train":
                found = True
                for log_key, metric in LOG_KEYS.items():
                    if log_key in values:
                        points[metric][iteration] = values[log_key]
            elif VALIDATION_LOG_KEY in values:
                points["val_loss"][iteration] = values[VALIDATION_LOG_KEY]
    if not found:
        raise InputError(f"{path}: no iteration lines (expected 'iteration N/ M | ... |' lines "
                         "as printed by pretrain_gpt.py)")
    return _to_run(points)


def read_tensorboard(path) -> Run:
    """Read a TensorBoard directory (or event file) into the same shape as ``parse_log``."""
    from tensorboard.backend.event_processing import event_accumulator

    path = Path(path)
    if path.is_dir() and not any(path.glob("*tfevents*")):
        nested = sorted({p.parent for p in path.rglob("*tfevents*") if p.is_file()})
        if len(nested) != 1:
            found = f": found {', '.join(map(str, nested))}" if nested else ""
            raise InputError(f"{path}: expected one directory of TensorBoard event files{found}")
        path = nested[0]
    accumulator = event_accumulator.EventAccumulator(
        str(path), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    points: Dict[str, Dict[int, float]] = {key: {} for key in METRICS}
    tags = accumulator.Tags().get(event_accumulator.SCALARS, [])
    for tag, metric in TB_TAGS.items():
        if tag in tags:
            for event in accumulator.Scalars(tag):
                points[metric][int(event.step)] = float(event.value)
    run = _to_run(points)
    if not run:
        raise InputError(f"{path}: no training scalars (looked for tags {', '.join(TB_TAGS)})")
    return run


def load_run(path) -> Run:
    """A log file, a TensorBoard directory or a TensorBoard event file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    if path.is_dir() or "tfevents" in path.name:
        return read_tensorboard(path)
    return parse_log(path)


def default_labels(paths: Sequence[str]) -> List[str]:
    """File/dir names; when two collide, the parent directory is prepended to each."""
    resolved = [Path(p).resolve() for p in paths]
    labels = [p.name for p in resolved]
    if len(set(labels)) < len(labels):
        labels = [f"{p.parent.name}/{p.name}" for p in resolved]
    return labels


def plot(runs: Sequence[Run], labels: Sequence[str], output, title: Optional[str] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for ax, (metric, (panel_title, ylabel)) in zip(axes.flat, PANELS.items()):
        ax.set_title(panel_title)
        has_validation = False
        drawn = False
        for index, run in enumerate(runs):
            color = colors[index % len(colors)]
            if metric in run:
                xs, ys = zip(*run[metric])
                ax.plot(xs, ys, color=color, linewidth=1.2, marker="." if len(xs) == 1 else None)
                drawn = True
            if metric == "loss" and "val_loss" in run:
                xs, ys = zip(*run["val_loss"])
                ax.plot(xs, ys, linestyle="none", marker="o", markersize=5, color=color,
                        markeredgecolor="black", markeredgewidth=0.5)
                drawn = has_validation = True
        if not drawn:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center",
                    color="gray", fontsize=14)
            ax.set_yticks([])
            continue
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if metric == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if has_validation:
            ax.legend(handles=[
                Line2D([], [], color="gray", label="train"),
                Line2D([], [], color="gray", linestyle="none", marker="o",
                       markeredgecolor="black", label="validation")], fontsize="small")
    for ax in axes[1]:
        ax.set_xlabel("iteration")
        ax.tick_params(labelbottom=True)
    handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=2, label=label)
               for i, label in enumerate(labels)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4),
               frameon=False)
    if title:
        fig.suptitle(title)
    legend_rows = math.ceil(len(handles) / 4)
    fig.tight_layout(rect=(0, 0.03 + 0.03 * legend_rows, 1, 1))
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 written; 1 an input holds no training data; "
               "2 bad arguments, a missing input or an --output that cannot be written.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="pretrain_gpt.py log file, or TensorBoard dir / event file")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="one legend label per INPUT (default: file/dir names)")
    parser.add_argument("--output", "-o", default="run.png", help="PNG to write (default run.png)")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.inputs):
        parser.error(f"--labels got {len(args.labels)} labels for {len(args.inputs)} inputs")
    return args


def output_error(output: str) -> Optional[str]:
    """Why the figure cannot go to ``output`` by its name (matplotlib picks the format from the
    suffix and appends ``.png`` to a name without one), or None."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(output)
    if path.is_dir():
        return f"--output {output!r} is a directory; give a file name, e.g. {path / 'run.png'}"
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if not path.suffix:
        return f"--output {output!r} has no image suffix; give e.g. {output}.png"
    if path.suffix[1:].lower() not in formats:
        return (f"--output {output!r}: {path.suffix!r} is not an image format matplotlib writes "
                f"(give one of {', '.join('.' + name for name in formats)})")
    return None


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    prog = Path(sys.argv[0]).name if argv is None else "plot_run.py"
    missing = [path for path in args.inputs if not Path(path).exists()]
    if missing:
        for path in missing:
            print(f"{prog}: error: no such file or directory: {path}", file=sys.stderr)
        return 2
    bad_output = output_error(args.output)
    if bad_output:
        print(f"{prog}: error: {bad_output}", file=sys.stderr)
        return 2
    try:
        runs = [load_run(path) for path in args.inputs]
    except InputError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    labels = args.labels or default_labels(args.inputs)
    try:
        plot(runs, labels, args.output, args.title)
    except OSError as error:
        print(f"{prog}: error: --output {args.output!r} cannot be written "
              f"({error.strerror or error}); give a writable --output", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
