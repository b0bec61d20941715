"""`dflash bench`'s figure: acceptance per draft position and output throughput per load."""

from __future__ import annotations

from pathlib import Path

from dflash_serve.services.bench.report import load_label, run_label


def plot(runs: list[dict], path: Path) -> None:
    """Left: acceptance per draft position, per prompt set (pooled over the loads: greedy
    acceptance does not depend on the batch). Right: output tok/s at each load."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    fig, (acc_ax, tps_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    speculated = False
    loads = list(dict.fromkeys(load_label(r) for r in runs))
    for name in dict.fromkeys(map(run_label, runs)):
        mine = [r for r in runs if run_label(r) == name]
        rounds = sum(r["rounds"] for r in mine)
        positions = max(len(r["accepted_per_position"]) for r in mine)
        if rounds and positions:
            pooled = [sum(r["accepted_per_position"][j] for r in mine if j < len(r["accepted_per_position"])) / rounds
                      for j in range(positions)]
            acc_ax.plot(range(1, positions + 1), pooled, marker="o", label=name)
            speculated = True
        tps_ax.plot([loads.index(load_label(r)) for r in mine], [r["output_tok_s"] for r in mine], marker="o",
                    label=name)
    acc_ax.set(title="acceptance per draft position", xlabel="draft position", ylabel="fraction of rounds",
               ylim=(0, 1.02))
    if not speculated:
        acc_ax.text(0.5, 0.5, "no drafts: target-only", ha="center", transform=acc_ax.transAxes)
    tps_ax.set(title="output throughput", xlabel="load", ylabel="output tok/s")
    tps_ax.set_xticks(range(len(loads)), labels=loads)
    for ax in (acc_ax, tps_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
