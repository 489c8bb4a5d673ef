"""NIXL (from PyPI) beside eplbx: host-memory READs between two processes on this machine,
one transfer at a time, interleaved in one run (docs/perf.md; issue 34).

  python3 bench/python/bench_nixl_read.py [--json] [--sizes 1M] [--batches 1]
                                          [--pages plain,huge] [--rounds 3] [--seconds 0.5]
                                          [--eplbx build/bin/eplbx]

NIXL: its own Python API (`nixl_agent`, the UCX backend and the UCX bundled in its wheel), as
a user of NIXL runs it: two processes, each an agent with 256 MiB of plain process memory
(numpy) registered, metadata exchanged once, descriptor lists prepared once
(`prep_xfer_dlist`), a handle per window made once (`make_prepped_xfer`) and posted again
for every READ (`transfer`), completion polled (`check_xfer_state`) on the calling thread.
Every READ moves a different window of the 256 MiB (as `eplbx bench xfer` does), so large
blocks are not served from the cache. Both of NIXL's progress settings are run (a progress
thread, or progress on the caller) and the better p50 is kept per row. On one host, UCX
copies plain memory with CMA; so does eplbx here (`--paths cma`). CMA pins each page it
copies, so the page size decides much of the speed: both sides are run on 4 KiB pages
(`plain`) and on transparent huge pages (`huge`: numpy's default for large arrays where the
kernel's THP mode is `madvise`; `eplbx bench xfer --huge-pages`).

eplbx: `eplbx bench xfer --json --paths cma --ops read` at the same sizes (its Read() and
Wait() on the caller's thread, windows rotating through 256 MiB).

NIXL is installed by this script into .cache/nixl-venv from PyPI (`nixl` and `nixl-cu12`
1.5.1 without their dependencies, and numpy: NIXL's host-memory path needs neither torch nor
a GPU); nothing of NIXL is kept in the project. Without PyPI it prints why and exits 0.
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(ROOT, ".cache", "nixl-venv")
NIXL_VERSION = "1.5.1"
BUFFER = 256 << 20


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def ensure_nixl():
    """Re-runs this script under .cache/nixl-venv with NIXL installed; returns only when
    NIXL imports here."""
    try:
        import nixl._api  # noqa: F401
        import numpy  # noqa: F401
        return
    except ImportError:
        pass
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        sys.exit(f"SKIP: NIXL does not import in {VENV}")
    py = os.path.join(VENV, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    try:
        subprocess.run([py, "-c", "import nixl._api, numpy"], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        r = subprocess.run(pip + ["--no-deps", f"nixl=={NIXL_VERSION}", f"nixl-cu12=={NIXL_VERSION}"])
        r2 = subprocess.run(pip + ["numpy"]) if r.returncode == 0 else r
        if r.returncode != 0 or r2.returncode != 0:
            print("SKIP: could not install NIXL from PyPI (no registry?): nothing measured")
            sys.exit(0)
    os.execv(py, [py] + sys.argv)


def set_pages(np, huge):
    """numpy asks for transparent huge pages on large arrays (madvise) unless told not to;
    eplbx's bench does with --huge-pages: both sides get the same kind of page."""
    try:
        np._core.multiarray._set_madvise_hugepage(huge)
    except AttributeError:
        np.core.multiarray._set_madvise_hugepage(huge)


def target(conn, prog_thread, huge):
    sys.stdout = sys.stderr  # NIXL logs to stdout: keep it for the report
    import numpy as np

    set_pages(np, huge)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(enable_prog_thread=prog_thread))
    buf = np.ones(BUFFER, dtype=np.uint8)
    reg = agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, BUFFER, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    # Until the initiator is done; without a progress thread the target's agent progresses
    # only when called (UCX's connection set-up needs it).
    while not conn.poll(0.001):
        agent.get_new_notifs()
    conn.recv()
    agent.deregister_memory(reg)


