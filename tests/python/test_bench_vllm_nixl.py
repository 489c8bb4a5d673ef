"""What scripts/test-gpu.sh carries for vLLM's NIXL communicator (bench/python/gpu_carry.py),
and bench/python/bench_vllm_nixl.py checked on host tensors where its parts are here.

gpu_carry: the trimmed NIXL keeps the ELF closure of what a UCX agent loads and nothing else
(shared objects built here, linked as the wheel's are); an archive that would write outside
its folder is refused; a vLLM wheel without the EPLB files is named. The host check needs
vLLM's files, an unpacked NIXL for this Python and an interpreter with torch 2:
EPLBX_NIXL_HOST_CHECK=PYTHON:VLLM_FILES:NIXL_DIR (skipped, saying so, without it)."""
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CARRY = os.path.join(ROOT, "bench", "python", "gpu_carry.py")
BENCH = os.path.join(ROOT, "bench", "python", "bench_vllm_nixl.py")


def carry(*args):
    return subprocess.run([sys.executable, CARRY, *args], capture_output=True, text=True,
                          timeout=120)


def cc(out, src, *flags):
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
        f.write(src)
    try:
        subprocess.run(["cc", "-shared", "-fPIC", "-o", out, f.name, *flags], check=True)
    finally:
        os.unlink(f.name)


class GpuCarryTest(unittest.TestCase):
    def test_trimmed_nixl_keeps_the_closure_of_the_ucx_agent_only(self):
        if shutil.which("cc") is None or shutil.which("readelf") is None:
            self.skipTest("no cc or readelf here")
        with tempfile.TemporaryDirectory() as tmp:
            w = os.path.join(tmp, "wheel")
            libs = os.path.join(w, "nixl_cu12.libs")
            meson = os.path.join(w, ".nixl_cu12.mesonpy.libs")
            for d in (libs, os.path.join(libs, "ucx"), os.path.join(meson, "plugins"),
                      os.path.join(w, "nixl_cu12"), os.path.join(w, "nixl_ep_cu12")):
                os.makedirs(d)
            # The wheel's shapes: bindings -> libnixl (RPATH) -> libdep-hash (found by name);
            # the UCX plugin -> libucp; an unused library; a NIXL-EP module; a library of the
            # machine in an absolute RPATH directory (the wheel's name /usr/lib64).
            cc(os.path.join(libs, "libdep-1a2b.so.1"), "int dep(void){return 1;}")
            cc(os.path.join(libs, "libunused-3c4d.so"), "int unused(void){return 2;}")
            cc(os.path.join(libs, "libucp-5e6f.so.0"), "int ucp(void){return 3;}")
            cc(os.path.join(meson, "libnixl.so"), "int dep(void); int nixl(void){return dep();}",
               "-L" + libs, "-l:libdep-1a2b.so.1")
            system = os.path.join(tmp, "system")  # a library of the machine, not the wheel's
            os.makedirs(system)
            cc(os.path.join(system, "libsys.so"), "int sys_(void){return 8;}")
            cc(os.path.join(w, "nixl_cu12", "_bindings.cpython-312-x86_64-linux-gnu.so"),
               "int nixl(void); int sys_(void); int b(void){return nixl() + sys_();}",
               "-L" + meson, "-lnixl", "-L" + system, "-lsys",
               "-Wl,-rpath,$ORIGIN/../.nixl_cu12.mesonpy.libs:" + system)
            cc(os.path.join(meson, "plugins", "libplugin_UCX.so"),
               "int ucp(void); int p(void){return ucp();}", "-L" + libs, "-l:libucp-5e6f.so.0")
            cc(os.path.join(meson, "plugins", "libplugin_GDS.so"), "int g(void){return 4;}")
            cc(os.path.join(libs, "ucx", "libuct_cma.so.0.0.0"), "int c(void){return 5;}")
            cc(os.path.join(libs, "ucx", "libuct_ib.so.0.0.0"), "int i(void){return 6;}")
            cc(os.path.join(w, "nixl_ep_cu12", "ep.so"), "int e(void){return 7;}")
            for name in ("nixl_cu12/__init__.py", "nixl_cu12/_api.py"):
                open(os.path.join(w, name), "w").close()
            whl = os.path.join(tmp, "nixl_cu12-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl")
            with zipfile.ZipFile(whl, "w") as z:
                for root, _, files in os.walk(w):
                    for f in files:
                        z.write(os.path.join(root, f), os.path.relpath(os.path.join(root, f), w))
            r = carry("trim-nixl", os.path.join(tmp, "n.tar.xz"), whl)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            with tarfile.open(os.path.join(tmp, "n.tar.xz")) as t:
                kept = sorted(m.name for m in t.getmembers())
            self.assertEqual(kept, [
                ".nixl_cu12.mesonpy.libs/libnixl.so",
                ".nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so",
                "nixl_cu12.libs/libdep-1a2b.so.1",
                "nixl_cu12.libs/libucp-5e6f.so.0",
                "nixl_cu12.libs/ucx/libuct_cma.so.0.0.0",
                "nixl_cu12/__init__.py",
                "nixl_cu12/_api.py",
                "nixl_cu12/_bindings.cpython-312-x86_64-linux-gnu.so"])
            r = carry("unpack", os.path.join(tmp, "n.tar.xz"), os.path.join(tmp, "out"))
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertTrue(os.path.isfile(os.path.join(tmp, "out", "nixl_cu12.libs",
                                                        "libucp-5e6f.so.0")))

    def test_unpack_refuses_an_archive_that_writes_outside_its_folder(self):
        with tempfile.TemporaryDirectory() as tmp:
            for name, kind in (("../escaped", tarfile.REGTYPE), ("/abs", tarfile.REGTYPE),
                               ("link", tarfile.SYMTYPE)):
                archive = os.path.join(tmp, "bad.tar.xz")
                with tarfile.open(archive, "w:xz") as t:
                    info = tarfile.TarInfo("ok.txt")
                    info.size = 2
                    t.addfile(info, io.BytesIO(b"ok"))
                    info = tarfile.TarInfo(name)
                    info.type = kind
                    if kind == tarfile.SYMTYPE:
                        info.linkname = "/etc/passwd"
                    t.addfile(info, io.BytesIO(b""))
                out = os.path.join(tmp, "out")
                r = carry("unpack", archive, out)
                self.assertNotEqual(r.returncode, 0, name)
                self.assertIn(f"holds '{name}', refused", r.stdout + r.stderr)
                self.assertFalse(os.path.exists(os.path.join(tmp, "escaped")))
                self.assertFalse(os.path.exists(os.path.join(out, "ok.txt")))
            # A link planted where the folder goes is refused, not followed.
            good = os.path.join(tmp, "good.tar.xz")
            with tarfile.open(good, "w:xz") as t:
                info = tarfile.TarInfo("ok.txt")
                info.size = 2
                t.addfile(info, io.BytesIO(b"ok"))
            elsewhere = os.path.join(tmp, "elsewhere")
            os.makedirs(elsewhere)
            planted = os.path.join(tmp, "planted")
            os.symlink(elsewhere, planted)
            r = carry("unpack", good, planted)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("is a symbolic link; refused", r.stdout + r.stderr)
            self.assertEqual(os.listdir(elsewhere), [])

    def test_vllm_files_takes_the_eplb_files_and_names_what_a_wheel_lacks(self):
        with tempfile.TemporaryDirectory() as tmp:
            whl = os.path.join(tmp, "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")
            files = ["vllm/distributed/nixl_utils.py", "vllm/distributed/eplb/__init__.py",
                     "vllm/distributed/eplb/eplb_communicator.py",
                     "vllm/distributed/eplb/eplb_utils.py",
                     "vllm/distributed/eplb/migration_scheduler.py"]
            with zipfile.ZipFile(whl, "w") as z:
                for f in files + ["vllm/distributed/eplb/eplb_state.py", "vllm/config.py"]:
                    z.writestr(f, f"# {f}\n")
                z.writestr("vllm-0.33.0.dist-info/METADATA", "Name: vllm\n")
            r = carry("vllm-files", whl, os.path.join(tmp, "out"))
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("lacks vllm/distributed/eplb/rebalance_execute.py", r.stdout + r.stderr)
            with zipfile.ZipFile(whl, "a") as z:
                z.writestr("vllm/distributed/eplb/rebalance_execute.py", "# the loop\n")
            r = carry("vllm-files", whl, os.path.join(tmp, "out"))
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            got = sorted(os.path.relpath(os.path.join(d, f), os.path.join(tmp, "out"))
                         for d, _, fs in os.walk(os.path.join(tmp, "out")) for f in fs)
            self.assertEqual(got, sorted(["VERSION", "vllm/distributed/eplb/rebalance_execute.py"]
                                         + files))
            with open(os.path.join(tmp, "out", "VERSION")) as f:
                self.assertEqual(f.read().strip(), "0.33.0")


