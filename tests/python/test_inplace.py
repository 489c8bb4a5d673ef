"""eplbx._inplace: the order of one layer's in-place moves (the executor behind vLLM's
rearrangement and SGLang's update on eplbx), over thousands of random layers. Pure: the rows
are simulated, no transfer runs (test_vllm_communicator and the SGLang benchmark's --check run
the same executor between processes)."""
import random
import unittest

import numpy as np

from eplbx import _inplace, migrate
from eplbx.sglang import mask_dead


def random_layer(rng, ranks, rows, experts):
    m = list(range(experts)) + [rng.randrange(experts) for _ in range(ranks * rows - experts)]
    rng.shuffle(m)
    return np.array(m, dtype=np.int32)


def simulate(o, n, ranks, rows, moves_of, rounds_of):
    """Row contents after every rank runs its moves: local moves first (reading old rows,
    through the buffer where said), then each round (every read of a round sees the contents
    before the round's writes; a row written in a round must not be read in it or later),
    then buffer rows into place, then replicas of rows received. Returns (contents, errors)."""
    rows_now = o.copy()
    errors = []
    buffers = {}
    for me in range(ranks):
        m = moves_of[me]
        for s_row, d_row, via in m.local:
            if via:
                buffers[(me, d_row)] = rows_now[me * rows + s_row]
        for s_row, d_row, via in m.local:
            if not via:
                rows_now[me * rows + d_row] = o[me * rows + s_row]
    written = set()
    for k in range(rounds_of):
        snapshot = rows_now.copy()
        for me in range(ranks):
            for src, dst, row, expert, via in moves_of[me].rounds[k] if k < len(moves_of[me].rounds) else []:
                if dst != me:
                    continue
                src_row = int(np.flatnonzero(o[src * rows:(src + 1) * rows] == expert)[0])
                if (src, src_row) in written:
                    errors.append(f"round {k}: rank {me} reads rank {src} row {src_row} after it was overwritten")
                got = snapshot[src * rows + src_row]
                if via:
                    buffers[(me, row)] = got
                else:
                    rows_now[me * rows + row] = got
                    written.add((me, row))
    for (me, row), value in buffers.items():
        rows_now[me * rows + row] = value
    for me in range(ranks):
        for s_row, d_row in moves_of[me].news:
            rows_now[me * rows + d_row] = rows_now[me * rows + s_row]
    return rows_now, errors


class InplaceTest(unittest.TestCase):
    def check_world(self, rng, ranks, rows, experts, max_rounds, live=None):
        o = random_layer(rng, ranks, rows, experts)
        n = random_layer(rng, ranks, rows, experts)
        if rng.random() < 0.3:  # mostly the same: a few slots change
            n = o.copy()
            for _ in range(rng.randrange(1, 4)):
                n[rng.randrange(ranks * rows)] = rng.randrange(experts)
        missing = [[] for _ in range(ranks)]
        self.original = (o.copy(), n.copy())
        if live is not None:
            masked = [mask_dead(o[None], n[None], live, rows, me) for me in range(ranks)]
            o, n = masked[0][0][0], masked[0][1][0]
            missing = [m[2][0] for m in masked]
        plan = migrate(o[None], n[None], ranks=ranks)["layers"][0]
        transfers = [tuple(int(x) for x in t[:5]) for t in plan["transfers"]]
        moves = {}
        for me in range(ranks):
            copies = [tuple(int(x) for x in c) for c in plan["local_copies"] if int(c[0]) == me]
            moves[me] = _inplace.plan_layer(o, n, transfers, copies, me, rows, max_rounds)
        counts = {len(m.rounds) for m in moves.values()}
        self.assertEqual(len(counts), 1, "ranks disagree on the number of rounds")
        self.assertLessEqual(counts.pop(), max_rounds)
        got, errors = simulate(o, n, ranks, rows, moves, max(len(m.rounds) for m in moves.values()))
        self.assertEqual(errors, [])
        for s in range(ranks * rows):
            if n[s] >= 0:
                self.assertEqual(int(got[s]), int(n[s]), f"slot {s}: holds {got[s]}, wants {n[s]}")
        for me in range(ranks):  # buffered rows are few: never more than the rows received
            received = sum(1 for r in moves[me].rounds for t in r if t[1] == me)
            self.assertLessEqual(len(moves[me].buffered), received + len(moves[me].local))
        return moves, missing, o, n

    def test_every_row_lands_and_no_row_is_overwritten_before_its_readers_read_it(self):
        rng = random.Random(1)
        for world in range(3000):
            ranks, rows = rng.randrange(1, 6), rng.randrange(1, 6)
            experts = rng.randrange(1, ranks * rows + 1)
            self.check_world(rng, ranks, rows, experts, rng.choice([1, 2, 3, 4, 8]))

    def test_dead_ranks_are_neither_read_nor_written_and_missing_experts_are_exact(self):
        rng = random.Random(2)
        for world in range(1500):
            ranks, rows = rng.randrange(2, 6), rng.randrange(1, 5)
            experts = rng.randrange(1, ranks * rows + 1)
            live = [True] * ranks
            for r in rng.sample(range(ranks), rng.randrange(1, ranks)):
                live[r] = False
            moves, missing, o, n = self.check_world(rng, ranks, rows, experts, 4, live)
            o0, n0 = self.original
            for me in range(ranks):
                for r in moves[me].rounds:
                    for src, dst, *_ in r:
                        self.assertTrue(live[src] and live[dst], (src, dst, live))
                if not live[me]:
                    continue
                # Independently: what `me` needs that no live rank held, each once, row order.
                held = {int(o0[s]) for s in range(ranks * rows) if live[s // rows]}
                want = []
                for row in range(rows):
                    e = int(n0[me * rows + row])
                    if e not in held and e not in want:
                        want.append(e)
                self.assertEqual(missing[me], want)

    def test_more_rounds_buffer_fewer_rows(self):
        rng = random.Random(3)
        ranks, rows, experts = 8, 36, 256
        o = random_layer(rng, ranks, rows, experts)
        n = random_layer(rng, ranks, rows, experts)
        plan = migrate(o[None], n[None], ranks=ranks)["layers"][0]
        transfers = [tuple(int(x) for x in t[:5]) for t in plan["transfers"]]
        buffered = {}
        for max_rounds in (2, 4, 8):
            _, chosen, _ = _inplace.schedule(o, transfers, rows, max_rounds)
            buffered[max_rounds] = len(chosen)
        self.assertGreaterEqual(buffered[2], buffered[4])
        self.assertGreaterEqual(buffered[4], buffered[8])


if __name__ == "__main__":
    unittest.main()