def initiator(conn, prog_thread, huge, sizes, batches, seconds, results):
    sys.stdout = sys.stderr
    import numpy as np

    set_pages(np, huge)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("initiator", nixl_agent_config(enable_prog_thread=prog_thread))
    buf = np.zeros(BUFFER, dtype=np.uint8)
    reg = agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, BUFFER, 0, "")], "DRAM"))
    meta, remote_base = conn.recv()
    name = agent.add_remote_agent(meta)
    if isinstance(name, bytes):
        name = name.decode()
    rows = []
    for block in sizes:
        n = BUFFER // block  # every block of the buffer, as descriptors
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(buf.ctypes.data + i * block, block, 0) for i in range(n)], "DRAM")
        remote = agent.prep_xfer_dlist(
            name, [(remote_base + i * block, block, 0) for i in range(n)], "DRAM")
        for batch in batches:
            windows = max(1, min(4096, n // batch))  # the whole 256 MiB, as eplbx's bench
            handles = []
            for w in range(windows):
                idx = [(w * batch + i) % n for i in range(batch)]
                handles.append(agent.make_prepped_xfer("READ", local, idx, remote, idx))
            lat = []
            start = time.perf_counter()
            it = 0
            while True:
                h = handles[it % windows]
                t0 = time.perf_counter()
                state = agent.transfer(h)
                while state not in ("DONE", "ERR"):
                    state = agent.check_xfer_state(h)
                t1 = time.perf_counter()
                if state == "ERR":
                    raise RuntimeError("NIXL READ failed")
                if it >= 2:
                    lat.append((t1 - t0) * 1e6)
                it += 1
                if len(lat) >= 3 and (time.perf_counter() - start > seconds or len(lat) >= 20000):
                    break
            # Checked: the last window holds the target's bytes (ones).
            w = (it - 1) % windows
            first = (w * batch) % n * block
            if int(buf[first]) != 1 or int(buf[first + block - 1]) != 1:
                raise RuntimeError("NIXL READ landed wrong bytes")
            lat.sort()
            rows.append({"block_bytes": block, "batch": batch, "p50_us": lat[len(lat) // 2],
                         "gbps": block * batch * len(lat) / (sum(lat) * 1e-6) / 1e9,
                         "iterations": len(lat)})
            for h in handles:
                agent.release_xfer_handle(h)
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
    agent.remove_remote_agent(name)
    agent.deregister_memory(reg)
    conn.send("done")
    results.put(rows)


def run_nixl(prog_thread, huge, sizes, batches, seconds):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    t = ctx.Process(target=target, args=(a, prog_thread, huge))
    i = ctx.Process(target=initiator,
                    args=(b, prog_thread, huge, sizes, batches, seconds, results))
    t.start()
    i.start()
    rows = results.get(timeout=600)
    i.join(60)
    t.join(60)
    return rows


def run_eplbx(binary, huge, sizes, batches, seconds):
    out = subprocess.run(
        [binary, "bench", "xfer", "--json", "--paths", "cma", "--ops", "read",
         "--sizes", ",".join(str(s) for s in sizes), "--batches", ",".join(str(b) for b in batches),
         "--seconds", str(seconds)] + (["--huge-pages"] if huge else []),
        check=True, capture_output=True, text=True).stdout
    return [r for r in json.loads(out)["results"] if r["op"] == "read" and r["memory"] == "plain"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--eplbx", default=os.path.join(ROOT, "build", "bin", "eplbx"))
    ap.add_argument("--pages", default="plain,huge",
                    help="plain (4 KiB pages), huge (transparent huge pages), or both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not os.path.exists(args.eplbx):
        sys.exit(f"no eplbx binary at {args.eplbx} (build first)")
    ensure_nixl()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    pages = args.pages.split(",")
    per = {}  # (pages, block, batch) -> {"nixl": [p50 per round], "eplbx": [...]}
    for _ in range(args.rounds):
        for kind in pages:
            huge = kind == "huge"
            best = {}
            for prog_thread in (True, False):
                for r in run_nixl(prog_thread, huge, sizes, batches, args.seconds):
                    key = (kind, r["block_bytes"], r["batch"])
                    best[key] = min(best.get(key, float("inf")), r["p50_us"])
            for key, p50 in best.items():
                per.setdefault(key, {"nixl": [], "eplbx": []})["nixl"].append(p50)
            for r in run_eplbx(args.eplbx, huge, sizes, batches, args.seconds):
                per.setdefault((kind, r["block_bytes"], r["batch"]), {"nixl": [], "eplbx": []})[
                    "eplbx"].append(r["p50_us"])
    out = {"nixl_version": NIXL_VERSION, "rounds": args.rounds, "rows": []}
    for (kind, block, batch), v in sorted(per.items()):
        n, e = statistics.median(v["nixl"]), statistics.median(v["eplbx"])
        out["rows"].append({"pages": kind, "block_bytes": block, "batch": batch,
                            "nixl_p50_us": v["nixl"], "eplbx_p50_us": v["eplbx"],
                            "nixl_over_eplbx_median": n / e})
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in out["rows"]:
            print(f"READ {r['pages']:>5} pages {r['block_bytes']:>9} x{r['batch']:<3} NIXL p50 {r['nixl_p50_us']} us, "
                  f"eplbx p50 {r['eplbx_p50_us']} us: eplbx {r['nixl_over_eplbx_median']:.2f}x "
                  "NIXL's speed (median)")


if __name__ == "__main__":
    main()
