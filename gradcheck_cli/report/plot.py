"""``sweep-eps --plot``: error against epsilon drawn with matplotlib (imported only when a plot is asked for)."""
from __future__ import annotations

import numpy as np


def plot_sweeps(sweeps, fh, fmt: str = "png") -> None:
    """Log-log curves of error against epsilon, one panel per scenario, the run's step marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(sweeps), 1, figsize=(7, 3.2 * len(sweeps)), squeeze=False)
    for ax, sweep in zip(axes[:, 0], sweeps):
        for t, errors in sweep.errors.items():
            values = np.asarray(errors, dtype=float)
            ok = np.isfinite(values) & (values > 0)
            ax.loglog(np.asarray(sweep.steps)[ok], values[ok], marker="o", label=t)
        ax.axvline(sweep.chosen, color="grey", linestyle="--", label=f"run's epsilon {sweep.chosen:g}")
        ax.set_title(f"{sweep.name} ({sweep.dtype})")
        ax.set_xlabel("epsilon")
        ax.set_ylabel("relative error")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(fh, format=fmt)
    plt.close(fig)
