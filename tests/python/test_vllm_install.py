"""eplbx.vllm.install(): switching eplbx on in an installed vLLM.

Without vLLM: the plugin entry point is found next to the package, a vLLM laid out otherwise
is named (version and what was not found) and nothing is patched, options from the
environment. With vLLM (an interpreter in EPLBX_VLLM_PYTHON, or this one if it imports vllm):
vLLM's own rearrangement code on eplbx, switched on through vLLM's plugin loading, every call
pattern, every row checked (bench/python/bench_vllm_rearrange.py --check)."""
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fake_vllm(root, version, files):
    """A package named vllm laid out as `files` says (path -> source)."""
    files = {"vllm/__init__.py": f"__version__ = {version!r}\n", **files}
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        for d in range(len(path.split("/")) - 1):  # every folder a package
            init = os.path.join(root, *path.split("/")[:d + 1], "__init__.py")
            if not os.path.exists(init):
                open(init, "w").close()
        with open(full, "w") as f:
            f.write(textwrap.dedent(text))


def run_python(code, pythonpath, env=None, python=sys.executable, timeout=120):
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath + [env.get("PYTHONPATH", "")])
    return subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout)


PER_TENSOR_COMMUNICATOR = """
    # vLLM's first per-layer communicator interface: per tensor, no expert ids.
    class EplbCommunicator:
        def add_send(self, tensor, dst_rank): ...
        def add_recv(self, tensor, src_rank): ...
        def execute(self): ...
    def create_eplb_communicator(group_coordinator, backend, expert_weights):
        raise ValueError(f"Unknown EPLB communicator backend: {backend}")
"""
PARALLEL_CONFIG = """
    from typing import Literal
    EPLBCommunicatorBackend = Literal["torch_nccl", "torch_gloo"]
    class EPLBConfig: ...
    class ParallelConfig: ...
"""
TRY_INSTALL = """
    import eplbx.vllm as ev
    try:
        ev.install()
        print("installed")
    except ev.VllmLayoutError as e:
        print("ERROR", e)
    import vllm.distributed.eplb.eplb_communicator as c
    print("patched" if hasattr(c.create_eplb_communicator, "_eplbx_original") else "untouched")
"""


