#!/usr/bin/env python3
"""Planning time of each policy against deepseek's, builds A/B in one run (docs/perf.md).

Runs `eplbx_plan_bench --benchmark_filter=PlanPolicy/...` of each build given, alternating
the builds round by round (a slow spell of the machine falls on every build alike), and
prints one JSON document: per build and benchmark the median over the rounds in ms, and
each policy's ratio to deepseek's median at the same shape in the same build (the issue's
target is `balanced` and `incremental` within 3x of deepseek at EP256 and DeepSeek-V3).

  python3 bench/plan_compare.py [--rounds 3] [--filter 'PlanPolicy/(ep256|dsv3)_']
      [--min-time 0.2] LABEL=build/bin/eplbx_plan_bench [before=/tmp/old/eplbx_plan_bench ...]
"""
import argparse
import json
import re
import statistics
import subprocess
import sys


def run(binary, pattern, min_time):
    out = subprocess.run(
        [binary, f"--benchmark_filter={pattern}", f"--benchmark_min_time={min_time}",
         "--benchmark_format=json"],
        check=True, capture_output=True, text=True).stdout
    return {b["name"]: b["real_time"] for b in json.loads(out)["benchmarks"]
            if b.get("run_type", "iteration") == "iteration"}


def parse_builds(specs, tool):
    """[(label, path)] from LABEL=PATH arguments; exits naming the one that is not."""
    builds = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            sys.exit(f"{tool}: '{spec}' is not LABEL=PATH")
        builds.append((label, path))
    return builds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", metavar="LABEL=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--filter", default="PlanPolicy/")
    parser.add_argument("--min-time", type=float, default=0.2)
    args = parser.parse_args()
    builds = parse_builds(args.builds, "plan_compare")
    if args.rounds < 1:
        sys.exit("plan_compare: --rounds must be at least 1")
    times = {label: {} for label, _ in builds}
    for _ in range(args.rounds):
        for label, path in builds:
            for name, ms in run(path, args.filter, args.min_time).items():
                times[label].setdefault(name, []).append(ms)
    result = {"rounds": args.rounds, "filter": args.filter, "builds": {}}
    for label, path in builds:
        medians = {name: statistics.median(v) for name, v in times[label].items()}
        ratios = {}
        for name, ms in medians.items():
            m = re.match(r"PlanPolicy/(\w+?)_(balanced|incremental)(_1thread|_drift)?$", name)
            deepseek = medians.get(f"PlanPolicy/{m.group(1)}_deepseek") if m else None
            if deepseek:
                ratios[name] = round(ms / deepseek, 2)
        result["builds"][label] = {"path": path,
                                   "median_ms": {k: round(v, 3) for k, v in medians.items()},
                                   "ratio_to_deepseek": ratios}
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
