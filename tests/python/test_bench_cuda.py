"""bench/python/bench_cuda_communicator.py checked on host tensors (the GPU machine runs it on
CUDA tensors): both loops and the gloo-staged baseline move every row right."""
import os
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "python", "bench_cuda_communicator.py")


class BenchCudaCommunicatorTest(unittest.TestCase):
    def test_check_on_host_tensors_moves_every_row(self):
        r = subprocess.run([sys.executable, BENCH, "--check", "--device", "cpu", "--json"],
                           capture_output=True, text=True, timeout=240)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        import json
        out = json.loads(r.stdout)
        self.assertEqual(sorted(out["seconds"]), ["eplbx", "eplbx_loop", "torch_gloo_staged"])
        self.assertGreater(out["bytes_moved_last"], 0)
        self.assertIn("TorchDistGlooStagedEplbCommunicator", out["baseline"])


if __name__ == "__main__":
    unittest.main()
