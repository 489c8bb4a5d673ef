#!/usr/bin/python3
"""Draws `eplbx simulate` runs: balancedness per step, rebalance events marked.

Usage: plot_simulation.py RUNS.json OUT.png|OUT.svg  (RUNS.json: a JSON array of runs, each
with the summary keys and "series": {"balancedness": [...], "rebalance_events": [...]}).
Called by `eplbx simulate --plot`; needs Debian's python3-matplotlib.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: plot_simulation.py RUNS.json OUT.png|OUT.svg")
    with open(argv[1]) as f:
        runs = json.load(f)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run in runs:
        label = "%s w=%d i=%d: mean %.3f, %d rebalances" % (
            run["policy"], run["window"], run["interval"], run["mean_balancedness"],
            run["rebalances"])
        bal = run["series"]["balancedness"]
        (line,) = ax.plot(range(len(bal)), bal, linewidth=0.8, label=label)
        steps = [e["step"] for e in run["series"]["rebalance_events"]]
        ax.plot(steps, [bal[s] for s in steps], "v", color=line.get_color(), markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("balancedness (mean / max rank load)")
    ax.set_title("eplbx simulate: placement in force scored on each step's load (v = rebalance)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(argv[2])


if __name__ == "__main__":
    main(sys.argv)
