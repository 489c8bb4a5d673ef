"""eplbx.plan / eplbx.migrate from Python: numpy in, numpy out, typed errors."""
import unittest

import numpy as np

import eplbx

# DeepSeek's published example (FIELD-NOTES): 2 layers x 12 experts, 16 slots, 4 groups, 2 nodes, 8 ranks.
WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                   [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]], dtype=np.float64)
PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


class PlanTest(unittest.TestCase):
    def test_deepseek_reference_vector(self):
        p = eplbx.plan(WEIGHT, slots=16, ranks=8, nodes=2, groups=4)
        self.assertIsInstance(p.phy2log, np.ndarray)
        self.assertEqual(p.phy2log.dtype, np.int32)
        self.assertEqual(p.phy2log.tolist(), PHY2LOG)
        self.assertEqual(p.logcnt.tolist(), LOGCNT)
        self.assertEqual(p.log2phy.shape, (2, 12, 2))
        for layer in range(2):
            for expert in range(12):
                slots = [s for s in p.log2phy[layer, expert] if s >= 0]
                self.assertEqual(len(slots), LOGCNT[layer][expert])
                for s in slots:
                    self.assertEqual(PHY2LOG[layer][s], expert)
        self.assertGreater(p.balancedness, 0.5)
        self.assertEqual(p.balancedness_per_layer.shape, (2,))

    def test_incremental_with_previous_reports_moves(self):
        rng = np.random.default_rng(1)
        load = rng.pareto(1.0, size=(3, 32)) + 1
        first = eplbx.plan(load, slots=40, ranks=8)
        drifted = load * np.exp(rng.normal(0, 0.3, size=load.shape))
        second = eplbx.plan(drifted, slots=40, ranks=8, policy="incremental", previous=first.phy2log)
        self.assertEqual(set(second.moves), {"remote_copies", "local_copies", "unchanged_slots"})
        self.assertGreater(second.moves["unchanged_slots"], 0)

    def test_errors_are_typed(self):
        with self.assertRaises(eplbx.InvalidArgumentError) as e:
            eplbx.plan(WEIGHT, slots=15, ranks=8)
        self.assertIsInstance(e.exception, ValueError)
        self.assertIn("15", str(e.exception))
        with self.assertRaises(eplbx.InvalidArgumentError):
            eplbx.plan(WEIGHT, slots=16, ranks=8, policy="greedy")
        with self.assertRaises(eplbx.EplbxError):
            eplbx.plan(np.array([1.0, 2.0]), slots=2, ranks=1)
        with self.assertRaises(eplbx.InvalidArgumentError):
            eplbx.plan(-WEIGHT, slots=16, ranks=8)

    def test_ids_and_sizes_that_do_not_fit_are_errors_not_casts(self):
        # Issue 17, item 12: float maps were truncated, ids + 2**32 wrapped, and
        # bytes_per_expert=2**63 made byte totals 0.
        old = np.array([[0, 1, 2, 3]])
        for bad, says in ((old.astype(np.float32), "dtype float32"), (old + 0.9, "dtype float64"),
                          (old + 2**32, "expert id 4294967296"), (old.astype(bool), "dtype bool"),
                          (old.astype(np.uint64) + 2**63, "expert id 9223372036854775808")):
            with self.assertRaises(eplbx.InvalidArgumentError) as ctx:
                eplbx.migrate(bad, old, ranks=2)
            self.assertIn(says, str(ctx.exception))
        with self.assertRaises(eplbx.InvalidArgumentError) as ctx:
            eplbx.migrate(old, old, ranks=2, bytes_per_expert=2**63)
        self.assertIn("the limit is 1099511627776", str(ctx.exception))
        load = np.ones((1, 4))
        with self.assertRaises(eplbx.InvalidArgumentError):
            eplbx.plan(load, slots=4, ranks=2, policy="incremental", previous=old + 0.5)

    def test_migrate(self):
        old = np.array([[0, 1, 2, 3]], dtype=np.int32)
        new = np.array([[3, 1, 2, 0]], dtype=np.int32)
        m = eplbx.migrate(old, new, ranks=2, bytes_per_expert=1000)
        self.assertEqual(m["remote_transfers"], 2)
        t = m["layers"][0]["transfers"]
        self.assertEqual(t.shape, (2, 6))
        moved = sorted((int(r[2]), int(r[4])) for r in t)  # (dst, expert)
        self.assertEqual(moved, [(0, 3), (1, 0)])
        self.assertEqual(m["bytes_moved"], 2000)


