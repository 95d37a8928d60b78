"""Plots of measured figures; every PNG memtrim writes goes through here (matplotlib, an optional dependency)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import MissingDependencyError

__all__ = ["plot_curves", "pyplot"]


def pyplot(what: str) -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        MissingDependencyError: matplotlib is not installed (``what`` names the caller in the message).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} needs matplotlib, which is not installed. Install it with `pip install matplotlib` (or "
            "`pip install memtrim[plot]`), or write the figures as JSON instead."
        ) from e
    return plt


def plot_curves(path: str, x: Sequence[float], curves: Mapping[str, Sequence[float]], *, xlabel: str, ylabel: str,
                title: str, log2_x: bool = True, divide_by: float = 1.0, figsize: tuple[float, float] = (6, 4)
                ) -> None:
    """Write a PNG with one marked line per curve over ``x`` (e.g. activation bytes per stack depth).

    Args:
        path: the PNG to write.
        x: the x values, shared by every curve.
        curves: label -> y values (one per x).
        xlabel, ylabel, title: the axes' labels and the title.
        log2_x: a base-2 logarithmic x axis (depths 1, 2, 4, ...).
        divide_by: each y value is divided by this (``2**20`` to plot bytes as MiB).
        figsize: the figure's size in inches.

    Raises:
        MissingDependencyError: matplotlib is not installed.

    Example::

        plot_curves("depth.png", [1, 2, 4], {"plain": [10, 20, 40], "reversible": [10, 10, 10]},
                    xlabel="blocks", ylabel="bytes", title="activations kept")
    """
    plt = pyplot("memtrim.measure.plots.plot_curves")
    fig, ax = plt.subplots(figsize=figsize)
    for label, values in curves.items():
        ax.plot(x, [v / divide_by for v in values], marker="o", label=label)
    if log2_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
