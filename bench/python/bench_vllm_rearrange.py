"""vLLM's own EPLB rearrangement (vllm.distributed.eplb.rebalance_execute, from the installed
vLLM package) on eplbx, switched on the way a user does it, beside vLLM's own communicators.

    PYTHONPATH=build/python VENV/bin/python bench/python/bench_vllm_rearrange.py [--json]
    PYTHONPATH=build/python VENV/bin/python bench/python/bench_vllm_rearrange.py --check

Needs an interpreter with vLLM installed (scripts/vllm-env.sh makes one); without vLLM it
prints why and exits 0. Each rank process does what a vLLM worker does: loads vLLM's general
plugins (eplbx's entry point switches "eplbx" on, no direct call), initialises vLLM's
distributed state on CPU (gloo), builds its EPLB communicators with vLLM's factory as vLLM's
EplbState does (`create_eplb_communicator(get_eplb_group(), backend, weights, buffer)`) and
rearranges with vLLM's `rearrange_expert_weights_inplace`: move_to_buffer (local copies into
the buffer, then the communicator), then move_from_buffer (vLLM's copy from the buffer into
the weights). Every row of every layer on every rank is checked after every rearrangement.

The baselines are vLLM's real communicators, as vLLM builds them for host tensors:
`torch_gloo` (TorchDistGlooStagedEplbCommunicator: batch_isend_irecv on the CPU group,
receives into fresh host tensors, then copied into the buffer rows) and `torch_nccl`
(TorchDistNcclEplbCommunicator: batch_isend_irecv straight into the buffer rows; for host
tensors vLLM hands it the CPU group, i.e. gloo). eplbx, as vLLM builds it after
`eplbx.vllm.install()`:
- `eplbx_vllm_loop`: vLLM's own loop through the buffer on EplbxCommunicator (EPLBX_DIRECT=0),
  plain tensors (EPLBX_SHARE_MEMORY=0);
- `eplbx`: EplbxCommunicator.rearrange (reads straight into weight rows where safe), plain
  tensors;
- `eplbx_shared`: the same with the default EPLBX_SHARE_MEMORY=1 (the factory moves the host
  weights to shared memory once, so peers map them).
The ranks run with OMP_NUM_THREADS=1 as vLLM's workers do, on vLLM's CPU platform
(VLLM_TARGET_DEVICE=cpu); vLLM refuses EPLB off the GPU when it validates enable_eplb, so the
flag is set after validation, and torch_gloo's device synchronisation waits for nothing (host
tensors, no device).

--check: 2 layers of small tensors, random placements, every pattern vLLM drives (the whole
rearrangement; layer by layer from a second thread after set_stream, as vLLM's asynchronous
EPLB does; migration batching with several execute() per layer; a name vLLM knows still goes
to vLLM's own factory); exits 1 on any wrong row.
"""
import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import threading
import time
import traceback

from bench_util import placements, spawn

BENCH = {"world": 4, "layers": 8, "slots": 64, "experts": 48, "mib": [8, 2, 1]}
CHECK = {"world": 4, "layers": 2, "slots": 16, "experts": 11, "elems": [48, 16, 5]}


def value(layer, expert, tensor):
    return float(layer * 1000 + expert * 10 + tensor)


class Timed:
    """Calls a function and adds up the seconds spent inside it."""

    def __init__(self, inner, clock=None):
        self.inner, self.clock = inner, clock if clock is not None else self
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.clock.seconds += time.perf_counter() - t0


def timed(comm):
    """Times the communicator's methods in place (the object stays what it is, so vLLM and
    eplbx see their own class); comm.seconds adds up the time inside them."""
    comm.seconds = 0.0
    for name in ("set_transfer_context", "add_send", "add_recv", "execute"):
        setattr(comm, name, Timed(getattr(comm, name), clock=comm))
    return comm


