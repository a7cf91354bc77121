"""The simulator's figures: one ETTR panel per cluster side by side, one legend below them."""

from __future__ import annotations

from typing import Any


def ettr_panels(n: int, height: float) -> tuple[Any, list[Any]]:
    """A figure of `n` panels sharing the y axis (ETTR, 0-1), on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, height), sharey=True, squeeze=False)
    for ax in axes[0]:
        ax.set_xlabel("MTBF (min)")
        ax.set_ylim(0, 1)
    return fig, list(axes[0])


def save_panels(fig: Any, axes: list[Any], ylabel: str, path: str, bottom: float) -> None:
    """Label the first panel, put the last panel's legend under all of them, write `path`, close."""
    import matplotlib.pyplot as plt

    axes[0].set_ylabel(ylabel)
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
