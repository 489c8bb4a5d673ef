"""vLLM's NIXL EPLB communicator (vLLM 0.33's own NixlEplbCommunicator) against eplbx's
EplbxCommunicator on CUDA tensors, both driven by vLLM's own rearrangement loop, every row
checked, in the same run (issue 34, item 4: what a GPU user of vLLM runs, since vLLM picks its
NIXL communicator whenever `nixl` is importable).

    python3 bench/python/bench_vllm_nixl.py --vllm-files DIR --nixl DIR [--json]
    python3 bench/python/bench_vllm_nixl.py --vllm-files DIR --nixl DIR --check --device cpu

scripts/test-gpu.sh runs it on the lent GPU machine; `scripts/test-gpu.sh --fetch` prepares
both directories here (bench/python/gpu_carry.py): DIR of --vllm-files holds vLLM's
vllm/distributed/eplb/ files (eplb_communicator.py, rebalance_execute.py, eplb_utils.py,
migration_scheduler.py) and vllm/distributed/nixl_utils.py, unchanged from the vLLM wheel on
PyPI; bench/python/vllm_stub/ supplies the few names they import from the rest of vLLM (a
logger, the platform, the pipeline group, type names); --nixl is NIXL 1.5.1 from PyPI (`nixl`
and its CUDA backends), trimmed to what a UCX agent loads. Without either, or without a GPU
(and no --device cpu), it prints why and exits 0.

Ranks are processes (4), all on GPU 0 when the machine has one GPU (rank % GPUs otherwise),
joined by a gloo group (vLLM's CPU group). Each holds `layers` MoE layers of three tensors
per expert (8, 2 and 1 MiB rows) and vLLM's one-layer buffer; each rearrangement moves the
weights from one random placement to the next; every row of every layer on every rank is
checked after each (untimed). Configurations, interleaved, the first round a warm-up:
- `nixl`: vLLM's NixlEplbCommunicator, built as vLLM's factory builds it for backend "nixl"
  (cpu_group, every layer's weights, the buffer: it registers them with NIXL and exchanges
  base addresses once), driven by vLLM's `rearrange_expert_weights_inplace`: per layer
  `set_transfer_context`, one NIXL READ per received expert posted from `add_recv`, then
  `execute` (poll every 0.5 ms until done, then an all-reduce so no rank overwrites rows a
  peer still reads), then vLLM's copy from the buffer into the weights.
- `eplbx_vllm_loop`: EplbxCommunicator through the same vLLM loop.
- `eplbx`: EplbxCommunicator.rearrange (what `eplbx.vllm.install()` routes vLLM's call to:
  reads straight into weight rows where safe, the rest through the buffer).
Reported: the median of the slowest rank's time per configuration, each eplbx configuration's
speed against `nixl` (nixl's time / its time; issue 34's target: 1.5x), and the copy-once
floor (the bytes moved at the device-to-device copy rate measured by rank 0 in the same run).
A wrong row after an eplbx configuration fails the run; after `nixl` it is reported
(`nixl_wrong_rows`) and the rows are put right before the next configuration, so one run on
a lent GPU yields both such a finding and the times. (It can happen: outside ROCm, vLLM 0.33
posts a layer's NIXL READs into the buffer without waiting for the device stream that may
still be copying the previous layer out of it.)

--device cpu runs the same code on host tensors (NIXL's memory type switched from VRAM to
DRAM after vLLM's constructor, the only change), which checks the harness, the stubs and the
trimmed NIXL on a machine without a GPU; its times are not a comparison anyone runs.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

from bench_util import (ExpertRows, device_rank, failed_ranks, no_device_reason, placements,
                        report_seconds, spawn)

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = {"world": 4, "layers": 8, "slots": 64, "experts": 48, "mib": [8, 2, 1], "repeats": 5}
CHECK = {"world": 3, "layers": 2, "slots": 12, "experts": 8, "mib": [0.25, 0.0625, 0.03125],
         "repeats": 1}
NAMES = ["nixl", "eplbx_vllm_loop", "eplbx"]
VLLM_NEEDS = ["vllm/distributed/eplb/eplb_communicator.py",
              "vllm/distributed/eplb/rebalance_execute.py", "vllm/distributed/nixl_utils.py"]


def shim(vllm_files, into):
    """A `vllm` package in `into`: the stubs, then vLLM's real files over them (a real file
    never shadows a stub: they name different modules)."""
    dst = os.path.join(into, "vllm")
    shutil.copytree(os.path.join(HERE, "vllm_stub", "vllm"), dst)
    src = os.path.join(vllm_files, "vllm")
    for root, _, files in os.walk(src):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), src)
            if os.path.exists(os.path.join(dst, rel)):
                raise RuntimeError(f"vLLM's {rel} would replace a stub of the same name")
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(os.path.join(root, f), os.path.join(dst, rel))
    return into


def worker(rank, world, port, cfg, device_kind, paths, results):
    try:
        # What NIXL, UCX and torch print goes to stderr (the parent's stdout carries the JSON).
        sys.stdout.flush()
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        sys.path[:0] = paths
        import numpy as np
        import torch
        import torch.distributed as dist

        device, group = device_rank(rank, world, port, device_kind)
        # vLLM's own code (its import of nixl._api picks the backend by torch's CUDA version).
        from vllm.distributed.eplb import rebalance_execute
        from vllm.distributed.eplb.eplb_communicator import NixlEplbCommunicator

        from eplbx.vllm import EplbxCommunicator

        rows = cfg["slots"] // world
        elems = [int(m * (1 << 20)) // 4 for m in cfg["mib"]]
        rounds = cfg["repeats"] + 1  # the first is a warm-up
        maps = [np.array(placements(200 + i, cfg["layers"], cfg["slots"], cfg["experts"]),
                         dtype=np.int64) for i in range(rounds * len(NAMES) + 1)]
        rig = ExpertRows(rank, rows, cfg["layers"], elems, device, maps[0])
        weights, buffer, wrong = rig.weights, rig.buffer, rig.wrong

        # As vLLM's factory builds them (create_eplb_communicator, backend "nixl"; eplbx's
        # factory hands EplbxCommunicator the same three arguments).
        nixl = NixlEplbCommunicator(cpu_group=group, all_expert_weights=weights,
                                    expert_buffer=buffer)
        if device_kind == "cpu":
            nixl._nixl_memory_type = "DRAM"  # the host check only (see the docstring)
        eplbx_comm = EplbxCommunicator(group, weights, buffer, timeout_s=120.0)
        comms = {"nixl": nixl, "eplbx_vllm_loop": eplbx_comm}

        def sync():
            if device_kind == "cuda":
                torch.cuda.synchronize()

        copy_gbps = None
        if rank == 0 and device_kind == "cuda":
            a = torch.empty(256 << 20, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            b.copy_(a)
            sync()
            rates = []
            for _ in range(9):
                t0 = time.perf_counter()
                b.copy_(a)
                sync()
                rates.append(a.numel() / (time.perf_counter() - t0) / 1e9)
            copy_gbps = statistics.median(rates)
            del a, b
        times = {n: [] for n in NAMES}
        baseline_wrong = []  # vLLM's NIXL communicator's wrong rows, if any (a finding)
        step = 0
        for rnd in range(rounds):
            for name in NAMES:  # interleaved
                old, new = maps[step], maps[step + 1]
                step += 1
                sync()
                dist.barrier(group=group)
                t0 = time.perf_counter()
                if name == "eplbx":
                    eplbx_comm.rearrange(old, new, weights, buffer)
                else:
                    rebalance_execute.rearrange_expert_weights_inplace(
                        torch.from_numpy(old), torch.from_numpy(new), weights, buffer, group,
                        comms[name])
                sync()
                dist.barrier(group=group)
                elapsed = time.perf_counter() - t0
                bad = wrong(new)
                if bad and name != "nixl":
                    results.put((rank, ("wrong", f"{name}, round {rnd}: {bad}")))
                    return
                if bad:  # the baseline's rows: reported, then put right for the next one
                    baseline_wrong.append(f"round {rnd}: {bad}")
                    rig.fill(new)
                if rnd > 0:
                    times[name].append(elapsed)
        moved = 0  # experts each rank receives from another rank, over every timed round
        for i in range(len(NAMES), len(maps) - 1):
            old, new = maps[i], maps[i + 1]
            for layer in range(cfg["layers"]):
                for r in range(world):
                    held = set(old[layer][r * rows:(r + 1) * rows].tolist())
                    moved += len({int(e) for e in new[layer][r * rows:(r + 1) * rows]
                                  if int(e) not in held})
        results.put((rank, ("ok", {"times": times, "copy_gbps": copy_gbps,
                                   "nixl_wrong": baseline_wrong,
                                   "experts_moved_per_rearrangement":
                                   moved / (len(maps) - 1 - len(NAMES))})))
    except Exception:  # noqa: BLE001 - reported to the parent
        results.put((rank, ("crash", traceback.format_exc())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-files", default=os.path.join(HERE, "..", "..", ".cache", "gpu-vllm"))
    ap.add_argument("--nixl", default=os.path.join(HERE, "..", "..", "build-gpu", "nixl"),
                    help="NIXL's packages, unpacked (scripts/test-gpu.sh puts them here)")
    ap.add_argument("--check", action="store_true", help="small sizes, one round, rows checked")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    def skip(why):
        print(json.dumps({"skipped": why}) if args.json else f"bench_vllm_nixl: {why}; nothing measured")
        return 0

    missing = [f for f in VLLM_NEEDS if not os.path.exists(os.path.join(args.vllm_files, f))]
    if missing:
        return skip(f"no vLLM files in {args.vllm_files} ({', '.join(missing)} missing; "
                    "scripts/test-gpu.sh --fetch makes them)")
    if not os.path.isdir(os.path.join(args.nixl, "nixl")):
        return skip(f"no NIXL in {args.nixl} (bench/python/gpu_carry.py unpack "
                    ".cache/gpu-nixl.tar.xz DIR; scripts/test-gpu.sh --fetch makes the archive)")
    why = no_device_reason(args.device)
    if why:
        return skip(why)
    with open(os.path.join(args.vllm_files, "VERSION")) as f:
        vllm_version = f.read().strip()
    cfg = dict(CHECK if args.check else BENCH)
    with tempfile.TemporaryDirectory(prefix="eplbx-vllm-shim-") as tmp:
        paths = [shim(args.vllm_files, tmp), os.path.abspath(args.nixl)]
        out = spawn(worker, cfg["world"], cfg, args.device, paths, timeout=180)
    failed = failed_ranks(out, cfg["world"])
    if failed:
        print(f"bench_vllm_nixl: FAILED: {failed}", file=sys.stderr)
        return 1
    row_bytes = sum(int(m * (1 << 20)) // 4 * 4 for m in cfg["mib"])
    moved = out[0][1]["experts_moved_per_rearrangement"] * row_bytes
    result = {"device": args.device, "vllm": vllm_version, "world": cfg["world"],
              "layers": cfg["layers"], "slots": cfg["slots"], "experts": cfg["experts"],
              "row_mib": cfg["mib"], "repeats": cfg["repeats"],
              "bytes_moved_per_rearrangement": moved,
              "baseline": "nixl: vLLM's own NixlEplbCommunicator (vllm/distributed/eplb, from "
                          f"the vLLM {vllm_version} wheel) on NIXL 1.5.1 from PyPI, driven by "
                          "vLLM's own rearrange_expert_weights_inplace"}
    # Wrong rows left by vLLM's NIXL communicator (its READs land outside the device stream
    # that copies the buffer out): reported per rank, its times kept; eplbx's fail the run.
    result["nixl_wrong_rows"] = {r: out[r][1]["nixl_wrong"] for r in out if out[r][1]["nixl_wrong"]}
    if result["nixl_wrong_rows"]:
        print(f"bench_vllm_nixl: vLLM's NIXL communicator left wrong rows: "
              f"{result['nixl_wrong_rows']}", file=sys.stderr)
    if args.device == "cuda":
        import torch
        result["gpu"] = torch.cuda.get_device_name(0)
        result["gpus"] = torch.cuda.device_count()
        result["torch_cuda"] = torch.version.cuda
        gbps = out[0][1]["copy_gbps"]
        result["device_copy_gbps"] = gbps
        result["copy_once_floor_s"] = moved / (gbps * 1e9) if gbps else None
    report_seconds(result, out, NAMES, cfg["repeats"], "nixl", "speed_vs_nixl", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