class InstallTest(unittest.TestCase):
    def setUp(self):
        import eplbx
        self.package_parent = os.path.dirname(os.path.dirname(os.path.abspath(eplbx.__file__)))

    def test_the_plugin_entry_point_is_found_next_to_the_package(self):
        out = run_python("""
            from importlib.metadata import entry_points
            eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "eplbx"]
            print(len(eps), eps[0].value, eps[0].load().__name__)
        """, [self.package_parent])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.split(), ["1", "eplbx.vllm:_plugin", "_plugin"])

    def test_a_vllm_laid_out_otherwise_is_named_and_nothing_is_patched(self):
        with tempfile.TemporaryDirectory() as root:
            fake_vllm(root, "0.9.1", {
                "vllm/config/parallel.py": PARALLEL_CONFIG,
                "vllm/distributed/eplb/eplb_communicator.py": PER_TENSOR_COMMUNICATOR,
            })
            out = run_python(TRY_INSTALL, [root, self.package_parent])
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(lines[-1], "untouched")
        self.assertTrue(lines[0].startswith("ERROR eplbx.vllm.install(): vLLM 0.9.1 is not laid out"), lines)
        self.assertIn("create_eplb_communicator('group_coordinator', 'backend', 'expert_weights', "
                      "'expert_buffer') (this vLLM has create_eplb_communicator('group_coordinator', "
                      "'backend', 'expert_weights'))", lines[0])
        self.assertIn("EplbCommunicator.set_transfer_context", lines[0])
        self.assertIn("Nothing was changed", lines[0])

    def test_a_vllm_without_the_eplb_modules_is_named(self):
        with tempfile.TemporaryDirectory() as root:
            fake_vllm(root, "0.4.0", {})
            out = run_python("""
                import eplbx.vllm as ev
                try:
                    ev.install()
                except ev.VllmLayoutError as e:
                    print(e)
                ev._plugin()  # vLLM's plugin hook: a warning, vLLM itself goes on
                print("plugin returned")
            """, [root, self.package_parent])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("vLLM 0.4.0 is not laid out as eplbx expects", out.stdout)
        self.assertIn("module vllm.config.parallel (ModuleNotFoundError", out.stdout)
        self.assertIn("module vllm.distributed.eplb.eplb_communicator", out.stdout)
        self.assertIn("plugin returned", out.stdout)
        self.assertIn("vLLM 0.4.0 is not laid out as eplbx expects", out.stderr)  # the warning

    def test_no_vllm_at_all_is_named(self):
        with tempfile.TemporaryDirectory() as root:
            out = run_python("""
                import sys
                sys.modules["vllm"] = None  # as if not installed
                import eplbx.vllm as ev
                try:
                    ev.install()
                except ev.VllmLayoutError as e:
                    print(e)
            """, [root, self.package_parent])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("eplbx.vllm.install(): vLLM is not importable here", out.stdout)

    def test_a_failed_validator_rebuild_puts_every_change_back(self):
        # Issue 33, item 7: install() used to widen the communicator Literal before a schema
        # rebuild that could fail, leaving vLLM half patched.
        with tempfile.TemporaryDirectory() as root:
            fake_vllm(root, "0.33.0", {
                "vllm/config/parallel.py": """
                    import dataclasses
                    from typing import Literal, Optional
                    EPLBCommunicatorBackend = Literal["torch_nccl", "nixl"]
                    @dataclasses.dataclass
                    class EPLBConfig:
                        communicator: Optional[EPLBCommunicatorBackend] = None
                    class ParallelConfig: ...
                """,
                "vllm/distributed/eplb/eplb_communicator.py": """
                    class EplbCommunicator:
                        def set_transfer_context(self, *a): ...
                    def create_eplb_communicator(group_coordinator, backend, expert_weights,
                                                 expert_buffer):
                        raise ValueError(backend)
                """,
                "vllm/distributed/eplb/rebalance_execute.py": """
                    def rearrange_expert_weights_inplace(old_global_expert_indices,
                            new_global_expert_indices, expert_weights, expert_buffer, ep_group,
                            communicator, is_profile=False, rank_mapping=None): ...
                """,
                # A pydantic that cannot rebuild ParallelConfig (the second) with the new names.
                "pydantic/dataclasses.py": """
                    calls = []
                    def rebuild_dataclass(cls, force=False):
                        import vllm.config.parallel as p
                        calls.append(cls.__name__)
                        if cls.__name__ == "ParallelConfig" and "eplbx" in str(p.EPLBCommunicatorBackend):
                            raise TypeError("schema for ParallelConfig cannot be built")
                """,
            })
            out = run_python(textwrap.dedent(TRY_INSTALL) + textwrap.dedent("""
                import typing
                import vllm.config.parallel as p
                print(typing.get_args(p.EPLBCommunicatorBackend))
                print(p.EPLBConfig.__annotations__["communicator"])
                print(p.EPLBConfig.__dataclass_fields__["communicator"].type)
                import pydantic.dataclasses
                print(pydantic.dataclasses.calls)
                ev._plugin()
                print("plugin returned")
            """), [root, self.package_parent])
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertTrue(lines[0].startswith("ERROR eplbx.vllm.install(): rebuilding vLLM 0.33.0's "
                                            "config validators with communicator 'eplbx' failed "
                                            "(TypeError: schema for ParallelConfig"), lines)
        self.assertIn("Every change was put back", lines[0])
        self.assertEqual(lines[1], "untouched")
        self.assertEqual(lines[2], "('torch_nccl', 'nixl')")
        self.assertNotIn("eplbx", lines[3])
        self.assertNotIn("eplbx", lines[4])
        # Rebuilt with the new names, failed, then both rebuilt again with the old ones.
        self.assertEqual(lines[5], "['EPLBConfig', 'ParallelConfig', 'EPLBConfig', 'ParallelConfig']")
        self.assertEqual(lines[-1], "plugin returned")
        self.assertIn("Every change was put back", out.stderr)  # the plugin's warning

    def test_the_plugin_never_lets_an_exception_into_vllms_loader(self):
        out = run_python("""
            import eplbx.vllm as ev
            def broken():
                raise KeyError("something vLLM changed")
            ev.install = broken
            ev._plugin()
            print("plugin returned")
        """, [self.package_parent])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "plugin returned")
        self.assertIn("switching eplbx on failed (KeyError: 'something vLLM changed'); vLLM goes "
                      "on with its own communicators", out.stderr)

    def test_options_from_the_environment(self):
        from eplbx import InvalidArgumentError
        from eplbx.vllm import options_from_env

        self.assertEqual(options_from_env({}), {})
        self.assertEqual(options_from_env({"EPLBX_TIMEOUT_S": "30", "EPLBX_TRANSPORT": "ucx",
                                           "EPLBX_PATHS": "shm,ucx", "EPLBX_DEFER_SETUP": "1"}),
                         {"timeout_s": 30.0, "transport": "ucx", "paths": "shm,ucx", "defer_setup": True})
        for env, said in (({"EPLBX_TIMEOUT_S": "soon"}, "EPLBX_TIMEOUT_S='soon' does not parse"),
                          ({"EPLBX_TIMEOUT_S": "inf"}, "every wait has a deadline"),
                          ({"EPLBX_TIMEOUT_S": "-3"}, "outside"),
                          ({"EPLBX_TIMEOUT_S": "nan"}, "outside"),
                          ({"EPLBX_DEFER_SETUP": "yes"}, "EPLBX_DEFER_SETUP='yes' does not parse as the "
                                                         "defer_setup option (0 or 1)")):
            with self.assertRaises(InvalidArgumentError) as cm:
                options_from_env(env)
            self.assertIn(said, str(cm.exception))


def vllm_python():
    """An interpreter that imports vLLM, or None and why not."""
    candidates = [os.environ["EPLBX_VLLM_PYTHON"]] if os.environ.get("EPLBX_VLLM_PYTHON") else []
    candidates += [os.path.join(ROOT, ".cache", "vllm-venv", "bin", "python"), sys.executable]
    tried = []
    for python in candidates:
        if not os.path.exists(python):
            tried.append(f"{python} (absent)")
            continue
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
        if probe.returncode == 0:
            return python, ""
        tried.append(f"{python} ({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'fails'})")
    return None, "; ".join(tried)


class InstalledVllmTest(unittest.TestCase):
    def test_vllms_own_rearrangement_runs_on_eplbx(self):
        python, why = vllm_python()
        if python is None:
            msg = (f"SKIPPED: vLLM is not importable by {why}; scripts/vllm-env.sh makes "
                   ".cache/vllm-venv (or set EPLBX_VLLM_PYTHON)")
            print(msg, file=sys.stderr)
            self.skipTest(msg)
        import eplbx
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(eplbx.__file__)))
        out = subprocess.run([python, os.path.join(ROOT, "bench", "python", "bench_vllm_rearrange.py"), "--check"],
                             capture_output=True, text=True, env=env, timeout=600)
        self.assertEqual(out.returncode, 0, out.stdout[-4000:] + out.stderr[-4000:])
        self.assertIn('"cli": "ok"', out.stdout)


if __name__ == "__main__":
    unittest.main()
