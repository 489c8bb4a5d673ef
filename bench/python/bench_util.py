"""Helpers shared by the Python benchmarks in this folder (and the tests in tests/python)."""
import datetime
import multiprocessing as mp
import random
import time

HOST = "127.0.0.1"


def gloo_store():
    """torch.distributed's TCPStore served by this process on a port the system picks:
    (store, port); keep `store` alive while the workers run. A port picked by binding port 0
    and closing it can be taken by anyone (an outgoing connection, another test) before the
    rank meant to serve on it binds it ("Address already in use" failed a CI run); this one
    is never let go."""
    import torch.distributed as dist

    store = dist.TCPStore(HOST, 0, None, True, datetime.timedelta(seconds=120), wait_for_workers=False)
    return store, store.port


def init_gloo(port, rank, world):
    """In a worker: joins the store on `port` (gloo_store's) and the gloo process group over it."""
    import torch.distributed as dist

    store = dist.TCPStore(HOST, port, None, False, datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


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
    store, port = gloo_store()  # held until the workers are done
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
    del store
    return out
