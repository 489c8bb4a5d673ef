"""EplbxCommunicator on CUDA tensors beside vLLM's gloo baseline for device tensors, driven
the way vLLM's EPLB drives a communicator.

    PYTHONPATH=build/python python3 bench/python/bench_cuda_communicator.py [--json]
    PYTHONPATH=build/python python3 bench/python/bench_cuda_communicator.py --check [--device cpu]

Needs a GPU (without one it prints "no CUDA device (...)" and exits 0); scripts/test-gpu.sh
runs it on the lent H200. `--device cpu` runs the same code on host tensors, which checks the
bench itself on a machine without a GPU.

Ranks are processes (4 by default), all on GPU 0 when the machine has one GPU (rank % GPUs
otherwise), joined by a gloo group. Each holds `layers` MoE layers of three tensors per
expert (8, 2 and 1 MiB rows) and a one-layer buffer; every rearrangement moves the weights
from one random placement to the next; every row of every layer on every rank is checked
afterwards.

Communicators, as vLLM would use them on these tensors:
- `torch_gloo_staged`: a faithful reimplementation of vLLM 0.33's
  TorchDistGlooStagedEplbCommunicator (vllm/distributed/eplb/eplb_communicator.py; vLLM
  cannot be installed on the GPU machine): add_send / add_recv queue the tensors; execute()
  copies each sent row to the host (`.to("cpu", non_blocking=True)` on the engine's stream),
  receives into pinned host tensors, synchronises the stream, runs gloo `batch_isend_irecv`
  on the CPU group, waits for every request, then copies each received row into its buffer
  row (`copy_(non_blocking=True)` on the stream). As in vLLM's synchronous mode (its
  default) no stream is set: the current stream serves, and vLLM's loop copies the buffer
  into the weights on that same stream afterwards. vLLM picks it for device tensors when NCCL
  cannot run (several ranks on one GPU, as here: NCCL refuses two ranks on one device).
- `eplbx_loop`: EplbxCommunicator through vLLM's own loop (local copies into the buffer,
  add_send / add_recv / execute per layer, then the buffer copied into the weights).
- `eplbx`: EplbxCommunicator.rearrange (reads straight into the weight rows where safe).
Both loops drive the same transfers (eplbx.migrate's list: the source row and destination
row per expert), so the communicators, not the planners, are compared.
"""
import argparse
import json
import sys
import time
import traceback

from bench_util import (ExpertRows, device_rank, failed_ranks, no_device_reason, placements,
                        report_seconds, spawn)

BENCH = {"world": 4, "layers": 8, "slots": 64, "experts": 48, "mib": [8, 2, 1], "repeats": 3}
CHECK = {"world": 3, "layers": 2, "slots": 12, "experts": 8, "mib": [0.25, 0.0625, 0.03125],
         "repeats": 1}
NAMES = ["torch_gloo_staged", "eplbx_loop", "eplbx"]


class GlooStaged:
    """vLLM 0.33's TorchDistGlooStagedEplbCommunicator, reimplemented from its code."""

    def __init__(self, cpu_group, stream, device):
        self._group, self._stream, self._ops = cpu_group, stream, []
        self._pin = device.startswith("cuda")

    def add_send(self, tensors, dst_rank, expert_id):
        for t in tensors:
            self._ops.append(("send", t, dst_rank))

    def add_recv(self, tensors, src_rank, expert_id):
        for t in tensors:
            self._ops.append(("recv", t, src_rank))

    def execute(self):
        import torch
        import torch.distributed as dist

        if not self._ops:
            return
        ops, staging = [], []
        with torch.cuda.stream(self._stream) if self._stream is not None else _null():
            for op, t, peer in self._ops:
                if op == "send":
                    ops.append(_p2p(dist.isend, t.to(device="cpu", non_blocking=True),
                                    self._group, peer))
                    continue
                cpu = torch.empty_like(t, device="cpu", pin_memory=self._pin)
                ops.append(_p2p(dist.irecv, cpu, self._group, peer))
                staging.append((t, cpu))
        self._ops.clear()
        if self._stream is not None:
            self._stream.synchronize()
        elif self._pin:
            torch.cuda.current_stream().synchronize()
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        with torch.cuda.stream(self._stream) if self._stream is not None else _null():
            for dst, cpu in staging:
                dst.copy_(cpu, non_blocking=True)


