"""What the three growth-curve scripts (scale_rows, scale_catalog, scale_memory) share: log-log
figures saved as PNG, and the table printed, with the rows optionally written as JSON and plotted.
matplotlib is imported only when a plot is asked for (the ``benchmarks`` extra)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def figure(columns: int = 1, size: tuple[float, float] = (7, 4.5)) -> tuple[Any, Any]:
    """(figure, axes) without a display (``Agg``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(1, columns, figsize=size) if columns > 1 else plt.subplots(figsize=size)


def log_log(axis: Any, xlabel: str, ylabel: str, title: str, legend_size: int | None = 7) -> None:
    axis.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(**({"fontsize": legend_size} if legend_size else {}))


def save(figure_: Any, path: Path) -> None:
    figure_.tight_layout()
    figure_.savefig(path, dpi=110)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    parser.add_argument("--plot", type=Path, help="draw the curves into this PNG")


def report(title: str, rows: list[dict[str, Any]], table: Callable[[list], str],
           plot: Callable[[list, Path], None], args: argparse.Namespace) -> int:
    """Print the Markdown table under ``title``; write ``--json`` and ``--plot`` where asked."""
    print(f"\n## {title}\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0