def init_vllm(rank, world, port):
    """What a vLLM worker does before EPLB: plugins, then distributed state (CPU, gloo)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # eplbx's entry point runs eplbx.vllm.install() here
    import torch

    if not torch.accelerator.is_available():
        # torch_gloo synchronises the current device stream before it sends (device tensors
        # are staged to host asynchronously). Host tensors have no device work to wait for; on
        # a machine without a device that call would raise, so here it waits for nothing.
        class _NoDeviceStream:
            def synchronize(self):
                pass
        torch.accelerator.current_stream = lambda *args, **kwargs: _NoDeviceStream()
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (ensure_model_parallel_initialized,
                                                 init_distributed_environment)

    # The EPLB config as a user gives it (a dict, validated by vLLM's pydantic config). vLLM
    # refuses enable_eplb=True off CUDA/ROCm/XPU when it validates, so this host run sets the
    # flag afterwards (vLLM then creates its EPLB process group as on a GPU); the communicator
    # name is validated all the same.
    parallel = ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=True,
                              eplb_config={"communicator": "eplbx"})
    config = VllmConfig(parallel_config=parallel, device_config=DeviceConfig(device="cpu"))
    parallel.enable_eplb = True
    ctx = set_current_vllm_config(config)
    ctx.__enter__()
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    ensure_model_parallel_initialized(world, 1)
    return parallel


def make_tensors(torch, rank, cfg, phy2log, elems):
    rows = cfg["slots"] // cfg["world"]
    weights = []
    for layer in range(cfg["layers"]):
        tensors = []
        for t, n in enumerate(elems):
            w = torch.empty((rows, n), dtype=torch.float32)
            for r in range(rows):
                w[r].fill_(value(layer, phy2log[layer][rank * rows + r], t))
            tensors.append(w)
        weights.append(tensors)
    buffer = [torch.empty_like(w) for w in weights[0]]  # as vLLM's EplbState allocates it
    return weights, buffer


def wrong_rows(torch, rank, cfg, weights, phy2log):
    """Every element of every row against the expert the map says it holds."""
    rows = cfg["slots"] // cfg["world"]
    bad = []
    for layer, tensors in enumerate(weights):
        for t, w in enumerate(tensors):
            want = torch.tensor([value(layer, phy2log[layer][rank * rows + r], t) for r in range(rows)],
                                dtype=w.dtype)
            ok = (w == want[:, None]).all(dim=1)
            bad += [(layer, t, r) for r in range(rows) if not bool(ok[r])]
    return bad


def check_cli():
    """`vllm serve ... --eplb-config '{"communicator": "eplbx"}'`: vLLM's own argument parser
    (it loads the general plugins first) and EngineArgs take the name; an unknown name is still
    refused by vLLM's validation."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--enable-expert-parallel", "--eplb-config", '{"communicator": "eplbx"}'])
        got = AsyncEngineArgs.from_cli_args(args).eplb_config.communicator
        if got != "eplbx":
            return f"--eplb-config communicator eplbx became {got!r}"
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):  # argparse reports and exits
                AsyncEngineArgs.from_cli_args(parser.parse_args(["--eplb-config", '{"communicator": "eplbxx"}']))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - vLLM's validation error
            said = f"{said.getvalue()} {e}"
            if "'eplbx'" not in said:
                return f"an unknown name was refused without listing eplbx: {said}"
            return "ok"
        return "an unknown communicator name was accepted"
    except Exception:  # noqa: BLE001
        return traceback.format_exc()


