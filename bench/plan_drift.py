#!/usr/bin/env python3
"""`incremental` on drifting loads: copies, balance and time of each build, same cases (docs/perf.md).

For each seed and shape (global and hierarchical, 4 to 256 ranks) it draws a load of 6 layers
(Zipf-like, Pareto, or Zipf-like with a quarter of the experts idle), plans it with `balanced`
(the placement in force), scales each expert's load by a factor drawn uniformly from
[0.5, 1.5] (the drift) and plans the drifted load with `incremental --previous <that
placement>` and with `balanced`, through `eplbx plan` of every build given. Prints one JSON
document: per build and mode (global / hierarchical), the cases, the copies in all (remote and
local), the planning time in all (plan_ms), the worst per-layer balancedness against the same
build's `balanced` (the policy's tolerance is 0.002 below it), and how many plans are
identical to the first build's, and how many take fewer or more copies than it. Pure Python; the previous placement comes from the first build.

  python3 bench/plan_drift.py [--seeds 12] before=/tmp/old/eplbx after=build/bin/eplbx
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

from plan_compare import parse_builds  # the same LABEL=PATH arguments

# (slots, ranks, nodes, groups, experts)
SHAPES = [(288, 32, 4, 8, 256), (512, 256, 32, 8, 256), (72, 4, 1, 1, 64),
          (160, 16, 2, 4, 128), (96, 8, 2, 4, 64), (320, 64, 8, 8, 256), (48, 8, 1, 1, 40)]
LAYERS = 6


def draw_load(rng, seed, experts):
    family = seed % 3
    rows = []
    for _ in range(LAYERS):
        if family == 1:  # Pareto
            row = [rng.paretovariate(1.2) * 100 for _ in range(experts)]
        else:  # Zipf-like: 1 / rank^a over a shuffled order
            a = rng.uniform(0.6, 1.6)
            scale = rng.uniform(1, 100)
            order = list(range(experts))
            rng.shuffle(order)
            row = [scale * 1000 / (order[e] + 1) ** a for e in range(experts)]
            if family == 2:  # a quarter of the experts idle
                for e in rng.sample(range(experts), experts // 4):
                    row[e] = 0.0
        rows.append(row)
    return rows


def plan(binary, args):
    out = subprocess.run([binary, "plan"] + args, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", metavar="LABEL=PATH")
    parser.add_argument("--seeds", type=int, default=12)
    args = parser.parse_args()
    builds = parse_builds(args.builds, "plan_drift")
    if args.seeds < 1:
        sys.exit("plan_drift: --seeds must be at least 1")
    stats = {label: {} for label, _ in builds}
    with tempfile.TemporaryDirectory(prefix="eplbx-plan-drift-") as tmp:
        load_path, drift_path, prev_path = (os.path.join(tmp, n) for n in
                                            ("load.json", "drift.json", "prev.json"))
        for seed in range(args.seeds):
            rng = random.Random(seed)
            for slots, ranks, nodes, groups, experts in SHAPES:
                load = draw_load(rng, seed, experts)
                drifted = [[x * rng.uniform(0.5, 1.5) for x in row] for row in load]
                with open(load_path, "w") as f:
                    json.dump(load, f)
                with open(drift_path, "w") as f:
                    json.dump(drifted, f)
                shape = ["--slots", str(slots), "--ranks", str(ranks), "--nodes", str(nodes),
                         "--groups", str(groups)]
                prev = plan(builds[0][1], ["--load", load_path, "--policy", "balanced"] + shape)
                with open(prev_path, "w") as f:
                    json.dump({"phy2log": prev["phy2log"]}, f)
                mode = "hierarchical" if nodes > 1 and groups % nodes == 0 else "global"
                first = None
                for label, path in builds:
                    inc = plan(path, ["--load", drift_path, "--policy", "incremental",
                                      "--previous", prev_path] + shape)
                    bal = plan(path, ["--load", drift_path, "--policy", "balanced"] + shape)
                    s = stats[label].setdefault(mode, {"cases": 0, "copies": 0, "plan_ms": 0.0,
                                                       "worst_below_balanced": 0.0,
                                                       "same_as_first": 0, "fewer_copies": 0,
                                                       "more_copies": 0})
                    copies = inc["moves"]["remote_copies"] + inc["moves"]["local_copies"]
                    s["cases"] += 1
                    s["copies"] += copies
                    s["plan_ms"] += inc["plan_ms"]
                    below = max(b - i for b, i in zip(bal["balancedness"], inc["balancedness"]))
                    s["worst_below_balanced"] = max(s["worst_below_balanced"], below)
                    if first is None:
                        first = (inc["phy2log"], copies)
                    s["same_as_first"] += inc["phy2log"] == first[0]
                    s["fewer_copies"] += copies < first[1]
                    s["more_copies"] += copies > first[1]
    for label, _ in builds:
        for s in stats[label].values():
            s["plan_ms"] = round(s["plan_ms"], 1)
            s["worst_below_balanced"] = round(s["worst_below_balanced"], 6)
    json.dump({"seeds": args.seeds, "layers": LAYERS, "tolerance": 0.002,
               "builds": {label: {"path": path, **stats[label]} for label, path in builds}},
              sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
