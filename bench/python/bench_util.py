"""Helpers shared by the Python benchmarks in this folder."""
import random
import socket


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
