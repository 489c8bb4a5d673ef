"""SGLang's own expert-weight update (sglang.srt.eplb.expert_location_updater, from the
installed SGLang package) against the same entry point after `eplbx.sglang.install()`, on the
same ranks, shapes and placements, interleaved in one run, every row checked.

    PYTHONPATH=build/python .cache/sglang-venv/bin/python bench/python/bench_sglang_update.py [--json]
    PYTHONPATH=build/python .cache/sglang-venv/bin/python bench/python/bench_sglang_update.py --check

Needs an interpreter with SGLang installed (scripts/sglang-env.sh makes one); without SGLang it
prints why and exits 0. Each rank process initialises torch.distributed over gloo (host
tensors; SGLang's updater sends with batch_isend_irecv on the default group, as it does with
NCCL on GPUs), builds SGLang's own ExpertLocationMetadata for the placement in force and sets
it as SGLang's global metadata, then calls `ExpertLocationUpdater().update(weights_of_layer,
new_metadata, update_layer_ids, nnodes, rank)` exactly as SGLang's EPLB manager does:
- `sglang`: as shipped (per expert, P2P ops into a temporary copy of the layer, in chunks of
  SGLang's SGLANG_EPLB_P2P_BATCH_CHUNK_SIZE, then copied into the weights);
- `eplbx`: after eplbx.sglang.install() (one-sided READs straight into the weight rows where
  safe, eplbx.migrate's transfers). `eplbx` times every update including the first, which
  builds the communicator (reported apart as `eplbx_first`).
Per transition both run from the same placement with the same rows (rows are refilled and
the metadata reset between them); the seconds are the slowest rank's time inside update().
Then a dead-rank update: one rank's process exits, SGLang's elastic state
(ElasticEPStateManager, its real class) marks it inactive, and the live ranks update; the
experts only the dead rank held come back as missing and are loaded as SGLang would (here: the
rows filled with their expected content), then every row is checked. The missing lists are
checked against an independent computation (eplbx: experts whose every old holder is dead);
SGLang's own list is reported beside it.

--check: small tensors, 4 ranks, MoE layers 1-3 beside a dense layer 0, several random
transitions, SGLang's canary on (eplbx's side), eplbx's EPLB algorithm through SGLang's own selection, and a
dead-rank update; exits 1 on any wrong row or list.
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

from bench_util import init_gloo, placements, spawn

BENCH = {"world": 8, "moe_layers": [0, 1, 2, 3], "layers": 4, "experts": 256, "slots": 288,
         "shapes": [(512, 1024), (1024, 256), (128,)], "transitions": 3, "dead": 5}
CHECK = {"world": 4, "moe_layers": [1, 2, 3], "layers": 4, "experts": 10, "slots": 16,
         "shapes": [(3, 4), (5,), (2,)], "transitions": 4, "dead": 2}


CANARY = "SGLANG_EXPERT_LOCATION_UPDATER_CANARY"


def value(layer, expert, tensor):
    return float(layer * 1000 + expert * 10 + tensor)


def metadata(torch, phy2log, experts, world):
    """SGLang's own ExpertLocationMetadata for `phy2log` (layers x physical experts), built as
    its _init_raw does (padded logical -> physical map); no dispatch map (not static)."""
    import eplbx.sglang
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    p, l2p, count = eplbx.sglang.replicas_of(phy2log, experts)
    width = p.shape[1]
    padded = torch.full((p.shape[0], experts, width), -1, dtype=torch.int64)
    padded[:, :, :l2p.shape[2]] = torch.from_numpy(l2p)
    p = torch.from_numpy(p)
    return ExpertLocationMetadata(
        physical_to_logical_map=p, physical_to_logical_map_cpu=p.clone(),
        logical_to_all_physical_map=padded, logical_to_all_physical_map_cpu=padded.clone(),
        logical_to_all_physical_map_num_valid=torch.from_numpy(count), ep_size=world,
        logical_to_rank_dispatch_physical_map=None)


def fill(weights, cfg, rank, phy2log, rows_only=None):
    n = cfg["slots"] // cfg["world"]
    for layer, tensors in weights.items():
        for t, w in enumerate(tensors):
            for r in range(n):
                if rows_only is None or (layer, r) in rows_only:
                    w[r].fill_(value(layer, phy2log[layer][rank * n + r], t))


def wrong_rows(torch, weights, cfg, rank, phy2log):
    n = cfg["slots"] // cfg["world"]
    bad = []
    for layer, tensors in weights.items():
        for t, w in enumerate(tensors):
            want = torch.tensor([value(layer, phy2log[layer][rank * n + r], t) for r in range(n)],
                                dtype=w.dtype)
            ok = (w.reshape(n, -1) == want[:, None]).all(dim=1)
            bad += [(layer, t, r) for r in range(n) if not bool(ok[r])]
    return bad


def expected_missing(old, new, cfg, rank, dead):
    """Independently: per MoE layer, the experts this rank needs that it did not hold and whose
    every old holder is the dead rank (each once, in row order)."""
    n = cfg["slots"] // cfg["world"]
    out = {}
    for layer in cfg["moe_layers"]:
        holders = {}
        for slot, e in enumerate(old[layer]):
            holders.setdefault(e, set()).add(slot // n)
        need = []
        for r in range(n):
            e = new[layer][rank * n + r]
            if rank not in holders.get(e, set()) and holders.get(e, set()) <= {dead} and e not in need:
                need.append(e)
        if need:
            out[layer] = need
    return out


def sequence(cfg, seed):
    """Placements for every layer (dense layers too: SGLang's maps cover every layer)."""
    return [placements(seed * 100 + i, cfg["layers"], cfg["slots"], cfg["experts"])
            for i in range(cfg["transitions"] + 2)]


def worker(rank, world, port, cfg, seed, results):
    out = {"rank": rank, "errors": []}
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        init_gloo(port, rank, world)
        import eplbx.sglang
        from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
        from sglang.srt.eplb import expert_location as el
        from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

        dead = cfg["dead"]
        live_group = dist.new_group([r for r in range(world) if r != dead])  # all ranks, before
        maps = sequence(cfg, seed)
        n = cfg["slots"] // world
        weights = {layer: [torch.empty((n,) + tuple(s), dtype=torch.float32) for s in cfg["shapes"]]
                   for layer in cfg["moe_layers"]}
        updater = ExpertLocationUpdater()
        times = {"sglang": [], "eplbx": []}
        first = None

        def run(kind, old, new, group=None):
            """One update through SGLang's entry point; returns (seconds, missing)."""
            (eplbx.sglang.install if kind == "eplbx" else eplbx.sglang.uninstall)()
            # SGLang's canary on eplbx's side only: SGLang's own needs its full runtime context
            # (a published device), which these bare rank processes do not have.
            os.environ[CANARY] = "1" if kind == "eplbx" and cfg.get("canary") else "0"
            fill(weights, cfg, rank, old)
            el.set_global_expert_location_metadata(metadata(torch, old, cfg["experts"], world),
                                                   allow_overwrite=True)
            target = metadata(torch, new, cfg["experts"], world)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            missing = updater.update(weights, target, update_layer_ids=list(cfg["moe_layers"]),
                                     nnodes=1, rank=rank)
            seconds = time.perf_counter() - t0
            dist.barrier(group=group)
            got = el.get_global_expert_location_metadata().physical_to_logical_map_cpu.tolist()
            want = [list(new[i] if i in cfg["moe_layers"] else old[i]) for i in range(len(new))]
            if got != want:
                out["errors"].append(f"{kind}: SGLang's global metadata is not the new map on the "
                                     "updated layers and the old one elsewhere")
            return seconds, missing

        for i in range(cfg["transitions"]):
            old, new = maps[i], maps[i + 1]
            for kind in ("sglang", "eplbx") if i % 2 == 0 else ("eplbx", "sglang"):
                seconds, missing = run(kind, old, new)
                if missing:
                    out["errors"].append(f"{kind}: transition {i} reported missing experts {missing}")
                bad = wrong_rows(torch, weights, cfg, rank, new)
                if bad:
                    out["errors"].append(f"{kind}: transition {i}: {len(bad)} wrong rows, first {bad[:3]}")
                if kind == "eplbx":
                    out.setdefault("eplbx_bytes", []).append(eplbx.sglang._MOVER.last_update["bytes_received"])
                if kind == "eplbx" and first is None:
                    first = seconds
                    out["eplbx_first_stats"] = dict(eplbx.sglang._MOVER.last_update)
                else:
                    times[kind].append(seconds)
        out["times"] = times
        out["eplbx_first"] = first
        out["eplbx_stats"] = eplbx.sglang._MOVER.last_update if eplbx.sglang._MOVER else None

        if cfg.get("algorithm"):
            eplbx.sglang.install()
            out["errors"] += check_algorithm(torch, cfg, maps[cfg["transitions"]])

        # A dead rank: its process goes; the live ranks update without it.
        dist.barrier()
        if rank == dead:
            out["dead"] = True
            results.put((rank, out))
            results.close()
            results.join_thread()  # the report is out before the process goes
            os._exit(0)
        time.sleep(0.5)
        state = ElasticEPStateManager._build_state(ep_size=world, device=torch.device("cpu"))
        state.active_ranks[dead] = 0
        state.sync_active_to_cpu()
        ElasticEPStateManager._instance = state
        old, new = maps[cfg["transitions"]], maps[cfg["transitions"] + 1]
        want = expected_missing(old, new, cfg, rank, dead)
        out["missing_expected"] = sum(len(v) for v in want.values())
        for kind in ("sglang", "eplbx"):
            seconds, missing = run(kind, old, new, group=live_group)
            missing = {int(k): [int(e) for e in v] for k, v in missing.items()}
            out[f"dead_{kind}_seconds"] = seconds
            out[f"dead_{kind}_missing"] = sum(len(v) for v in missing.values())
            # What SGLang does next: load the missing experts' rows (from its backup or disk).
            reload = {(layer, r) for layer, ids in missing.items() for r in range(n)
                      if new[layer][rank * n + r] in ids}
            fill(weights, cfg, rank, new, rows_only=reload)
            bad = wrong_rows(torch, weights, cfg, rank, new)
            if kind == "eplbx":
                if missing != want:
                    out["errors"].append(f"eplbx: dead rank {dead}: missing {missing}, expected {want}")
                if bad:
                    out["errors"].append(f"eplbx: dead-rank update: {len(bad)} wrong rows, first {bad[:3]}")
            else:
                out["dead_sglang_wrong_rows"] = len(bad)
        results.put((rank, out))
    except Exception:  # noqa: BLE001
        out["errors"].append(traceback.format_exc())
        results.put((rank, out))


def check_algorithm(torch, cfg, in_force):
    """eplbx's placement through SGLang's own algorithm selection (--eplb-algorithm eplbx):
    compute_algorithm then rebalance_experts as ExpertLocationMetadata.init_by_eplb calls
    them; the result is a valid SGLang placement, and with the incremental policy experts
    that stay keep their slots."""
    from sglang.srt.eplb import eplb_algorithms

    errors = []
    n = cfg["slots"] // cfg["world"]
    tokens = torch.rand((2, cfg["layers"], cfg["experts"]), generator=torch.Generator().manual_seed(7))
    for name in ("eplbx", "eplbx_balanced"):
        algorithm = eplb_algorithms.compute_algorithm(raw_algorithm=name, num_groups=None, num_nodes=1)
        p, l2p, count = eplb_algorithms.rebalance_experts(
            tokens_per_expert=tokens, num_physical_experts=cfg["slots"], num_local_physical_experts=n,
            num_groups=None, num_nodes=1, algorithm=algorithm)
        if tuple(p.shape) != (cfg["layers"], cfg["slots"]) or int(count.sum()) != cfg["layers"] * cfg["slots"]:
            errors.append(f"{name}: shapes {tuple(p.shape)}, {int(count.sum())} replicas")
            continue
        for layer in range(cfg["layers"]):
            if sorted(set(p[layer].tolist())) != list(range(cfg["experts"])):
                errors.append(f"{name}: layer {layer} does not place every expert")
            for e in range(cfg["experts"]):
                slots = [s for s in l2p[layer, e].tolist() if s >= 0]
                if sorted(slots) != [s for s in range(cfg["slots"]) if p[layer, s] == e]:
                    errors.append(f"{name}: layer {layer} expert {e}: logical_to_all_physical {slots}")
        if name == "eplbx":
            kept = sum(int(p[layer, s]) == in_force[layer][s] for layer in range(cfg["layers"])
                       for s in range(cfg["slots"]))
            if kept == 0:
                errors.append("eplbx: the incremental placement kept no slot of the placement in force")
    default = eplb_algorithms.compute_algorithm(raw_algorithm="auto", num_groups=None, num_nodes=1)
    if default.name != "deepseek":
        errors.append(f"SGLang's own selection changed: auto -> {default}")
    return errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--world", type=int)
    parser.add_argument("--transitions", type=int)
    args = parser.parse_args()
    try:
        import sglang  # noqa: F401
        from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"SKIP: SGLang is not importable by {sys.executable} ({type(e).__name__}: {e}); "
              "scripts/sglang-env.sh makes an environment with it")
        return 0
    import eplbx
    import eplbx.sglang

    version = eplbx.sglang.install()
    eplbx.sglang.uninstall()
    cfg = dict(CHECK if args.check else BENCH)
    # The physical limit: this machine's copy rate (two threads, streaming stores), measured now.
    limit_gbps = None if args.check else eplbx._eplbx._copy_limit_gbps(2)
    if args.check:
        cfg["algorithm"] = cfg["canary"] = True
    for k in ("world", "transitions"):
        if getattr(args, k):
            cfg[k] = getattr(args, k)
    t0 = time.perf_counter()
    got = spawn(worker, cfg["world"], cfg, 1, timeout=1800)
    errors = [f"rank {r}: {e}" for r, o in sorted(got.items()) for e in o["errors"]]
    if len(got) != cfg["world"]:
        errors.append(f"only ranks {sorted(got)} reported")
    live = [o for o in got.values() if "times" in o and not o.get("dead")]
    report = {"sglang_version": version, "world": cfg["world"], "moe_layers": len(cfg["moe_layers"]),
              "experts": cfg["experts"], "slots": cfg["slots"],
              "bytes_per_expert": sum(4 * __import__("math").prod(s) for s in cfg["shapes"]),
              "transitions": cfg["transitions"], "errors": errors, "wall_s": time.perf_counter() - t0}
    if live:
        def slowest(kind):  # per transition, the slowest rank
            return [max(o["times"][kind][i] for o in live) for i in range(len(live[0]["times"][kind]))]
        s, x = slowest("sglang"), slowest("eplbx")
        report.update({
            "sglang_s": s, "eplbx_s": x, "eplbx_first_s": max(o["eplbx_first"] for o in live),
            "eplbx_first_build_s": max(o["eplbx_first_stats"]["build_seconds"] for o in live),
            "eplbx_first_move_s": max(o["eplbx_first_stats"]["seconds"] for o in live),
            "sglang_median_s": statistics.median(s), "eplbx_median_s": statistics.median(x) if x else None,
            "speedup": statistics.median(s) / statistics.median(x) if x else None,
            "dead_rank": cfg["dead"],
            "dead_sglang_s": max(o.get("dead_sglang_seconds", 0) for o in live),
            "dead_eplbx_s": max(o.get("dead_eplbx_seconds", 0) for o in live),
            "dead_missing_expected": sum(o.get("missing_expected", 0) for o in live),
            "dead_missing_eplbx": sum(o.get("dead_eplbx_missing", 0) for o in live),
            "dead_missing_sglang": sum(o.get("dead_sglang_missing", 0) for o in live),
            "dead_sglang_wrong_rows": sum(o.get("dead_sglang_wrong_rows", 0) for o in live),
            "eplbx_last_update": live[0].get("eplbx_stats"),
        })
        moved = [sum(o["eplbx_bytes"][i] for o in live) for i in range(len(live[0]["eplbx_bytes"]))]
        report["bytes_moved_per_update"] = moved
        if limit_gbps:
            # Every moved byte copied once at the copy limit: no implementation beats it.
            report["copy_limit_gbps"] = limit_gbps
            report["copy_once_floor_s"] = statistics.median(moved) / (limit_gbps * 1e9)
        if report["speedup"] is not None:
            report["end_to_end_speedup_first_included"] = (
                sum(s) / (sum(x) + report["eplbx_first_s"]) * (len(x) + 1) / len(s))
    if args.json or args.check:
        print(json.dumps(report, indent=1))
    else:
        print(f"SGLang {version}: {cfg['world']} ranks; sglang {report.get('sglang_median_s')} s, "
              f"eplbx {report.get('eplbx_median_s')} s; errors: {errors}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
