"""Moving expert rows in place, straight into the weight rows where that is safe: the one
executor behind vLLM's rearrangement on eplbx (EplbxCommunicator.rearrange) and SGLang's
expert-location update on eplbx (eplbx.sglang). Both engines keep every rank's experts as rows
of a few tensors per layer (w13, w2, scales...) and want them updated in the same storage.

Per layer, every rank computes the same transfers (eplbx.migrate: fewest, best-sourced; slots
of ranks that take no part are -1 in both maps, so nothing is read from or written to them).
`plan_layer` (pure) orders this rank's share:
- local moves from old rows first, into free rows directly, into rows still needed through a
  buffer row; afterwards no row's old content is needed here any more ("kept rows copied");
- then rounds of reads, split alike on every rank (`schedule`): a row some peer reads is
  written only in a round after every read of it; rows in a cycle, or that would need more
  than MAX_ROUNDS rounds, are received into a buffer row in the first round;
- then the buffer rows into their weight rows, then second replicas of rows just received.
Only the buffered rows need memory beside the weights: usually few, never a copy of the layer
unless every row is in a cycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


#: Rounds of reads per layer at most (each is one execute(): one agreement among the ranks).
MAX_ROUNDS = 4


@dataclass
class LayerMoves:
    """One layer's moves on one rank (plan_layer)."""

    local: list = field(default_factory=list)  # (src_row, dst_row, via_buffer), old rows
    rounds: list = field(default_factory=list)  # per round: (src, dst, row, expert, via_buffer)
    news: list = field(default_factory=list)  # (src_row, dst_row): replicas of rows received
    buffered: list = field(default_factory=list)  # rows that go through a buffer row, in order
    copies: int = 0


def schedule(o, transfers, rows: int, max_rounds: int = MAX_ROUNDS):
    """Pure, the same on every rank: the round of each transfer and which go through a buffer.
    A transfer that writes a row some other transfer reads must come in a later round than
    every such read; rows in a cycle, or that would need round `max_rounds` or later, are
    received into a buffer row in round 0 and copied into place after the last round.
    Deterministic: ties and cycles are broken by transfer order. Returns (round per transfer,
    set of buffered transfer indices, number of rounds)."""

    def first_row(rank, expert):  # the row a READ of `expert` from `rank` reads
        return int(np.flatnonzero(o[rank * rows:(rank + 1) * rows] == expert)[0])

    writer = {(t[2], t[3]): i for i, t in enumerate(transfers)}
    # Edge a -> b: a reads the row b writes, so a comes first.
    succ = [[] for _ in transfers]
    preds = [0] * len(transfers)
    for a, t in enumerate(transfers):
        b = writer.get((t[0], first_row(t[0], t[4])))
        if b is not None and b != a:
            succ[a].append(b)
            preds[b] += 1
    rnd = [0] * len(transfers)
    buffered = set()
    left = preds[:]
    ready = [i for i in range(len(transfers)) if left[i] == 0]
    done = 0
    seen = [False] * len(transfers)
    while done < len(transfers):
        if not ready:  # only cycles remain: the first one not placed goes through a buffer
            b = next(i for i in range(len(transfers)) if not seen[i])
            buffered.add(b)
            rnd[b] = 0
            ready.append(b)
            left[b] = 0
        ready.sort()
        i = ready.pop(0)
        if seen[i]:
            continue
        seen[i] = True
        done += 1
        if rnd[i] >= max_rounds:
            buffered.add(i)
            rnd[i] = 0
        for b in succ[i]:
            if b in buffered or seen[b]:
                continue
            rnd[b] = max(rnd[b], rnd[i] + 1)
            left[b] -= 1
            if left[b] == 0:
                ready.append(b)
    return rnd, buffered, (max(rnd) + 1) if transfers else 0


