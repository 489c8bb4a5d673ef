"""eplbx.vllm.EplbxCommunicator in spawned processes over a gloo group, driven exactly as
vLLM drives an EPLB communicator; tensors in shared memory (share_memory_()); layout
mismatches and a killed rank."""
import multiprocessing as mp
import os
import socket
import time
import traceback
import unittest

LAYERS, ROWS, EXPERTS = 3, 4, 9
SHAPES = [(6, 5), (7,), (3,)]          # per-expert shape of each tensor
DTYPES = ["float32", "float16", "int32"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
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
                w = torch.empty((ROWS,) + tuple(shape), dtype=dtype)
                for row in range(ROWS):
                    w[row].fill_(value(layer, before[layer][rank * ROWS + row], t))
                tensors.append(w)
            weights.append(tensors)
        buffer = [torch.zeros((ROWS,) + tuple(s), dtype=d) for s, d in zip(shapes, dtypes)]
        if scenario == "shared" and rank != 1:
            # Ranks 0 and 2 move their tensors to /dev/shm; rank 1 keeps plain memory, so
            # its rows are read with process_vm_readv and the others' are mapped.
            for t in [w for layer in weights for w in layer] + buffer:
                t.share_memory_()
        try:
            comm = EplbxCommunicator(group, weights, buffer, timeout_s=4.0)
        except eplbx.EplbxError as e:
            results.put((rank, type(e).__name__, str(e)))
            return
        assert comm.needs_profile_buffer_reservation is False
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

        for layer in range(LAYERS):
            comm.set_transfer_context(torch.tensor(before[layer]), layer)
            for dst in range(world):  # what the others need from this rank
                asked = set()
                for row in range(ROWS):
                    e = after[layer][dst * ROWS + row]
                    if dst == rank or holds(layer, dst, e) or holder(layer, e) != rank or e in asked:
                        continue
                    asked.add(e)
                    comm.add_send([w[0] for w in weights[layer]], dst, e)
            received = {}
            for row in range(ROWS):
                e = after[layer][rank * ROWS + row]
                if holds(layer, rank, e) or e in received:
                    continue
                received[e] = row
                comm.add_recv([b[row] for b in buffer], holder(layer, e), e)
            if scenario == "kill" and rank == 2:
                os._exit(3)  # dies mid-layer, its READYs unsent
            started = time.monotonic()
            try:
                comm.execute()
            except eplbx.EplbxError as e:
                results.put((rank, type(e).__name__, str(e), time.monotonic() - started))
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
    except Exception:  # noqa: BLE001 - report anything to the parent
        results.put((rank, "crash", traceback.format_exc()))


def run(world, scenario, timeout=90):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
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
    return out


class VllmCommunicatorTest(unittest.TestCase):
    def test_random_placements_every_row(self):
        out = run(3, "ok")
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

    def test_killed_rank_makes_survivors_raise_in_time(self):
        out = run(3, "kill")
        self.assertEqual(set(out), {0, 1}, out)
        for rank, (kind, message, *rest) in out.items():
            self.assertIn(kind, ("AbortedError", "UnavailableError"), message)
            self.assertIn("rank 2", message)
            self.assertLess(rest[0], 4.0 + 2.0, message)


if __name__ == "__main__":
    unittest.main()
