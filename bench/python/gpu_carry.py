"""Prepares what the GPU machine cannot download (it has no package registry) from wheels this
machine downloaded from PyPI, small enough to carry (scripts/test-gpu.sh --fetch calls it):

    python3 bench/python/gpu_carry.py vllm-files VLLM_WHEEL OUT_DIR
    python3 bench/python/gpu_carry.py trim-nixl OUT.tar.xz NIXL_WHEEL NIXL_CUxx_WHEEL...
    python3 bench/python/gpu_carry.py unpack OUT.tar.xz DIR

vllm-files: vLLM's EPLB rearrangement and communicators exactly as the wheel ships them
(the five files of vllm/distributed/eplb/ they consist of, and vllm/distributed/nixl_utils.py),
plus VERSION. bench/python/vllm_stub/ supplies the few names they import from the rest of vLLM.

trim-nixl: NIXL's Python packages (the `nixl` meta package, which picks nixl_cu12 or nixl_cu13
by torch's CUDA version, and each backend wheel given) with only what a UCX agent loads: the
Python modules, the bindings, the UCX plugin, UCX's cma and cuda modules, and the shared
libraries those need, found by following ELF DT_NEEDED entries through the files of the wheel
(system libraries such as libcuda and libcudart stay the machine's: torch loads its own
libcudart first). The NIXL-EP packages, the other plugins (GDS, object stores, libfabric, ...)
and UCX's InfiniBand modules are left out: about 240 MB unpacked per backend becomes about
42 MB, 8 MB as xz. `unpack` extracts such an archive (Python's tarfile: nothing else needed).
Nothing of NIXL or vLLM is kept in this project; the outputs go under .cache (ignored by git).
"""
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

VLLM_FILES = ["vllm/distributed/nixl_utils.py"] + [
    "vllm/distributed/eplb/" + f for f in ("__init__.py", "eplb_communicator.py", "eplb_utils.py",
                                           "migration_scheduler.py", "rebalance_execute.py")]
# UCX modules a NIXL agent on one host needs: cma (host memory between processes) and the
# CUDA transports (cuda_copy, cuda_ipc; the memory hooks of ucm_cuda).
UCX_MODULES = ("libuct_cma.", "libuct_cuda.", "libucm_cuda.")


def fresh_dir(out):
    """`out` emptied and made again, private; a link planted there is refused, not followed."""
    if os.path.islink(out):
        sys.exit(f"gpu_carry: {out} is a symbolic link; refused (remove it)")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, mode=0o700)


def vllm_files(wheel, out):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n in VLLM_FILES]
        version = next((n.split(".dist-info")[0].split("-", 1)[1] for n in z.namelist()
                        if n.endswith(".dist-info/METADATA")), "unknown")
        missing = sorted(set(VLLM_FILES) - set(names))
        if missing:
            sys.exit(f"gpu_carry: {wheel} lacks {', '.join(missing)} (another vLLM layout?)")
        fresh_dir(out)
        for n in names:
            z.extract(n, out)
    with open(os.path.join(out, "VERSION"), "w") as f:
        f.write(version + "\n")
    print(f"gpu_carry: {len(names)} files of vLLM {version} in {out}")


def needed(path):
    """(DT_NEEDED names, RPATH/RUNPATH directories with $ORIGIN expanded) of an ELF file."""
    try:
        text = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [], []
    names, dirs = [], []
    for line in text.splitlines():
        if "(NEEDED)" in line:
            names.append(line.split("[", 1)[1].rstrip("]"))
        elif "(RPATH)" in line or "(RUNPATH)" in line:
            for d in line.split("[", 1)[1].rstrip("]").split(":"):
                dirs.append(os.path.normpath(d.replace("$ORIGIN", os.path.dirname(path))))
    return names, dirs


def is_elf(path):
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def backend_of(path, tmp):
    """'cu12' for a file of the nixl_cu12 wheel (nixl_cu12/, nixl_cu12.libs/, .nixl_cu12...)."""
    top = os.path.relpath(path, tmp).split(os.sep)[0].lstrip(".")
    return top[len("nixl_"):].split(".")[0] if top.startswith("nixl_cu") else ""


def trim_nixl(out, wheels):
    with tempfile.TemporaryDirectory() as tmp:
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(tmp)
        files = []
        for root, _, names in os.walk(tmp):
            files += [os.path.join(root, n) for n in names]
        by_name = {}
        for f in files:
            by_name.setdefault(os.path.basename(f), []).append(f)
        top = lambda f: os.path.relpath(f, tmp).split(os.sep)[0]  # noqa: E731
        keep, todo = set(), []
        for f in files:
            rel = os.path.relpath(f, tmp)
            base = os.path.basename(f)
            package = top(f)
            python_part = (package in ("nixl", "nixl_meta_utils.py")
                           or (package.startswith("nixl_cu") and not package.endswith(
                               (".libs", ".scripts", ".dist-info", ".data"))))
            if package.startswith("nixl_ep"):
                continue
            root = (python_part
                    or base == "libplugin_UCX.so"
                    or (os.sep + "ucx" + os.sep in rel and base.startswith(UCX_MODULES)
                        and ".so" in base))
            if root:
                keep.add(f)
                todo.append(f)
        while todo:
            f = todo.pop()
            if not is_elf(f):
                continue
            names, dirs = needed(f)
            for n in names:
                # Only the wheel's own files (an RPATH may also name /usr/lib64).
                hits = [d for d in (os.path.join(x, n) for x in dirs)
                        if os.path.exists(d) and d.startswith(tmp + os.sep)]
                # Else the file of that name in the same backend's wheel.
                hits = hits or [h for h in by_name.get(n, [])
                                if backend_of(h, tmp) == backend_of(f, tmp)]
                for h in hits[:1]:
                    if h not in keep:
                        keep.add(h)
                        todo.append(h)
        size = sum(os.path.getsize(f) for f in keep)
        total = sum(os.path.getsize(f) for f in files)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        part = out + ".part"
        if os.path.lexists(part):
            os.unlink(part)
        # Created here, private, never through a link planted at its name.
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:xz") as tar:
            for name in sorted(keep):
                tar.add(name, arcname=os.path.relpath(name, tmp), recursive=False)
        os.replace(part, out)
        print(f"gpu_carry: NIXL trimmed to {len(keep)} of {len(files)} files, "
              f"{size / 2**20:.1f} of {total / 2**20:.1f} MiB, {os.path.getsize(out) / 2**20:.1f} MiB "
              f"as {out}")


def unpack(archive, out):
    with tarfile.open(archive, "r:xz") as tar:
        for m in tar.getmembers():  # our own archive; still, nothing outside `out`, no links
            if m.name.startswith("/") or ".." in m.name.split("/") or not (
                    m.isfile() or m.isdir()):
                sys.exit(f"gpu_carry: {archive} holds {m.name!r}, refused")
        fresh_dir(out)
        tar.extractall(out)
    print(f"gpu_carry: {archive} unpacked into {out}")


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "vllm-files":
        vllm_files(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4 and sys.argv[1] == "trim-nixl":
        trim_nixl(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "unpack":
        unpack(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
