"""Rendezvous for the spawned test processes without a port race: a port picked by binding
port 0 and then closed can be taken by anyone (an outgoing connection's ephemeral port, another
test) before the process meant for it binds it again, which once failed CI with "Address
already in use". Here the test process itself serves torch's store on a port the system
chose and holds it until the workers are done; they join it as clients."""
import datetime

HOST = "127.0.0.1"


def gloo_store():
    """torch.distributed's TCPStore served by this process on a port the system picks:
    (store, port). Keep `store` alive while the workers run."""
    import torch.distributed as dist

    store = dist.TCPStore(HOST, 0, None, True, datetime.timedelta(seconds=120), wait_for_workers=False)
    return store, store.port


def init_gloo(port, rank, world):
    """In a worker: joins the store on `port` and the gloo process group over it."""
    import torch.distributed as dist

    store = dist.TCPStore(HOST, port, None, False, datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def free_port():
    """A port no socket uses now. Another process may take it before it is bound again: only
    for servers that cannot bind port 0 and say which port they got (etcd); start_etcd retries."""
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_etcd(binary, data_dir, attempts=3):
    """One etcd member serving clients on HOST: (process, client port). Started again on new
    ports (and a fresh data directory under `data_dir`) when it exits, which is what a port
    taken between free_port() and etcd's bind looks like."""
    import os
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
