"""eplbx.sglang: SGLang's expert-weight update on eplbx.

Without SGLang: an SGLang laid out otherwise (or none) is named and nothing is patched; the
options from the environment; SGLang's algorithm tables from a placement; the live ranks from
SGLang's active-rank flags. With SGLang (an interpreter in EPLBX_SGLANG_PYTHON, or
.cache/sglang-venv made by scripts/sglang-env.sh, or this one if it imports SGLang): SGLang's
own entry point (ExpertLocationUpdater.update with SGLang's ExpertLocationMetadata) on ranks
over gloo, every row checked, SGLang's canary on eplbx's side, a dead-rank update with the
missing experts checked exactly, and eplbx's placement through SGLang's own algorithm
selection (bench/python/bench_sglang_update.py --check)."""
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code, pythonpath, python=sys.executable, timeout=120, env=None):
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath + [env.get("PYTHONPATH", "")])
    return subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def package_root():
    import eplbx

    return os.path.dirname(os.path.dirname(os.path.abspath(eplbx.__file__)))


def fake_sglang(root, files):
    files = {"sglang/__init__.py": "__version__ = '0.4.0'\n", **files}
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        for d in range(len(path.split("/")) - 1):
            init = os.path.join(root, *path.split("/")[:d + 1], "__init__.py")
            if not os.path.exists(init):
                open(init, "w").close()
        with open(full, "w") as f:
            f.write(textwrap.dedent(text))


TRY_INSTALL = """
    import eplbx.sglang as es
    try:
        es.install()
        print("installed")
    except es.SglangLayoutError as e:
        print("ERROR", e)
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    print("patched" if getattr(ExpertLocationUpdater.update, "_eplbx", False) else "untouched")
"""


class InstallWithoutSglangTest(unittest.TestCase):
    def test_an_sglang_laid_out_otherwise_is_named_and_nothing_is_patched(self):
        with tempfile.TemporaryDirectory() as root:
            fake_sglang(root, {
                "sglang/srt/eplb/expert_location_updater.py": """
                    class ExpertLocationUpdater:
                        def update(self, routed_experts_weights_of_layer, new_expert_location_metadata,
                                   update_layer_ids, nnodes, rank):  # no use_flat_topology
                            return {}
                """,
                "sglang/srt/eplb/expert_location.py": "def get_global_expert_location_metadata(): pass\n",
                "sglang/srt/elastic_ep/elastic_ep.py": "class ElasticEPStateManager: pass\n",
                "sglang/srt/eplb/eplb_algorithms/__init__.py": "def compute_algorithm(): pass\n",
            })
            out = run_python(TRY_INSTALL, [root, package_root()])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("SGLang 0.4.0 is not laid out", out.stdout)
            self.assertIn("update_layer_ids', 'nnodes', 'rank')", out.stdout)  # what this one has
            self.assertIn("eplb_algorithms.rebalance_experts", out.stdout)
            self.assertIn("Nothing was changed", out.stdout)
            self.assertTrue(out.stdout.strip().endswith("untouched"), out.stdout)

    def test_no_sglang_at_all_is_named(self):
        with tempfile.TemporaryDirectory() as root:
            out = run_python("""
                import eplbx.sglang as es
                try:
                    es.install()
                except es.SglangLayoutError as e:
                    print("ERROR", e)
            """, [root, package_root()])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("SGLang is not importable here", out.stdout)

    def test_options_from_the_environment(self):
        import eplbx
        import eplbx.sglang as es

        got = es._options_from_env({"EPLBX_TIMEOUT_S": "12", "EPLBX_PATHS": "cma",
                                    "SGLANG_EXPERT_LOCATION_UPDATER_CANARY": "true",
                                    "EPLBX_DEFER_SETUP": "1"})
        self.assertEqual(got, {"timeout_s": 12.0, "paths": "cma", "canary": True, "share": False})
        self.assertTrue(es._options_from_env({"EPLBX_SHARE_MEMORY": "1"})["share"])
        with self.assertRaisesRegex(eplbx.InvalidArgumentError, "EPLBX_SHARE_MEMORY='no' is not 0 or 1"):
            es._options_from_env({"EPLBX_SHARE_MEMORY": "no"})
        self.assertFalse(es._options_from_env({})["canary"])
        with self.assertRaisesRegex(eplbx.InvalidArgumentError, "EPLBX_TIMEOUT_S='soon'"):
            es._options_from_env({"EPLBX_TIMEOUT_S": "soon"})
        with self.assertRaisesRegex(eplbx.InvalidArgumentError, "every wait has a deadline"):
            es._options_from_env({"EPLBX_TIMEOUT_S": "inf"})

    def test_sglangs_tables_from_a_placement(self):
        import eplbx.sglang as es

        phy2log, log2phy, count = es.replicas_of([[2, 0, 2, 1, 0, 2]], experts=4)
        self.assertEqual(phy2log.tolist(), [[2, 0, 2, 1, 0, 2]])
        self.assertEqual(log2phy.tolist(), [[[1, 4, -1], [3, -1, -1], [0, 2, 5], [-1, -1, -1]]])
        self.assertEqual(count.tolist(), [[2, 1, 3, 0]])

    def test_live_ranks_from_sglangs_flags(self):
        import eplbx
        import eplbx.sglang as es

        self.assertEqual(es.live_ranks(3, [1, 0, 1, 0, 0]), [True, False, True])  # reserved slots past the world
        with self.assertRaisesRegex(eplbx.InvalidArgumentError, "name 2 ranks for a world of 3"):
            es.live_ranks(3, [1, 1])

    def test_missing_experts_are_those_only_dead_ranks_held(self):
        import eplbx.sglang as es

        # 3 ranks x 2 rows. Rank 1 dies holding experts 1 and 3; expert 1 also lives on rank 2.
        old = np.array([[0, 2, 1, 3, 1, 4]], dtype=np.int32)
        new = np.array([[3, 1, 4, 0, 3, 2]], dtype=np.int32)
        o, n, missing = es.mask_dead(old, new, [True, False, True], rows=2, me=0)
        self.assertEqual(o.tolist(), [[0, 2, -1, -1, 1, 4]])
        self.assertEqual(n.tolist(), [[-1, 1, -1, -1, -1, 2]])  # 3 is gone; rank 1 takes no part
        self.assertEqual(missing, [[3]])
        self.assertEqual(es.mask_dead(old, new, [True, False, True], rows=2, me=2)[2], [[3]])
        self.assertEqual(es.mask_dead(old, new, [True, True, True], rows=2, me=0)[2], [[]])


