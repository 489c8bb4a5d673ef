"""Helpers shared by the Python benchmarks in this folder."""
import multiprocessing as mp
import random
import socket
import time


def free_port():
    """A TCP port free on localhost now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def placements(seed, layers, slots, experts):
    """Random phy2log per layer: every expert once, the rest replicas."""
    rng = random.Random(seed)
    out = []
    for _ in range(layers):
        m = list(range(experts)) + [rng.randrange(experts) for _ in range(slots - experts)]
        rng.shuffle(m)
        out.append(m)
    return out


def spawn(target, world, *args, timeout=900):
    """Runs target(rank, world, port, *args, results) in `world` spawned processes; each puts
    (rank, item) on `results`. Returns {rank: item} for the ranks that reported in time."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < world and time.monotonic() < deadline:
        try:
            rank, item = results.get(timeout=1)
            out[rank] = item
        except Exception:  # noqa: BLE001 - queue.Empty
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return out