class BalancerTest(unittest.TestCase):
    """The EPLB loop from Python: the Balancer decides, commit() hands over the new maps."""

    def test_rebalances_when_due_and_hands_over_the_maps(self):
        rng = np.random.default_rng(3)
        uniform = eplbx.plan(np.ones((2, 12)), slots=16, ranks=4)
        b = eplbx.Balancer(uniform.phy2log, experts=12, ranks=4, policy="balanced", window=10,
                           interval=10)
        hot = WEIGHT * rng.uniform(0.5, 1.5, WEIGHT.shape)
        maps = uniform.phy2log.copy()
        began = 0
        for step in range(30):
            s = b.step(hot)
            began += s["began"]
            for layer, new_map in b.commit():
                self.assertEqual(new_map.shape, (16,))
                maps[layer] = new_map
            self.assertEqual(b.phy2log.tolist(), maps.tolist())
        self.assertGreaterEqual(began, 1)
        report = b.report
        self.assertEqual(report["steps"], 30)
        self.assertEqual(report["considered"], 3)
        self.assertGreater(report["rebalances"][0]["window_after"],
                           report["rebalances"][0]["window_before"])
        # Balanced on the load it saw: the next due steps skip or gain nothing.
        self.assertGreater(b.step(hot)["balancedness"], 0.9)
        text = b.prometheus()
        self.assertIn("eplbx_rebalances_total", text)
        # Names in the engines' style (issue 32, item 5).
        self.assertRegex(text, r"\neplbx_balancedness 0\.9\d*\n")
        self.assertIn(f"eplbx_rebalance_seconds_count {len(report['rebalances'])}\n", text)
        self.assertIn("# TYPE eplbx_bytes_moved_total counter", text)

    def test_balancer_options_out_of_range_are_refused_as_the_cli_refuses_them(self):
        # Issue 33, item 7: NaN, inf and out-of-range min_gain, skip_above and tolerance were
        # accepted; the library's one check now refuses them for every caller.
        uniform = eplbx.plan(np.ones((2, 12)), slots=16, ranks=4)
        for kwargs, said in (({"min_gain": float("nan")}, "min_gain is nan: expected a number in [0, 1]"),
                             ({"min_gain": -0.1}, "min_gain is -0.1: expected a number in [0, 1]"),
                             ({"skip_above": float("inf")}, "skip_above is inf: expected a number in [0, 2]"),
                             ({"skip_above": 2.5}, "skip_above is 2.5"),
                             ({"tolerance": float("nan")}, "tolerance is nan"),
                             ({"tolerance": 1.5}, "tolerance is 1.5: expected a number in [0, 1]")):
            with self.assertRaises(eplbx.InvalidArgumentError, msg=str(kwargs)) as e:
                eplbx.Balancer(uniform.phy2log, experts=12, ranks=4, **kwargs)
            self.assertIn(said, str(e.exception))
        eplbx.Balancer(uniform.phy2log, experts=12, ranks=4, min_gain=0.0, skip_above=2.0, tolerance=1.0)

    def test_bad_counts_are_named(self):
        uniform = eplbx.plan(np.ones((2, 12)), slots=16, ranks=4)
        b = eplbx.Balancer(uniform.phy2log, experts=12, ranks=4)
        with self.assertRaises(eplbx.InvalidArgumentError) as e:
            b.step(np.ones((3, 12)))
        self.assertIn("layers x experts array (2 x 12)", str(e.exception))
        bad = np.ones((2, 12))
        bad[1, 4] = -1
        with self.assertRaises(eplbx.InvalidArgumentError):
            b.step(bad)
        self.assertEqual(b.report["steps"], 0)


if __name__ == "__main__":
    unittest.main()
