"""eplbx's placement as vLLM's EPLB policy ("eplbx", incremental; "eplbx_balanced") beside
vLLM's own DefaultEplbPolicy, on drifting load, in the same run; prints JSON.

    PYTHONPATH=build/python /usr/bin/python3 bench/python/bench_vllm_policy.py [--json]
        [--vllm-wheel PATH | --vllm-src DIR] [--layers 12] [--rebalances 12] [--seed 1]
        [--trace FILE --window STEPS]     # a trace from `eplbx trace synth`

The baseline is vLLM's real code from its PyPI package: DefaultEplbPolicy from the installed
vLLM when it imports, else the policy files (vllm/distributed/eplb/policy/{abstract,default}.py,
which import only numpy and torch) loaded from a vLLM wheel (`--vllm-wheel`, or
.cache/vllm-0.33.0-*.whl, which `pip download --no-deps vllm==0.33.0 -d .cache` makes) or a
directory holding `vllm/` (`--vllm-src`). vLLM's default policy: DeepSeek's hierarchical
packing from scratch every time, then `preserve_intragpu_slots` (an expert that stays on a
GPU keeps its slot). Both policies get exactly what vLLM's EplbState passes: the load window
(layers x logical experts), num_replicas, num_groups, num_nodes, num_ranks and the
physical-to-logical map in force.

Scenario (DeepSeek-V3's shape: 256 logical experts -> 288 slots on 32 ranks, 4 nodes, 8
groups): every step's load is a Zipf base whose experts drift (a mean-reverting log-normal
walk, sigma 0.15 per window) with a hot expert moving every few windows. At each rebalance
the policy sees the last window and the map in force; it is scored on the *next* window (what
the new placement actually serves):
  copies: (rank, expert) pairs a rank must read from another rank (the weights moved);
  balancedness: sum over layers of mean rank load / sum of max rank load (1 = perfect),
  each expert's load split evenly over its replicas.
"""
import argparse
import glob
import importlib.util
import json
import os
import sys
import tempfile
import time
import zipfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY_FILES = ("vllm/distributed/eplb/policy/abstract.py", "vllm/distributed/eplb/policy/default.py")


def load_default_policy(wheel, src):
    """vLLM's DefaultEplbPolicy and where it came from."""
    if wheel is None and src is None:
        try:
            from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
            import vllm
            return DefaultEplbPolicy, f"vllm {vllm.__version__} (installed)"
        except Exception:  # noqa: BLE001 - fall back to the wheel's files
            found = sorted(glob.glob(os.path.join(ROOT, ".cache", "vllm-0.33.0-*.whl")))
            wheel = found[-1] if found else None
    if wheel is not None:
        src = tempfile.mkdtemp(prefix="vllm-policy-")
        with zipfile.ZipFile(wheel) as z:
            for name in POLICY_FILES:
                z.extract(name, src)
        where = f"{os.path.basename(wheel)} ({', '.join(POLICY_FILES)})"
    elif src is not None:
        where = f"{src} ({', '.join(POLICY_FILES)})"
    else:
        return None, ("no vLLM: not importable, no .cache/vllm-0.33.0-*.whl (pip download "
                      "--no-deps vllm==0.33.0 -d .cache), no --vllm-wheel / --vllm-src")
    # The two files as a package of their own: default.py imports `.abstract`.
    pkg = "vllm_eplb_policy"
    spec = importlib.util.spec_from_file_location(
        pkg, os.path.join(src, "vllm/distributed/eplb/policy/abstract.py"),
        submodule_search_locations=[])
    package = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = package
    for name in ("abstract", "default"):
        path = os.path.join(src, f"vllm/distributed/eplb/policy/{name}.py")
        s = importlib.util.spec_from_file_location(f"{pkg}.{name}", path)
        module = importlib.util.module_from_spec(s)
        sys.modules[f"{pkg}.{name}"] = module
        s.loader.exec_module(module)
    return sys.modules[f"{pkg}.default"].DefaultEplbPolicy, where


def windows(layers, experts, count, seed):
    """`count` + 1 consecutive load windows (layers x experts) of drifting load."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, experts + 1) ** 0.9
    base = np.stack([rng.permutation(base) for _ in range(layers)]) * 1e5
    drift = np.zeros((layers, experts))
    out = []
    hot = rng.integers(0, experts, size=layers)
    for w in range(count + 1):
        drift = 0.8 * drift + rng.normal(0, 0.15, size=drift.shape)
        if w % 3 == 0:
            hot = rng.integers(0, experts, size=layers)
        load = base * np.exp(drift)
        load[np.arange(layers), hot] *= 4
        out.append(load)
    return out


def trace_windows(path, window):
    """The trace's load summed over consecutive windows of `window` steps (whole ones)."""
    out, acc, n = [], None, 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            load = np.asarray(json.loads(line)["load"], dtype=np.float64)
            acc = load if acc is None else acc + load
            n += 1
            if n == window:
                out.append(acc)
                acc, n = None, 0
    return out