def plan_layer(o, n, transfers, copies, me: int, rows: int, max_rounds: int = MAX_ROUNDS) -> LayerMoves:
    """Pure: the order of one layer's moves on rank `me`. `o`, `n`: the layer's old and new
    phy2log (ranks x rows slots, -1 for a slot that holds nothing or takes no part);
    `transfers`: (src, src_row, dst, dst_row, expert) of every rank; `copies`: this rank's
    local copies (rank, src_row, dst_row, expert, from_new)."""
    moves = LayerMoves(copies=len(copies))

    def first_row(rank, expert):
        return int(np.flatnonzero(o[rank * rows:(rank + 1) * rows] == expert)[0])

    served = {(src, first_row(src, expert)) for src, _, _, _, expert in transfers}
    keeps = {int(e) for e in n[me * rows:(me + 1) * rows] if e >= 0}

    def free(row):  # no peer reads it and its old expert does not stay on this rank
        return (me, row) not in served and int(o[me * rows + row]) not in keeps

    for _, s_row, d_row, _, from_new in copies:
        if from_new:
            moves.news.append((s_row, d_row))
        else:
            moves.local.append((s_row, d_row, not free(d_row)))
            if not free(d_row):
                moves.buffered.append(d_row)
    rnd, buffered, count = schedule(o, transfers, rows, max_rounds)
    moves.rounds = [[] for _ in range(count)]
    for i, (src, _, dst, row, expert) in enumerate(transfers):
        if src == me or dst == me:
            via = dst == me and i in buffered
            moves.rounds[rnd[i]].append((src, dst, row, expert, via))
            if via:
                moves.buffered.append(row)
    return moves


def rearrange(comm, old, new, weights, buffer_rows, layers=None, nodes: int = 1, reserve=None,
              name=lambda layer: f"layer {layer}") -> dict:
    """Moves every layer in `layers` (default: all) of `weights` (per layer, the rank's row
    tensors) from `old` to `new` (layers x slots int32, the same on every taking-part rank)
    through `comm` (an EplbxCommunicator over the same tensors). `buffer_rows(layer, rows)`:
    {row: [one row per tensor]} of memory to stage `rows` in (registered with the
    communicator); `reserve(count)`, when given, is called first with the most rows any layer
    buffers. Returns this rank's figures: direct_rows (local copies written straight into
    their rows count too), buffered_rows, local_copies, layers, bytes_received, seconds.

    If a layer fails (a peer lost, a timeout), that layer's rows named in the error may hold
    partial data and every later layer is untouched: the error says so."""
    from ._eplbx import migrate

    t0 = time.perf_counter()
    me, world = comm._rank, comm._world
    layers = list(range(old.shape[0])) if layers is None else list(layers)
    rows = old.shape[1] // world
    stats = {"direct_rows": 0, "buffered_rows": 0, "local_copies": 0, "layers": 0,
             "bytes_received": 0, "seconds": 0.0}
    work = [layer for layer in layers if not np.array_equal(old[layer], new[layer])]
    if not work:  # the same on every rank
        return stats
    plan = migrate(old[work], new[work], ranks=world, nodes=nodes)
    moves = {}
    for at, layer in enumerate(work):
        transfers = [tuple(int(x) for x in t[:5]) for t in plan["layers"][at]["transfers"]]
        copies = [tuple(int(x) for x in c) for c in plan["layers"][at]["local_copies"] if int(c[0]) == me]
        moves[layer] = plan_layer(old[layer], new[layer], transfers, copies, me, rows)
    if reserve is not None:
        reserve(max(len(m.buffered) for m in moves.values()))
    for layer in work:
        m = moves[layer]
        w = weights[layer]
        o, n = old[layer], new[layer]
        buf = buffer_rows(layer, m.buffered)
        direct, back = [], []
        for s_row, d_row, via in m.local:
            for i, t in enumerate(w):
                (buf[d_row][i] if via else t[d_row]).copy_(t[s_row])
            (back if via else direct).append(d_row)
        row_bytes = sum(int(t[0].numel()) * t.element_size() for t in w) if len(w) and w[0].shape[0] else 0
        for phase in range(len(m.rounds)):  # the same number on every rank
            comm.set_transfer_context(o, layer, new_indices=n, kept_rows_copied=True)
            for src, dst, row, expert, via in m.rounds[phase]:
                if src == me:
                    comm.add_send(None, dst, expert)
                    continue
                stats["bytes_received"] += row_bytes
                comm.add_recv(buf[row] if via else [t[row] for t in w], src, expert)
                (back if via else direct).append(row)
            try:
                comm.execute()
            except Exception as e:
                raise type(e)(f"{e}; rank {me}: {name(layer)} (round {phase + 1} of its reads) was being "
                              f"written straight into weight rows {sorted(direct)} (their contents are "
                              f"not valid now), layers after it are untouched") from e
        for d_row in back:
            for i, t in enumerate(w):
                t[d_row].copy_(buf[d_row][i])
        for s_row, d_row in m.news:
            for t in w:
                t[d_row].copy_(t[s_row])
        stats["direct_rows"] += len(direct)
        stats["buffered_rows"] += len(back)
        stats["local_copies"] += m.copies
        stats["layers"] += 1
    stats["seconds"] = time.perf_counter() - t0
    return stats
