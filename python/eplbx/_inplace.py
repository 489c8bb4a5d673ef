"""Moving expert rows in place, straight into the weight rows where that is safe: the one
executor behind vLLM's rearrangement on eplbx (EplbxCommunicator.rearrange) and SGLang's
expert-location update on eplbx (eplbx.sglang). Both engines keep every rank's experts as rows
of a few tensors per layer (w13, w2, scales...) and want them updated in the same storage.

Per layer, every rank computes the same transfers (eplbx.migrate: fewest, best-sourced; slots
of ranks that take no part are -1 in both maps, so nothing is read from or written to them).
`plan_layer` (pure) orders this rank's share:
- local moves from old rows first, into free rows directly, into rows still needed through a
  buffer row; afterwards no row's old content is needed here any more ("kept rows copied");
- then up to two rounds of reads, split alike on every rank: in round 1 rows no peer reads
  receive their experts directly; in round 2, once every round-1 read is done, the rows peers
  read in round 1, unless the source row is itself a round-2 target (those go through a
  buffer row in round 1);
- then the buffer rows into their weight rows, then second replicas of rows just received.
Only the buffered rows need memory beside the weights: usually few, never a copy of the layer
unless every row is in a cycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LayerMoves:
    """One layer's moves on one rank (plan_layer)."""

    local: list = field(default_factory=list)  # (src_row, dst_row, via_buffer), old rows
    rounds: list = field(default_factory=lambda: [[], []])  # (src, dst, row, expert, via_buffer)
    second_round: bool = False  # the same on every rank
    news: list = field(default_factory=list)  # (src_row, dst_row): replicas of rows received
    buffered: list = field(default_factory=list)  # rows that go through a buffer row, in order
    copies: int = 0


def plan_layer(o, n, transfers, copies, me: int, rows: int) -> LayerMoves:
    """Pure: the order of one layer's moves on rank `me`. `o`, `n`: the layer's old and new
    phy2log (ranks x rows slots, -1 for a slot that holds nothing or takes no part);
    `transfers`: (src, src_row, dst, dst_row, expert) of every rank; `copies`: this rank's
    local copies (rank, src_row, dst_row, expert, from_new)."""
    moves = LayerMoves(copies=len(copies))

    def first_row(rank, expert):  # the row a peer's READ of `expert` reads on `rank`
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
    second = [t for t in transfers if (t[2], t[3]) in served]
    targets = {(t[2], t[3]) for t in second}
    second = {t for t in second if (t[0], first_row(t[0], t[4])) not in targets}
    moves.second_round = bool(second)
    for t in transfers:
        src, _, dst, row, expert = t
        if src != me and dst != me:
            continue
        phase = 1 if t in second else 0
        via = dst == me and phase == 0 and (me, row) in served
        moves.rounds[phase].append((src, dst, row, expert, via))
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
        for phase in (0, 1):
            if phase == 1 and not m.second_round:
                break  # the same on every rank
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