def check_worker(rank, world, port, results):
    """--check: every call pattern, every row checked."""
    try:
        import numpy as np
        import torch
        from vllm.distributed.eplb import eplb_state
        from vllm.distributed.eplb.rebalance_execute import move_from_buffer, transfer_layer
        from vllm.distributed.parallel_state import get_eplb_group

        import eplbx.vllm

        cfg = dict(CHECK, world=world)
        parallel = init_vllm(rank, world, port)
        assert parallel.eplb_config.communicator == "eplbx", parallel.eplb_config
        group = get_eplb_group()
        maps = [placements(seed, cfg["layers"], cfg["slots"], cfg["experts"]) for seed in range(6)]
        weights, buffer = make_tensors(torch, rank, cfg, maps[0], cfg["elems"])
        # vLLM's EplbState builds its communicator exactly so (eplb_state.create_eplb_communicator).
        comm = eplb_state.create_eplb_communicator(
            group_coordinator=group, backend=parallel.eplb_config.communicator,
            expert_weights=weights, expert_buffer=buffer)
        assert isinstance(comm, eplbx.vllm.EplbxCommunicator), type(comm)
        # Host weights moved to shared memory by default (EPLBX_SHARE_MEMORY), views intact.
        assert all(w.is_shared() for layer in weights for w in layer), "weights not in shared memory"
        other = eplb_state.create_eplb_communicator(group, "torch_gloo", weights, buffer)
        assert type(other).__name__ == "TorchDistGlooStagedEplbCommunicator", type(other)
        failures = []

        def expect(step, phy2log):
            bad = wrong_rows(torch, rank, cfg, weights, phy2log)
            if bad:
                failures.append(f"{step}: {len(bad)} wrong rows, first (layer, tensor, row) {bad[0]}")

        expect("initial", maps[0])
        # 1. The whole rearrangement, synchronous EPLB (vLLM's EplbState calls this function):
        #    eplbx's direct path, then vLLM's own loop through the buffer (EPLBX_DIRECT=0).
        #    The name as EplbState's module holds it (imported before the plugins ran).
        rearrange = eplb_state.rearrange_expert_weights_inplace
        assert hasattr(rearrange, "_eplbx_original"), "vLLM's rearrangement is not routed to eplbx"
        for direct, (old, new) in (("1", (maps[0], maps[1])), ("0", (maps[1], maps[4]))):
            os.environ["EPLBX_DIRECT"] = direct
            rearrange(torch.tensor(old), torch.tensor(new), weights, buffer, group.device_group, comm)
            expect(f"rearrange_expert_weights_inplace, EPLBX_DIRECT={direct}", new)
            if direct == "1" and not (comm.last_rearrange and comm.last_rearrange["layers"] > 0):
                failures.append(f"vLLM's call did not run eplbx's rearrange: {comm.last_rearrange}")
        stats = comm.rearrange(torch.tensor(maps[4]), torch.tensor(maps[1]), weights, buffer)
        expect("EplbxCommunicator.rearrange", maps[1])
        # 2. Asynchronous EPLB: set_stream, then transfer_layer from the worker thread, the
        #    copy out of the buffer (move_from_buffer) on the main thread, layer by layer.
        for batching, (old, new) in ((False, (maps[1], maps[2])), (True, (maps[2], maps[3]))):
            for layer in range(cfg["layers"]):
                out = {}

                def transfer():
                    try:
                        comm.set_stream(None)
                        out["meta"] = transfer_layer(
                            torch.tensor(old[layer]), torch.tensor(new[layer]), weights[layer], buffer,
                            group.device_group, comm, layer_idx=layer,
                            enable_migration_batching=batching)
                    except Exception:  # noqa: BLE001 - reported below
                        out["error"] = traceback.format_exc()
                thread = threading.Thread(target=transfer)
                thread.start()
                thread.join()
                if "error" in out:
                    raise RuntimeError(out["error"])
                move_from_buffer(weights[layer], buffer, out["meta"], np.array(new[layer]), rank)
            expect(f"transfer_layer from a thread (migration batching {batching})", new)
        results.put((rank, "; ".join(failures) if failures else f"ok, direct rows {stats['direct_rows']}, "
                     f"through the buffer {stats['buffered_rows']}, local copies {stats['local_copies']}"))
    except Exception:  # noqa: BLE001
        results.put((rank, traceback.format_exc()))


