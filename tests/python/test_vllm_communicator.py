"""eplbx.vllm.EplbxCommunicator in spawned processes over a gloo group, driven exactly as
vLLM drives an EPLB communicator; tensors in shared memory (share_memory_()); layout
mismatches and a killed rank."""
import multiprocessing as mp
import os
import threading
import time
import traceback
import unittest

from rendezvous import gloo_store, init_gloo

LAYERS, ROWS, EXPERTS = 3, 4, 9
SHAPES = [(6, 5), (7,), (3,)]          # per-expert shape of each tensor
DTYPES = ["float32", "float16", "int32"]


def value(layer, expert, tensor):
    return float((layer * 37 + expert * 11 + tensor * 3) % 97 + 1)


def random_maps(seed, world):
    import random
    rng = random.Random(seed)
    maps = []
    for _ in range(LAYERS):
        m = list(range(EXPERTS)) + [rng.randrange(EXPERTS) for _ in range(world * ROWS - EXPERTS)]
        rng.shuffle(m)
        maps.append(m)
    return maps


def worker(rank, world, port, scenario, results, seed=7):
    try:
        import torch
        import torch.distributed as dist

        import eplbx
        from eplbx.vllm import EplbxCommunicator

        # "cuda": every rank's tensors on GPU 0 (IPC works within one device), moved as vLLM's
        # asynchronous mode drives it: set_stream(), then the transfer calls from another thread.
        device = "cuda:0" if scenario == "cuda" else "cpu"
        init_gloo(port, rank, world)
        group = dist.new_group(backend="gloo")
        before = random_maps(seed, world)
        after = random_maps(seed + 1, world)
        dtypes = [getattr(torch, d) for d in DTYPES]
        shapes = list(SHAPES)
        if scenario == "shared":
            # One tensor of ~1.2 MB per expert: large copies take the streaming path.
            shapes.append((300001,))
            dtypes.append(torch.float32)
        weights = []
        for layer in range(LAYERS):
            tensors = []
            for t, (shape, dtype) in enumerate(zip(shapes, dtypes)):
                if scenario == "mismatch" and rank == 1 and t == 1:
                    shape = (shape[0] // 2 + 1,)
                w = torch.empty((ROWS,) + tuple(shape), dtype=dtype, device=device)
                for row in range(ROWS):
                    w[row].fill_(value(layer, before[layer][rank * ROWS + row], t))
                tensors.append(w)
            weights.append(tensors)
        buffer = [torch.zeros((ROWS,) + tuple(s), dtype=d, device=device) for s, d in zip(shapes, dtypes)]
        if scenario == "short_buffer" and rank == 1:
            buffer[0] = torch.zeros((ROWS, 6, 4), dtype=dtypes[0])  # rows of 24 floats, not 30
        if scenario == "args":
            results.put((rank, "args", bad_arguments(torch, eplbx, EplbxCommunicator, group, weights,
                                                     buffer, before)))
            return
        if scenario == "shared" and rank != 1:
            # Ranks 0 and 2 move their tensors to /dev/shm; rank 1 keeps plain memory, so
            # its rows are read with process_vm_readv and the others' are mapped.
            for t in [w for layer in weights for w in layer] + buffer:
                t.share_memory_()
        # "deferred": the exchange waits for the first set_transfer_context (rank 1 comes 1.5 s
        # late: rank 0's constructor must not wait for it), and every call carries a keyword
        # a newer vLLM might add.
        deferred = scenario == "deferred"
        extra = {"perf_context": object()} if deferred else {}
        if deferred and rank == 1:
            time.sleep(1.5)
        try:
            started = time.monotonic()
            comm = EplbxCommunicator(group, weights, buffer, timeout_s=4.0, defer_setup=deferred, **extra)
            if deferred and rank == 0 and time.monotonic() - started > 1.0:
                results.put((rank, "setup not deferred", f"{time.monotonic() - started:.2f} s"))
                return
            if deferred:
                try:
                    comm.add_send([w[0] for w in weights[0]], 1, 0)
                    results.put((rank, "add_send before any context was accepted", ""))
                    return
                except eplbx.InvalidArgumentError as e:
                    if "set_transfer_context" not in str(e):
                        results.put((rank, "unclear error", str(e)))
                        return
        except eplbx.EplbxError as e:
            results.put((rank, type(e).__name__, str(e)))
            return
        assert comm.needs_profile_buffer_reservation is False
        stream = None
        if scenario == "cuda":
            stream = torch.cuda.Stream(device)
            comm.set_stream(stream)
            if rank == 0:  # one memory per communicator: host buffer rows beside device weights
                try:
                    EplbxCommunicator(group, weights, [b.cpu() for b in buffer], timeout_s=4.0,
                                      defer_setup=True)
                    results.put((rank, "mixed memory accepted", ""))
                    return
                except eplbx.InvalidArgumentError as e:
                    if "is on cpu but the communicator's first weight tensor is on cuda:0" not in str(e):
                        results.put((rank, "unclear error", str(e)))
                        return
        if scenario == "shared":
            # The peers' shared files are mapped here (torch names them torch_<pid>_...).
            with open("/proc/self/maps") as maps:
                peers = {line.split("/dev/shm/torch_")[1].split("_")[0] for line in maps
                         if "/dev/shm/torch_" in line}
            peers.discard(str(os.getpid()))
            if len(peers) != (1 if rank != 1 else 2):
                results.put((rank, "not mapped", f"peer files mapped from pids {sorted(peers)}"))
                return

        def holder(layer, e):
            return next(s // ROWS for s in range(world * ROWS) if before[layer][s] == e)

        def holds(layer, r, e):
            return e in before[layer][r * ROWS:(r + 1) * ROWS]

        def layers():
            for layer in range(LAYERS):
                old = list(before[layer])
                if scenario == "stale" and rank == 2:
                    old[0], old[1] = old[1], old[0]  # a stale map: two of rank 0's rows swapped
                comm.set_transfer_context(torch.tensor(old), layer, **extra)
                for dst in range(world):  # what the others need from this rank
                    asked = set()
                    for row in range(ROWS):
                        e = after[layer][dst * ROWS + row]
                        if dst == rank or holds(layer, dst, e) or holder(layer, e) != rank or e in asked:
                            continue
                        asked.add(e)
                        comm.add_send([w[0] for w in weights[layer]], dst, e, **extra)
                received = {}
                for row in range(ROWS):
                    e = after[layer][rank * ROWS + row]
                    if holds(layer, rank, e) or e in received:
                        continue
                    received[e] = row
                    rows = [b[row] for b in buffer]
                    if scenario == "weight_row" and rank == 0:
                        rows = [w[0] for w in weights[layer]]  # a live weight row as receive row
                    try:
                        comm.add_recv(rows, holder(layer, e), e, **extra)
                    except eplbx.EplbxError as err:
                        results.put((rank, type(err).__name__, str(err), 0.0))
                        time.sleep(2.0)  # an engine process lives on: its ABORT goes out meanwhile
                        return
                if scenario == "kill" and rank == 2:
                    os._exit(3)  # dies mid-layer, its READYs unsent
                started = time.monotonic()
                try:
                    comm.execute(**extra)
                except eplbx.EplbxError as e:
                    if scenario == "weight_row":
                        intact = all(bool((weights[l][t][r] == value(l, before[l][rank * ROWS + r], t)).all())
                                     for l in range(LAYERS) for t in range(len(shapes)) for r in range(ROWS))
                        results.put((rank, type(e).__name__, str(e), "intact" if intact else "CHANGED"))
                    else:
                        results.put((rank, type(e).__name__, str(e), time.monotonic() - started))
                    if scenario == "short_buffer":
                        time.sleep(2.0)  # alive until every peer reported, as an engine process is
                    return
                for e, row in received.items():
                    for t in range(len(shapes)):
                        got = buffer[t][row]
                        want = value(layer, e, t)
                        if not bool((got == want).all()):
                            results.put((rank, "wrong", f"layer {layer} expert {e} tensor {t}"))
                            return
                # vLLM copies from the buffer into the weights afterwards.
                for e, row in received.items():
                    for t in range(len(shapes)):
                        for r in range(ROWS):
                            if after[layer][rank * ROWS + r] == e:
                                weights[layer][t][r].copy_(buffer[t][row])
            results.put((rank, "ok", ""))

        if scenario != "cuda":
            layers()
            return
        # The engine still writes the rows this rank sends, on its stream: garbage now, the
        # right values only after a 20 ms kernel. Transfers must wait for that work.
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            for w in weights[layer]:
                w.fill_(-1)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(40_000_000)
            for layer in range(LAYERS):
                for t, w in enumerate(weights[layer]):
                    for row in range(ROWS):
                        w[row].fill_(value(layer, before[layer][rank * ROWS + row], t))

        def guarded():
            try:
                layers()
            except Exception:  # noqa: BLE001 - report anything to the parent
                results.put((rank, "crash", traceback.format_exc()))

        thread = threading.Thread(target=guarded)
        thread.start()
        thread.join()
    except Exception:  # noqa: BLE001 - report anything to the parent
        results.put((rank, "crash", traceback.format_exc()))


def bad_arguments(torch, eplbx, EplbxCommunicator, group, weights, buffer, before):
    """Each bad argument raises InvalidArgumentError (never a wrap, cut or silent cast)."""
    said = []

    def expect(what, call):
        try:
            call()
        except eplbx.InvalidArgumentError as e:
            said.append(str(e))
            return
        said.append(f"NOT REFUSED: {what}")

    for t in (float("inf"), float("nan"), 0, -1, 1e-4, "5"):
        expect(f"timeout {t!r}", lambda t=t: EplbxCommunicator(group, weights, buffer, timeout_s=t))
    comm = EplbxCommunicator(group, weights, buffer, timeout_s=10.0)
    m = torch.tensor(before[0])
    expect("float map", lambda: comm.set_transfer_context(m.float(), 0))
    expect("float64 map", lambda: comm.set_transfer_context(m.double() + 0.9, 0))
    expect("id past int32", lambda: comm.set_transfer_context(m.long() + 2**32, 0))
    expect("layer 2.7", lambda: comm.set_transfer_context(m, 2.7))
    expect("layer past the end", lambda: comm.set_transfer_context(m, LAYERS))
    comm.set_transfer_context(m, 0, new_indices=m, some_future_kwarg=1)  # accepted, ignored
    expect("expert 2**32 + 1", lambda: comm.add_recv([b[0] for b in buffer], 0, 2**32 + 1))
    return said


def run(world, scenario, timeout=90):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store, port = gloo_store()  # held until the workers are done
    procs = [ctx.Process(target=worker, args=(r, world, port, scenario, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    expected = world - (1 if scenario == "kill" else 0)
    while len(out) < expected and time.monotonic() < deadline:
        try:
            item = results.get(timeout=1)
            out[item[0]] = item[1:]
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    del store  # the workers are done with it
    return out


class VllmCommunicatorTest(unittest.TestCase):
    def test_cuda_tensors_with_set_stream_from_another_thread_every_row(self):
        try:
            import torch
            available = torch.cuda.is_available()
        except Exception as e:  # noqa: BLE001 - reported as the reason
            available, why = False, repr(e)
        else:
            why = "torch.cuda.is_available() is False"
        if not available:
            self.skipTest(f"no CUDA device ({why})")
        out = run(3, "cuda")
        self.assertEqual(out, {0: ("ok", ""), 1: ("ok", ""), 2: ("ok", "")})

    def test_tensor_checks_name_the_device_and_refuse_mixed_memory(self):
        import torch

        import eplbx
        from eplbx.vllm import _check_tensor

        class Fake:  # only what the check reads: device and contiguity
            def __init__(self, device, contiguous=True):
                self.device, self._contiguous = torch.device(device), contiguous

            def is_contiguous(self):
                return self._contiguous

        self.assertEqual(_check_tensor(Fake("cuda:0"), "w"), torch.device("cuda:0"))
        with self.assertRaisesRegex(NotImplementedError, "weight tensor 0 of layer 2 is on meta; eplbx "
                                    "moves host memory and CUDA device memory"):
            _check_tensor(Fake("meta"), "weight tensor 0 of layer 2")
        with self.assertRaisesRegex(eplbx.InvalidArgumentError, "expert_buffer tensor 1 is on cpu but "
                                    "the communicator's first weight tensor is on cuda:0"):
            _check_tensor(Fake("cpu"), "expert_buffer tensor 1", torch.device("cuda:0"))
        with self.assertRaisesRegex(eplbx.InvalidArgumentError, "is on cuda:1 but .* is on cuda:0"):
            _check_tensor(Fake("cuda:1"), "weight tensor 1 of layer 0", torch.device("cuda:0"))
        with self.assertRaisesRegex(ValueError, "is not contiguous"):
            _check_tensor(Fake("cuda:0", contiguous=False), "w")

    def test_random_placements_every_row(self):
        out = run(3, "ok")
        self.assertEqual(out, {0: ("ok", ""), 1: ("ok", ""), 2: ("ok", "")})

    def test_deferred_setup_and_unknown_keywords(self):
        # vLLM's NIXL communicator defers its remote setup to the first set_transfer_context;
        # newer vLLM passes more keyword arguments. Before: the constructor was always a
        # collective, and add_send / add_recv / execute raised TypeError on a new keyword.
        out = run(3, "deferred")
        self.assertEqual(out, {0: ("ok", ""), 1: ("ok", ""), 2: ("ok", "")})

    def test_shared_memory_tensors_are_mapped_and_every_row_is_right(self):
        out = run(3, "shared")
        self.assertEqual(out, {0: ("ok", ""), 1: ("ok", ""), 2: ("ok", "")})

    def test_layout_mismatch_raises_on_every_rank(self):
        out = run(3, "mismatch")
        self.assertEqual(set(out), {0, 1, 2})
        for rank, (kind, message, *_) in out.items():
            self.assertEqual(kind, "MismatchError", message)
            self.assertIn("mismatch", message)
            self.assertIn("tensor 1", message)
            self.assertIn("layer 0", message)
            # both byte counts: 7 float16 = 14 bytes, 4 float16 = 8 bytes
            self.assertIn("14 bytes", message)
            self.assertIn("8 bytes", message)
            if rank != 1:
                self.assertIn("rank 1", message)

    def test_stale_map_on_one_rank_fails_every_rank_naming_the_slot(self):
        # Before: every execute() succeeded and rank 2's buffer held the wrong experts.
        out = run(3, "stale")
        self.assertEqual(set(out), {0, 1, 2}, out)
        named = False
        for rank, (kind, message, *_) in out.items():
            self.assertEqual(kind, "AbortedError", message)
            named |= "old map of the layer differs between rank" in message and "at slot 0 " in message
        self.assertTrue(named, out)

    def test_receive_rows_unlike_the_weights_rows_are_refused(self):
        # Before: rows of 24 floats were overrun by 30-float experts, silently.
        out = run(3, "short_buffer")
        self.assertEqual(set(out), {0, 1, 2}, out)
        kind, message, *_ = out[1]
        self.assertEqual(kind, "InvalidArgumentError", message)
        self.assertIn("receive row 0", message)
        self.assertIn("[6, 4] (96 bytes)", message)
        self.assertIn("[6, 5] (120 bytes)", message)
        for rank in (0, 2):
            kind, message, *rest = out[rank]
            self.assertEqual(kind, "AbortedError", message)
            self.assertIn("aborted by rank 1", message)
            self.assertLess(rest[0], 4.0, message)  # told at once, not at the deadline

    def test_live_weight_rows_as_receive_rows_are_refused_and_weights_kept(self):
        out = run(3, "weight_row")
        kind, message, *rest = out[0]
        self.assertEqual(kind, "InvalidArgumentError", message)
        self.assertIn("overlaps weight row 0 of tensor 'tensor0'", message)
        self.assertEqual(rest, ["intact"])

    def test_bad_arguments_are_refused_by_name(self):
        out = run(3, "args")
        self.assertEqual(set(out), {0, 1, 2}, out)
        for rank, (kind, said) in out.items():
            self.assertEqual(kind, "args", said)
            self.assertEqual(kind, "args")
            for line in said:
                self.assertNotIn("NOT REFUSED", line)
            self.assertIn("no limit is not offered", said[0])
            self.assertIn("outside [0.1, 86400] seconds", said[2])
            self.assertIn("dtype float32", said[6])
            self.assertIn("dtype float64", said[7])
            self.assertIn("outside [-1, 2147483647]", said[8])
            self.assertIn("layer_idx is 2.7, not an integer", said[9])
            self.assertIn("expert_id is 4294967297, outside", said[11])

    def test_killed_rank_makes_survivors_raise_in_time(self):
        out = run(3, "kill")
        self.assertEqual(set(out), {0, 1}, out)
        for rank, (kind, message, *rest) in out.items():
            self.assertIn(kind, ("AbortedError", "UnavailableError"), message)
            self.assertIn("rank 2", message)
            self.assertLess(rest[0], 4.0 + 2.0, message)


if __name__ == "__main__":
    unittest.main()
