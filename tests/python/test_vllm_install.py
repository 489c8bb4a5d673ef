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


# vLLM 0.33's config and policy registry, as far as install() touches them.
VLLM_033_PARALLEL = """
    import dataclasses
    from typing import Literal, Optional
    EPLBCommunicatorBackend = Literal["torch_nccl", "nixl"]
    EPLBPolicyOption = Literal["default"]
    @dataclasses.dataclass
    class EPLBConfig:
        policy: EPLBPolicyOption = "default"
        communicator: Optional[EPLBCommunicatorBackend] = None
    class ParallelConfig: ...
"""
VLLM_033_POLICY = """
    from abc import ABC, abstractmethod
    class AbstractEplbPolicy(ABC):
        @classmethod
        @abstractmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None): ...
    class DefaultEplbPolicy(AbstractEplbPolicy):
        @classmethod
        def rebalance_experts(cls, *args, **kwargs): ...
    EPLB_POLICIES = {"default": DefaultEplbPolicy}
"""

# The communicator and rearrangement modules of vLLM 0.33, as far as install() checks them.
VLLM_033_EPLB = {
    "vllm/distributed/eplb/eplb_communicator.py": """
        class EplbCommunicator:
            def set_transfer_context(self, *a): ...
        def create_eplb_communicator(group_coordinator, backend, expert_weights, expert_buffer):
            raise ValueError(backend)
    """,
    "vllm/distributed/eplb/rebalance_execute.py": """
        def rearrange_expert_weights_inplace(old_global_expert_indices,
                new_global_expert_indices, expert_weights, expert_buffer, ep_group,
                communicator, is_profile=False, rank_mapping=None): ...
    """,
}


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
                "vllm/config/parallel.py": VLLM_033_PARALLEL,
                "vllm/distributed/eplb/policy/__init__.py": VLLM_033_POLICY,
                **VLLM_033_EPLB,
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
                import vllm.distributed.eplb.policy as policies
                print(sorted(policies.EPLB_POLICIES))
                ev._plugin()
                print("plugin returned")
            """), [root, self.package_parent])
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertTrue(lines[0].startswith("ERROR eplbx.vllm.install(): rebuilding vLLM 0.33.0's "
                                            "config validators with communicator 'eplbx', policy "
                                            "'eplbx', policy 'eplbx_balanced' failed "
                                            "(TypeError: schema for ParallelConfig"), lines)
        self.assertIn("Every change was put back", lines[0])
        self.assertEqual(lines[1], "untouched")
        self.assertEqual(lines[2], "('torch_nccl', 'nixl')")
        self.assertNotIn("eplbx", lines[3])
        self.assertNotIn("eplbx", lines[4])
        self.assertEqual(lines[6], "['default']")  # no policy registered either
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


def copies(old, new, ranks):
    """(rank, expert) pairs a rank gains: the experts it must read from another rank."""
    slots = old.shape[1] // ranks
    total = 0
    for layer in range(old.shape[0]):
        for r in range(ranks):
            had = set(old[layer, r * slots:(r + 1) * slots].tolist())
            total += len(set(new[layer, r * slots:(r + 1) * slots].tolist()) - had)
    return total


class PolicyTest(unittest.TestCase):
    """eplbx's placement as vLLM's EPLB policy (issue 32, item 2), without vLLM: the function
    the registered classes call, and the registration in a vLLM laid out as 0.33."""

    def drifting_loads(self, layers=4, experts=32, steps=2, seed=3):
        import numpy as np

        rng = np.random.default_rng(seed)
        base = rng.zipf(1.3, size=(layers, experts)).astype(np.float64).clip(max=200)
        return [base * rng.lognormal(0, 0.3, size=base.shape) for _ in range(steps)]

    def test_incremental_keeps_staying_experts_and_moves_less_than_replanning(self):
        import numpy as np
        from eplbx.vllm import rebalance_experts

        first, second = self.drifting_loads()
        old = rebalance_experts(first, 48, 4, 2, 8, None, policy="eplbx")  # none in force: balanced
        self.assertEqual(old.dtype, np.int64)
        self.assertEqual(old.shape, (4, 48))
        for layer in old:
            self.assertEqual(set(layer.tolist()), set(range(32)))  # every expert placed
        new = rebalance_experts(second, 48, 4, 2, 8, old, policy="eplbx")
        fresh = rebalance_experts(second, 48, 4, 2, 8, None, policy="eplbx_balanced")
        self.assertLess(copies(old, new, 8), copies(old, fresh, 8))
        kept = (old == new).mean()
        self.assertGreater(kept, 0.5)
        # Groups stay on nodes: 4 groups of 8 experts, 2 nodes of 24 slots.
        for layer in new:
            for node in range(2):
                groups = {int(e) // 8 for e in layer[node * 24:(node + 1) * 24]}
                self.assertLessEqual(len(groups), 3, layer)

    def test_what_vllms_contract_cannot_express_is_refused_by_name(self):
        import numpy as np
        from eplbx import InvalidArgumentError
        from eplbx.vllm import rebalance_experts

        load = np.ones((2, 16))
        for args, said in (((load, 20, 1, 1, 8), "num_replicas 20 is not a multiple of num_ranks 8"),
                           ((load, 16, 0, 1, 4), "num_groups"),
                           ((np.ones(16), 16, 1, 1, 4), "the load is 1-D")):
            with self.assertRaises(InvalidArgumentError) as e:
                rebalance_experts(*args)
            self.assertIn(said, str(e.exception))
        with self.assertRaises(InvalidArgumentError) as e:
            rebalance_experts(load, 16, 1, 1, 4, policy="default")
        self.assertIn("unknown vLLM EPLB policy 'default'", str(e.exception))
        # Groups that do not divide over the nodes: global, as vLLM's default does; a map in
        # force with empty slots (-1, vLLM's elastic EP) or of another shape: planned afresh.
        out = rebalance_experts(load, 16, 3, 2, 4, None)
        self.assertEqual(out.shape, (2, 16))
        holes = np.full((2, 16), -1)
        self.assertEqual(rebalance_experts(load, 16, 1, 1, 4, holes).shape, (2, 16))
        self.assertEqual(rebalance_experts(load, 16, 1, 1, 4, np.zeros((2, 12))).shape, (2, 16))

    def test_install_registers_the_policies_in_a_vllm_laid_out_as_0_33(self):
        with tempfile.TemporaryDirectory() as root:
            fake_vllm(root, "0.33.0", {
                "vllm/config/parallel.py": VLLM_033_PARALLEL,
                "vllm/distributed/eplb/policy/__init__.py": VLLM_033_POLICY,
                **VLLM_033_EPLB,
                "pydantic/dataclasses.py": """
                    def rebuild_dataclass(cls, force=False): ...
                """,
            })
            out = run_python("""
                import typing
                import torch
                import eplbx.vllm as ev
                ev.install()
                ev.install()  # idempotent
                import vllm.config.parallel as p
                import vllm.distributed.eplb.policy as policies
                print(typing.get_args(p.EPLBPolicyOption))
                print(typing.get_args(p.EPLBConfig.__annotations__["policy"]))
                print(sorted(policies.EPLB_POLICIES))
                cls = policies.EPLB_POLICIES["eplbx"]
                print(issubclass(cls, policies.AbstractEplbPolicy), cls.__name__)
                load = torch.arange(1, 33, dtype=torch.float32).reshape(2, 16)
                old = policies.EPLB_POLICIES["eplbx_balanced"].rebalance_experts(load, 24, 4, 2, 8)
                new = cls.rebalance_experts(load.flip(1), 24, 4, 2, 8, old)
                print(old.dtype, tuple(old.shape), new.dtype, tuple(new.shape))
                print(sorted(set(new[0].tolist())) == list(range(16)))
            """, [root, self.package_parent()])
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(lines[0], "('default', 'eplbx', 'eplbx_balanced')")
        self.assertEqual(lines[1], "('default', 'eplbx', 'eplbx_balanced')")
        self.assertEqual(lines[2], "['default', 'eplbx', 'eplbx_balanced']")
        self.assertEqual(lines[3], "True EplbxPolicy")
        self.assertEqual(lines[4], "torch.int64 (2, 24) torch.int64 (2, 24)")
        self.assertEqual(lines[5], "True")

    @staticmethod
    def package_parent():
        import eplbx
        return os.path.dirname(os.path.dirname(os.path.abspath(eplbx.__file__)))


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

    def test_vllms_config_takes_the_eplbx_policy_and_its_state_calls_it(self):
        python, why = vllm_python()
        if python is None:
            msg = (f"SKIPPED: vLLM is not importable by {why}; scripts/vllm-env.sh makes "
                   ".cache/vllm-venv (or set EPLBX_VLLM_PYTHON)")
            print(msg, file=sys.stderr)
            self.skipTest(msg)
        import eplbx
        out = run_python("""
            import eplbx.vllm as ev
            ev.install()
            import torch
            from vllm.config.parallel import EPLBConfig
            from vllm.distributed.eplb.policy import EPLB_POLICIES
            print(EPLBConfig(policy="eplbx", use_async=False).policy)
            try:
                EPLBConfig(policy="eplbxx", use_async=False)
            except Exception as e:
                print("refused", "eplbx_balanced" in str(e))
            load = torch.rand(2, 16) * 100
            old = EPLB_POLICIES["default"].rebalance_experts(load, 24, 4, 2, 8)
            new = EPLB_POLICIES["eplbx"].rebalance_experts(load, 24, 4, 2, 8, old)
            print(tuple(new.shape), new.dtype)
        """, [os.path.dirname(os.path.dirname(os.path.abspath(eplbx.__file__)))], python=python,
                         timeout=600)
        self.assertEqual(out.returncode, 0, out.stderr[-4000:])
        self.assertEqual(out.stdout.split("\n")[:3], ["eplbx", "refused True", "(2, 24) torch.int64"])


if __name__ == "__main__":
    unittest.main()