def bench_worker(rank, world, port, repeats, results):
    try:
        import torch
        from vllm.distributed.eplb import eplb_state
        from vllm.distributed.eplb import rebalance_execute
        from vllm.distributed.parallel_state import get_eplb_group

        from eplbx._eplbx import _copy_limit_gbps

        # The engine-side copy out of the buffer into the weights, timed where vLLM calls it
        # (eplbx's direct path, EplbxCommunicator.rearrange, does its own copies inside).
        copy_out = Timed(rebalance_execute.move_from_buffer)
        rebalance_execute.move_from_buffer = copy_out

        cfg = dict(BENCH, world=world)
        init_vllm(rank, world, port)
        group = get_eplb_group()
        elems = [mib * (1 << 20) // 4 for mib in cfg["mib"]]
        a, b = (placements(seed, cfg["layers"], cfg["slots"], cfg["experts"]) for seed in (1, 2))
        # The map in force per set of tensors (the communicators on plain tensors share them).
        sets = {"plain": [make_tensors(torch, rank, cfg, a, elems), a],
                "shared": [make_tensors(torch, rank, cfg, a, elems), a]}
        runs = {}
        for name, backend, tensors, direct in (("torch_gloo", "torch_gloo", "plain", "1"),
                                               ("torch_nccl", "torch_nccl", "plain", "1"),
                                               ("eplbx_vllm_loop", "eplbx", "plain", "0"),
                                               ("eplbx", "eplbx", "plain", "1"),
                                               ("eplbx_shared", "eplbx", "shared", "1")):
            weights, buffer = sets[tensors][0]
            # eplbx moves host tensors to shared memory when vLLM builds it (EPLBX_SHARE_MEMORY,
            # default 1); the plain runs keep them plain, to compare on the same tensors.
            os.environ["EPLBX_SHARE_MEMORY"] = "1" if tensors == "shared" else "0"
            comm = eplb_state.create_eplb_communicator(group, backend, weights, buffer)
            runs[name] = (timed(comm), sets[tensors], direct)
        seconds = {name: [] for name in runs}
        inside = {name: [] for name in runs}
        copying = {name: [] for name in runs}
        cpu = group.cpu_group
        limits = []

        def limit():
            torch.distributed.barrier(group=cpu)
            if rank == 0:
                limits.append(_copy_limit_gbps(2))
            torch.distributed.barrier(group=cpu)

        limit()
        for rep in range(repeats + 1):  # the first is a warm-up
            for name, (comm, state, direct) in runs.items():  # interleaved
                (weights, buffer), old = state
                os.environ["EPLBX_DIRECT"] = direct
                new = b if old is a else a
                torch.distributed.barrier(group=cpu)
                comm.seconds = copy_out.seconds = 0.0
                t0 = time.perf_counter()
                rebalance_execute.rearrange_expert_weights_inplace(torch.tensor(old), torch.tensor(new), weights, buffer,
                                                 group.device_group, comm)
                torch.distributed.barrier(group=cpu)
                elapsed = time.perf_counter() - t0
                state[1] = new
                bad = wrong_rows(torch, rank, cfg, weights, new)  # untimed
                if bad:
                    raise RuntimeError(f"{name}: {len(bad)} wrong rows, first {bad[0]}")
                if rep > 0:
                    seconds[name].append(elapsed)
                    inside[name].append(comm.seconds)
                    copying[name].append(copy_out.seconds)
        limit()
        # Bytes each rank receives from other ranks per rearrangement (the same both ways).
        rows = cfg["slots"] // world
        moved = 0
        for layer in range(cfg["layers"]):
            for r in range(world):
                held = set(a[layer][r * rows:(r + 1) * rows])
                moved += len({e for e in b[layer][r * rows:(r + 1) * rows] if e not in held})
        out = {"seconds": seconds, "inside_s": inside, "copy_out_s": copying, "copy_limit_gbps": limits,
               "bytes_moved": moved * sum(elems) * 4}
        results.put((rank, out))
    except Exception:  # noqa: BLE001
        results.put((rank, traceback.format_exc()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--check", action="store_true", help="correctness of every call pattern, small")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    try:
        import vllm
    except Exception as e:  # noqa: BLE001
        print(f"vLLM is not importable by {sys.executable} ({e!r}): nothing to run "
              "(scripts/vllm-env.sh makes an interpreter with vLLM)")
        return 0
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's workers serve with one torch thread each (set_torch_threads_for_runtime: idle OMP
    # workers spin and steal the step's cycles); the ranks here are spawned likewise.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Host tensors, no GPU here: vLLM's CPU platform (what vLLM picks on a CPU build).
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if args.check:
        cli = check_cli()
        out = spawn(check_worker, CHECK["world"], timeout=600)
        print(json.dumps({"vllm": vllm.__version__, "cli": cli, "ranks": out}, indent=1))
        ok = set(out) == set(range(CHECK["world"])) and all(v.startswith("ok, ") for v in out.values())
        # The direct path must have read some rows straight into the weights somewhere.
        direct = sum(int(v.split("direct rows ")[1].split(",")[0]) for v in out.values()) if ok else 0
        return 0 if cli == "ok" and ok and direct > 0 else 1
    out = spawn(bench_worker, BENCH["world"], args.repeats)
    if set(out) != set(range(BENCH["world"])) or any(isinstance(v, str) for v in out.values()):
        print(json.dumps(out, indent=1))
        return 1
    first = out[0]
    names = list(first["seconds"])
    # A rearrangement ends when the slowest rank ends: per repetition, the max over ranks.
    e2e = {n: [max(out[r]["seconds"][n][i] for r in out) for i in range(args.repeats)] for n in names}
    inside = {n: [max(out[r]["inside_s"][n][i] for r in out) for i in range(args.repeats)] for n in names}
    copy_out = {n: [max(out[r]["copy_out_s"][n][i] for r in out) for i in range(args.repeats)] for n in names}
    moved = first["bytes_moved"]  # every rank counts the whole rearrangement
    limit = statistics.mean(first["copy_limit_gbps"])
    report = {"vllm": vllm.__version__, **BENCH, "repeats": args.repeats, "bytes_moved": moved,
              "copy_limit_gbps": first["copy_limit_gbps"], "copy_once_floor_s": moved / (limit * 1e9),
              "median_s": {n: statistics.median(v) for n, v in e2e.items()},
              "median_inside_s": {n: statistics.median(v) for n, v in inside.items()},
              "median_copy_out_s": {n: statistics.median(v) for n, v in copy_out.items()},
              "seconds": e2e, "inside_s": inside, "copy_out_s": copy_out}
    base = report["median_s"]["torch_gloo"]
    report["speedup_vs_torch_gloo"] = {n: base / s for n, s in report["median_s"].items()}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"vLLM {vllm.__version__}: {BENCH['world']} ranks, {BENCH['layers']} layers, {BENCH['slots']} slots, "
              f"rows of {'/'.join(map(str, BENCH['mib']))} MiB, {moved / 2**30:.2f} GiB moved per rearrangement, "
              f"medians of {args.repeats}")
        for n in names:
            print(f"{n:14s} end to end {report['median_s'][n]:.3f} s (min {min(e2e[n]):.3f}, max {max(e2e[n]):.3f})"
                  f"  inside the communicator {report['median_inside_s'][n]:.3f} s,"
                  f" copying out of the buffer {report['median_copy_out_s'][n]:.3f} s"
                  f"  {report['speedup_vs_torch_gloo'][n]:.2f}x torch_gloo")
        print(f"copy limit {' / '.join(f'{x:.1f}' for x in first['copy_limit_gbps'])} GB/s: "
              f"copying the moved bytes once takes {report['copy_once_floor_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