def sglang_python():
    """An interpreter that imports SGLang's updater, or None and why not."""
    candidates = [os.environ["EPLBX_SGLANG_PYTHON"]] if os.environ.get("EPLBX_SGLANG_PYTHON") else []
    candidates += [os.path.join(ROOT, ".cache", "sglang-venv", "bin", "python"), sys.executable]
    tried = []
    for python in candidates:
        if not os.path.exists(python):
            tried.append(f"{python} (absent)")
            continue
        probe = subprocess.run([python, "-c", "import sglang.srt.eplb.expert_location_updater"],
                               capture_output=True, text=True, timeout=300)
        if probe.returncode == 0:
            return python, ""
        tried.append(f"{python} ({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'fails'})")
    return None, "; ".join(tried)


class WithSglangTest(unittest.TestCase):
    def test_sglangs_own_update_on_eplbx_every_row_right_dead_rank_included(self):
        python, why = sglang_python()
        if python is None:
            msg = (f"SKIPPED: SGLang is not importable by {why}; scripts/sglang-env.sh makes "
                   ".cache/sglang-venv (or set EPLBX_SGLANG_PYTHON)")
            print(msg, file=sys.stderr)
            self.skipTest(msg)
        env = dict(os.environ)
        env["PYTHONPATH"] = package_root()
        out = subprocess.run([python, os.path.join(ROOT, "bench", "python", "bench_sglang_update.py"), "--check"],
                             capture_output=True, text=True, env=env, timeout=600)
        self.assertEqual(out.returncode, 0, out.stdout[-4000:] + out.stderr[-4000:])
        self.assertIn('"errors": []', out.stdout)
        self.assertIn('"dead_missing_expected"', out.stdout)

    def test_sglangs_layout_is_what_install_expects(self):
        python, why = sglang_python()
        if python is None:
            self.skipTest(f"SKIPPED: SGLang is not importable by {why}")
        out = run_python("""
            import eplbx.sglang as es
            print(es.install(), es.install())  # idempotent
            from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
            from sglang.srt.eplb import eplb_algorithms
            print(ExpertLocationUpdater.update is es.update,
                  eplb_algorithms.compute_algorithm("eplbx", None, 1),
                  eplb_algorithms.compute_algorithm("auto", None, 1))
            import argparse
            from sglang.srt.server_args import ServerArgs
            parser = argparse.ArgumentParser()
            ServerArgs.add_cli_args(parser)  # `sglang serve` takes the name
            print("cli", parser.parse_args(["--model-path", "m", "--enable-eplb",
                                            "--eplb-algorithm", "eplbx"]).eplb_algorithm)
            es.uninstall()
            print(ExpertLocationUpdater.update is es.update)
        """, [package_root()], python=python)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("0.5.23 0.5.23", out.stdout)
        self.assertIn("True EplbxAlgorithm('eplbx') EplbAlgorithm.deepseek", out.stdout)
        self.assertIn("cli eplbx", out.stdout)
        self.assertTrue(out.stdout.strip().endswith("False"), out.stdout)

    def test_sglangs_plugin_loading_switches_eplbx_on(self):
        python, why = sglang_python()
        if python is None:
            self.skipTest(f"SKIPPED: SGLang is not importable by {why}")
        code = """
            import logging
            logging.basicConfig(level=logging.WARNING)
            from sglang.srt.plugins import load_plugins
            load_plugins()  # what every SGLang scheduler process does first
            import eplbx.sglang as es
            from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
            from sglang.srt.eplb import eplb_algorithms
            print("updater", ExpertLocationUpdater.update is es.update)
            print("algorithm", eplb_algorithms.compute_algorithm("eplbx_balanced", 8, 2))
        """
        for flag, updater in (("1", "True"), ("0", "False"), (None, "False")):
            env = {k: v for k, v in os.environ.items() if k != "EPLBX_SGLANG_UPDATER"}
            if flag is not None:
                env["EPLBX_SGLANG_UPDATER"] = flag
            out = run_python(code, [package_root()], python=python, env=env)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn(f"updater {updater}", out.stdout)
            self.assertIn("algorithm EplbxAlgorithm('eplbx_balanced')", out.stdout)
        env = dict(os.environ, EPLBX_SGLANG_UPDATER="yes")
        out = run_python(code, [package_root()], python=python, env=env)
        self.assertEqual(out.returncode, 0, out.stderr)  # a warning, SGLang goes on
        self.assertIn("EPLBX_SGLANG_UPDATER='yes' is not 0 or 1; SGLang keeps its own updater", out.stderr)
        self.assertIn("updater False", out.stdout)
        self.assertIn("algorithm EplbxAlgorithm('eplbx_balanced')", out.stdout)


if __name__ == "__main__":
    unittest.main()