def _p2p(op, tensor, group, peer):
    import torch.distributed as dist

    try:
        return dist.P2POp(op, tensor, group=group, group_peer=peer)  # torch 2.x, as vLLM
    except TypeError:  # torch 1.13 (the --device cpu check here): global rank, the same here
        return dist.P2POp(op, tensor, peer=peer, group=group)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def vllm_loop(comm, me, rows, old, new, plan, weights, buffer, set_context):
    """vLLM's per-layer pattern: local copies into the buffer, the communicator (sends from
    the old weight rows, receives into buffer rows), then the buffer into the weights."""
    import numpy as np

    for layer in range(len(weights)):
        if np.array_equal(old[layer], new[layer]):
            continue
        o = old[layer]
        transfers = [tuple(int(x) for x in t[:5]) for t in plan["layers"][layer]["transfers"]]
        copies = [tuple(int(x) for x in c) for c in plan["layers"][layer]["local_copies"]
                  if int(c[0]) == me]
        if set_context:
            comm.set_transfer_context(o, layer)
        filled = []
        for _, s_row, d_row, _, from_new in copies:
            if not from_new:
                for w, b in zip(weights[layer], buffer):
                    b[d_row].copy_(w[s_row])
                filled.append(d_row)
        for src, _, dst, row, expert in transfers:
            if src == me:
                first = int(np.flatnonzero(o[me * rows:(me + 1) * rows] == expert)[0])
                comm.add_send([w[first] for w in weights[layer]], dst, expert)
            elif dst == me:
                comm.add_recv([b[row] for b in buffer], src, expert)
                filled.append(row)
        comm.execute()
        for d_row in filled:
            for w, b in zip(weights[layer], buffer):
                w[d_row].copy_(b[d_row])
        for _, s_row, d_row, _, from_new in copies:
            if from_new:
                for w in weights[layer]:
                    w[d_row].copy_(w[s_row])


def worker(rank, world, port, cfg, device_kind, results):
    try:
        import numpy as np
        import torch
        import torch.distributed as dist

        import eplbx
        from eplbx.vllm import EplbxCommunicator

        device, group = device_rank(rank, world, port, device_kind)
        rows = cfg["slots"] // world
        elems = [int(m * (1 << 20)) // 4 for m in cfg["mib"]]
        maps = [np.array(placements(100 + i, cfg["layers"], cfg["slots"], cfg["experts"]),
                         dtype=np.int32) for i in range(cfg["repeats"] * len(NAMES) + 1)]
        rig = ExpertRows(rank, rows, cfg["layers"], elems, device, maps[0])
        weights, buffer = rig.weights, rig.buffer
        # vLLM's synchronous mode (its default): the communicators get no stream, so every
        # copy runs on the current stream, ordered with the loop's own copies.
        comms = {"torch_gloo_staged": GlooStaged(group, None, device)}
        eplbx_comm = EplbxCommunicator(group, weights, buffer, timeout_s=120.0)
        comms["eplbx_loop"] = comms["eplbx"] = eplbx_comm
        transfers = 0
        times = {n: [] for n in NAMES}
        step = 0
        for _ in range(cfg["repeats"]):
            for name in NAMES:
                old, new = maps[step], maps[step + 1]
                step += 1
                plan = eplbx.migrate(old, new, ranks=world)
                transfers = int(plan["remote_transfers"])
                if device_kind == "cuda":
                    torch.cuda.synchronize()
                dist.barrier(group=group)
                t0 = time.perf_counter()
                if name == "eplbx":
                    eplbx_comm.rearrange(old, new, weights, buffer)
                else:
                    vllm_loop(comms[name], rank, rows, old, new, plan, weights, buffer,
                              set_context=name.startswith("eplbx"))
                if device_kind == "cuda":
                    torch.cuda.synchronize()
                dist.barrier(group=group)
                times[name].append(time.perf_counter() - t0)
                bad = rig.wrong(new)
                if bad:
                    results.put((rank, ("wrong", f"{name}: {bad}")))
                    return
        results.put((rank, ("ok", {"times": times, "transfers": transfers})))
    except Exception:  # noqa: BLE001 - reported to the parent
        results.put((rank, ("crash", traceback.format_exc())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="small sizes, one round, rows checked")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    why = no_device_reason(args.device)
    if why:
        print(json.dumps({"skipped": why}) if args.json
              else f"bench_cuda_communicator: {why}; nothing measured")
        return 0
    cfg = dict(CHECK if args.check else BENCH)
    out = spawn(worker, cfg["world"], cfg, args.device, timeout=600)
    failed = failed_ranks(out, cfg["world"])
    if failed:
        print(f"bench_cuda_communicator: FAILED: {failed}", file=sys.stderr)
        return 1
    row_bytes = sum(int(m * (1 << 20)) // 4 * 4 for m in cfg["mib"])
    result = {"device": args.device, "world": cfg["world"], "layers": cfg["layers"],
              "slots": cfg["slots"], "experts": cfg["experts"], "row_mib": cfg["mib"],
              "bytes_per_expert": row_bytes, "repeats": cfg["repeats"],
              "bytes_moved_last": out[0][1]["transfers"] * row_bytes,
              "baseline": "torch_gloo_staged: vLLM 0.33 TorchDistGlooStagedEplbCommunicator, "
                          "reimplemented (host staging, gloo batch_isend_irecv)"}
    if args.device == "cuda":
        import torch
        result["gpu"] = torch.cuda.get_device_name(0)
        result["gpus"] = torch.cuda.device_count()
    report_seconds(result, out, NAMES, cfg["repeats"], "torch_gloo_staged",
                   "speedup_vs_torch_gloo_staged", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
