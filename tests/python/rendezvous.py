"""Rendezvous for the spawned test processes without a port race: a port picked by binding
port 0 and then closed can be taken by anyone (an outgoing connection's ephemeral port, another
test) before the process meant for it binds it again, which once failed CI with "Address
already in use". gloo: the test process serves torch's store on a port the system chose and
holds it (bench/python/bench_util.py, shared with the benchmarks); etcd: started again on
other ports when it exits."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
from bench_util import gloo_store, init_gloo  # noqa: E402,F401 - re-exported for the tests

HOST = "127.0.0.1"


def free_port():
    """A port no socket uses now, for a server that cannot bind port 0 and say which port it
    got (etcd): at random below the kernel's ephemeral range, where outgoing connections and
    port-0 binds never take it before the server binds it (tests/unit/free_port.h does the
    same); start_etcd still retries, another test may draw it."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100 if low - 10000 > 1000 else 0):
        with socket.socket() as s:
            try:
                s.bind((HOST, random.randrange(10000, low)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_etcd(binary, data_dir, attempts=3):
    """One etcd member serving clients on HOST: (process, client port). Started again on new
    ports (and a fresh data directory under `data_dir`) when it exits, which is what a port
    taken between free_port() and etcd's bind looks like."""
    import socket
    import subprocess
    import time

    for attempt in range(attempts):
        client, peer = free_port(), free_port()
        data = os.path.join(data_dir, f"try{attempt}")
        server = subprocess.Popen(
            [binary, "--name", "e", "--data-dir", data, "--listen-client-urls", f"http://{HOST}:{client}",
             "--advertise-client-urls", f"http://{HOST}:{client}", "--listen-peer-urls",
             f"http://{HOST}:{peer}", "--initial-advertise-peer-urls", f"http://{HOST}:{peer}",
             "--initial-cluster", f"e=http://{HOST}:{peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):  # up when its port answers
            if server.poll() is not None:
                break
            with socket.socket() as s:
                if s.connect_ex((HOST, client)) == 0:
                    return server, client
            time.sleep(0.05)
        server.kill()
        server.wait()
    raise RuntimeError(f"etcd did not start in {attempts} tries (see {data_dir})")
