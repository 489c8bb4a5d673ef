#!/usr/bin/env python3
"""Commit modes and loops of the rearrangement, A/B in one run (docs/perf.md).

Runs `eplbx demo --json` for in place / swap x synchronous (layers in flight together, the
default, or one layer at a time: --layers-in-flight 1) / pipelined, interleaved round by
round (a slow spell of the machine falls on every configuration alike), at 1 MiB and 16 MiB
experts. Each demo run measures its own copy limit (two threads, streaming stores), so every
ratio is to the limit of the same run. Prints one JSON document.

  python3 bench/commit_modes.py [--eplbx build/bin/eplbx] [--rounds 3]
      [--only "swap synchronous,swap pipelined"] [--compare before=/tmp/old/eplbx ...]

--compare LABEL=PATH runs the same configurations with another build of eplbx (a baseline
built from an earlier commit), interleaved with this one's, its results under "LABEL: ...".
--only keeps the configurations whose name contains one of the comma-separated parts.
"""
import argparse
import json
import subprocess
import sys

SHAPES = {
    "1M": ["--expert-bytes", "1M"],  # the demo's default shape: 8 layers x 64 experts, 18 slots
    "16M": ["--expert-bytes", "16M", "--layers", "4", "--experts", "32", "--slots-per-rank", "9"],
}
SLOTS = {"1M": 18, "16M": 9}


def configs(shape):
    for mode in ("in place", "swap"):
        for loop in ("one layer at a time", "synchronous", "pipelined"):
            args = list(SHAPES[shape])
            if mode == "swap":
                args += ["--spare-rows", str(SLOTS[shape])]  # one spare row per slot
            if loop == "one layer at a time":  # the synchronous loop before layers overlapped
                args += ["--layers-in-flight", "1"]
            if loop == "pipelined":
                args.append("--pipeline")
            yield f"{shape} {mode} {loop}", args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--eplbx", default="build/bin/eplbx")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default="")
    ap.add_argument("--compare", action="append", default=[], metavar="LABEL=PATH")
    a = ap.parse_args()
    builds = [("", a.eplbx)]
    for c in a.compare:
        label, sep, path = c.partition("=")
        if not sep or not label or not path:
            print(f"--compare {c}: expected LABEL=PATH", file=sys.stderr)
            return 2
        builds.append((label + ": ", path))
    only = [p.strip() for p in a.only.split(",") if p.strip()]
    results = {}
    for _ in range(a.rounds):
        for shape in SHAPES:
            for base_name, args in configs(shape):
                if only and not any(p in base_name for p in only):
                    continue
                for prefix, binary in builds:
                    name = prefix + base_name
                    cmd = [binary, "demo", "--json", "--steps", str(a.steps)] + args
                    run = subprocess.run(cmd, capture_output=True, text=True)
                    report = json.loads(run.stdout)
                    if run.returncode != 0 or not report.get("verified"):
                        print(f"{name}: {report.get('error', 'did not verify')}", file=sys.stderr)
                        return 1
                    r = results.setdefault(name, {"args": " ".join(args), "gbps": [],
                                                  "copy_limit_ratio": [], "copy_limit_gbps": [],
                                                  "bytes_moved": 0, "bytes_copied": 0})
                    r["copy_limit_gbps"].append(round(report["copy_limit_gbps"], 2))
                    for st in report["steps"]:
                        r["gbps"].append(round(st["gbps"], 2))
                        r["copy_limit_ratio"].append(round(st["copy_limit_ratio"], 3))
                        r["bytes_moved"] += st["bytes_moved"]
                        r["bytes_copied"] += st["bytes_copied"]
    for r in results.values():
        for key in ("gbps", "copy_limit_ratio"):
            v = sorted(r[key])
            r[key + "_min_median_max"] = [v[0], v[len(v) // 2], v[-1]]
            del r[key]
        r["copied_per_moved"] = round(r["bytes_copied"] / max(r["bytes_moved"], 1), 3)
    print(json.dumps({"rounds": a.rounds, "steps_per_run": a.steps,
                      "baseline": "one layer at a time: eplbx's own synchronous loop before "
                                  "layers overlapped (--layers-in-flight 1)",
                      "limit": "copy_limit_gbps: two threads copying with streaming stores, "
                               "measured in each run",
                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