class BenchVllmNixlTest(unittest.TestCase):
    def test_without_its_parts_it_says_why_and_measures_nothing(self):
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run([sys.executable, BENCH, "--vllm-files", tmp, "--nixl", tmp,
                                "--json"], capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("eplb_communicator.py", json.loads(r.stdout)["skipped"])

    def test_host_check_moves_every_row_with_vllms_nixl_communicator(self):
        spec = os.environ.get("EPLBX_NIXL_HOST_CHECK", "")
        if spec.count(":") != 2:
            self.skipTest("EPLBX_NIXL_HOST_CHECK=PYTHON:VLLM_FILES:NIXL_DIR not set "
                          "(vLLM's files and NIXL come from PyPI: bench/python/gpu_carry.py)")
        python, vllm_files, nixl = spec.split(":")
        r = subprocess.run([python, BENCH, "--vllm-files", vllm_files, "--nixl", nixl, "--check",
                            "--device", "cpu", "--json"], capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        out = json.loads(r.stdout)
        self.assertNotIn("skipped", out)
        self.assertEqual(sorted(out["seconds"]), ["eplbx", "eplbx_vllm_loop", "nixl"])
        self.assertEqual(out["nixl_wrong_rows"], {})  # host copies: nothing races here
        self.assertGreater(out["bytes_moved_per_rearrangement"], 0)
        self.assertIn("NixlEplbCommunicator", out["baseline"])


if __name__ == "__main__":
    unittest.main()
