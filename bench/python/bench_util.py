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


def device_rank(rank, world, port, device_kind):
    """In a worker: one torch thread (as vLLM's workers run), GPU rank % GPUs ("cuda") or the
    host ("cpu"), joined to the gloo group of every rank. Returns (device, group)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device_kind == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    else:
        device = "cpu"
    init_gloo(port, rank, world)
    return device, dist.new_group(backend="gloo")


def row_value(layer, expert, tensor):
    """What every element of an expert's row of one tensor holds in the communicator benches."""
    return float((layer * 37 + expert * 11 + tensor * 3) % 97 + 1)


class ExpertRows:
    """A rank's expert weights as vLLM holds them: per layer one tensor of `rows` x elems per
    entry of `elems` (float32 on `device`), each row filled with row_value of the expert the
    map puts in that slot, and vLLM's one-layer buffer (zeros)."""

    def __init__(self, rank, rows, layers, elems, device, phy2log):
        import torch

        self.rank, self.rows = rank, rows
        self.weights = [[torch.empty((rows, e), dtype=torch.float32, device=device) for e in elems]
                        for _ in range(layers)]
        self.buffer = [torch.zeros((rows, e), dtype=torch.float32, device=device) for e in elems]
        self.fill(phy2log)

    def fill(self, phy2log):
        """Every row as `phy2log` says it should be."""
        for layer, tensors in enumerate(self.weights):
            for t, w in enumerate(tensors):
                for r in range(self.rows):
                    w[r].fill_(row_value(layer, int(phy2log[layer][self.rank * self.rows + r]), t))

    def wrong(self, phy2log):
        """The first row (of every element of every row of every layer) that does not hold what
        `phy2log` puts there, named; None when all do."""
        import torch

        for layer, tensors in enumerate(self.weights):
            for t, w in enumerate(tensors):
                want = torch.tensor([row_value(layer, int(phy2log[layer][self.rank * self.rows + r]), t)
                                     for r in range(self.rows)], device=w.device)
                ok = (w == want[:, None]).all(dim=1).cpu()
                if not bool(ok.all()):
                    r = int((~ok).nonzero()[0])
                    return f"rank {self.rank} layer {layer} row {r} tensor {t}"
        return None


def report_seconds(result, out, names, repeats, baseline, key, as_json):
    """Fills result["seconds"] (a rearrangement ends when its slowest rank ends: per round the
    max over ranks, then the median of the rounds) and result[key] (the baseline's median
    over each other's), then prints the result as JSON or as lines."""
    import json
    import statistics

    result["seconds"] = {}
    for name in names:
        per = [max(out[r][1]["times"][name][i] for r in out) for i in range(repeats)]
        result["seconds"][name] = {"median": statistics.median(per), "all": per}
    base = result["seconds"][baseline]["median"]
    result[key] = {n: base / result["seconds"][n]["median"] for n in names if n != baseline}
    if as_json:
        print(json.dumps(result, indent=1))
        return
    for n in names:
        s = result["seconds"][n]
        print(f"{n:18} median {s['median']:.4f} s  all {[round(x, 4) for x in s['all']]}")
    print(f"{key}:", {n: round(v, 2) for n, v in result[key].items()})


def no_device_reason(device_kind):
    """Why a bench on `device_kind` cannot run here ("" when it can: the host always can)."""
    if device_kind == "cpu":
        return ""
    try:
        import torch

        return "" if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"
    except Exception as e:  # noqa: BLE001 - the reason is printed
        return f"no CUDA device ({e!r})"


def failed_ranks(out, world):
    """What went wrong across the ranks spawn() reported on, each ("ok", item) or (what,
    detail); None when all `world` reported ok."""
    bad = {r: v for r, v in out.items() if v[0] != "ok"}
    if len(out) < world or bad:
        return str(bad or "ranks missing: " + str(sorted(out)))
    return None