def balancedness(phy2log, load, ranks):
    layers, slots = phy2log.shape
    per_rank = slots // ranks
    mean_sum = max_sum = 0.0
    for layer in range(layers):
        count = np.bincount(phy2log[layer], minlength=load.shape[1])
        share = load[layer] / np.maximum(count, 1)
        rank_load = share[phy2log[layer]].reshape(ranks, per_rank).sum(axis=1)
        mean_sum += rank_load.mean()
        max_sum += rank_load.max()
    return mean_sum / max_sum


def copies(old, new, ranks):
    per_rank = old.shape[1] // ranks
    total = 0
    for layer in range(old.shape[0]):
        for r in range(ranks):
            s = slice(r * per_rank, (r + 1) * per_rank)
            total += len(set(new[layer, s].tolist()) - set(old[layer, s].tolist()))
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--vllm-wheel")
    ap.add_argument("--vllm-src")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rebalances", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trace", help="a load trace (JSON lines, `eplbx trace synth`) instead of "
                                    "the built-in drift; windows of --window steps")
    ap.add_argument("--window", type=int, default=1000)
    a = ap.parse_args()
    import torch

    from eplbx.vllm import rebalance_experts

    default, where = load_default_policy(a.vllm_wheel, a.vllm_src)
    if default is None:
        print(f"SKIPPED: {where}")
        return 0
    experts, replicas, groups, nodes, ranks = 256, 288, 8, 4, 32
    if a.trace:
        loads = trace_windows(a.trace, a.window)
        a.rebalances = len(loads) - 2
        a.layers = loads[0].shape[0]
        if a.rebalances < 1 or loads[0].shape[1] != experts:
            print(f"{a.trace}: {len(loads)} windows of {loads[0].shape} (need 3 or more, {experts} "
                  "experts)", file=sys.stderr)
            return 2
    else:
        loads = windows(a.layers, experts, a.rebalances + 1, a.seed)

    def vllm_default(load, old):
        return default.rebalance_experts(torch.from_numpy(load), replicas, groups, nodes, ranks,
                                         None if old is None else torch.from_numpy(old)).numpy()

    def eplbx(name):
        return lambda load, old: rebalance_experts(load, replicas, groups, nodes, ranks, old,
                                                   policy=name)

    policies = {"vllm_default": vllm_default, "eplbx": eplbx("eplbx"),
                "eplbx_balanced": eplbx("eplbx_balanced")}
    # Every policy starts from vLLM's default plan of the first window.
    start = vllm_default(loads[0], None)
    results = {}
    for name, policy in policies.items():
        in_force = start.copy()
        rows = []
        for w in range(1, a.rebalances + 1):
            t0 = time.perf_counter()
            new = np.asarray(policy(loads[w], in_force), dtype=np.int64)
            seconds = time.perf_counter() - t0
            for layer in new:  # every expert placed, every slot filled
                assert set(layer.tolist()) == set(range(experts)), name
            rows.append({"copies": copies(in_force, new, ranks),
                         "balancedness_next": balancedness(new, loads[w + 1], ranks),
                         "seconds": seconds})
            in_force = new
        results[name] = {
            "copies_per_rebalance": float(np.mean([r["copies"] for r in rows])),
            "balancedness_next_window": float(np.mean([r["balancedness_next"] for r in rows])),
            "plan_ms_p50": float(np.median([r["seconds"] for r in rows]) * 1e3),
        }
    base = results["vllm_default"]
    out = {
        "shape": {"layers": a.layers, "experts": experts, "slots": replicas, "ranks": ranks,
                  "nodes": nodes, "groups": groups},
        "rebalances": a.rebalances, "seed": a.seed, "trace": a.trace, "baseline": where,
        "slots_total_per_rebalance": a.layers * replicas,
        "policies": results,
        "eplbx_copies_ratio": results["eplbx"]["copies_per_rebalance"] / max(base["copies_per_rebalance"], 1e-9),
        "eplbx_balancedness_minus_default": (results["eplbx"]["balancedness_next_window"]
                                             - base["balancedness_next_window"]),
    }
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"baseline: {where}")
        for name, r in results.items():
            print(f"{name:16s} copies/rebalance {r['copies_per_rebalance']:8.1f}  balancedness next "
                  f"window {r['balancedness_next_window']:.4f}  plan {r['plan_ms_p50']:.1f} ms")
        print(f"eplbx / default copies: {out['eplbx_copies_ratio']:.3f}; balancedness "
              f"{out['eplbx_balancedness_minus_default']:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
