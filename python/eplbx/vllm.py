"""A drop-in EPLB communicator for vLLM, on eplbx's transfer engine and protocol.

vLLM drives an EPLB communicator per MoE layer:

    comm.set_transfer_context(old_indices, layer_idx)
    for expert this rank serves:  comm.add_send(weight_rows, dst_rank, expert_id)
    for expert this rank needs:   comm.add_recv(buffer_rows, src_rank, expert_id)
    comm.execute()                # afterwards every buffer row holds its expert
    ... copy from expert_buffer into the weights ...

EplbxCommunicator registers every layer's weight tensors and the buffer once, exchanges
agent and layout metadata with torch.distributed.all_gather_object over `cpu_group`, and
validates the layouts on every rank (a mismatch raises eplbx.MismatchError naming the rank,
layer, tensor and both byte counts). Receivers READ the source's weight row directly (zero
copy on the source) once the source says READY; execute() returns when every rank's reads
for the layer are complete, so nobody overwrites rows a peer still reads. `timeout_s` bounds
every wait: a dead or stopped peer raises eplbx.AbortedError / UnavailableError naming it on
the survivors. See docs/python.md.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ._eplbx import InvalidArgumentError, _Communicator

_INT32_MAX = 2**31 - 1
# Every wait has a deadline (docs/protocol.md): no limit is not offered.
_TIMEOUT_RANGE = (0.1, 86400.0)


def _nbytes(t) -> int:
    return t.element_size() * t.numel()


def _check_tensor(t, what: str, device=None):
    """`t` is a contiguous host or CUDA tensor, on `device` when given (one memory per
    communicator: all host, or all on this rank's GPU); returns its device."""
    if t.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"eplbx: {what} is on {t.device}; eplbx moves host memory and CUDA device memory")
    if device is not None and t.device != device:
        raise InvalidArgumentError(
            f"eplbx: {what} is on {t.device} but the communicator's first weight tensor is on "
            f"{device}; every weight and buffer tensor must be in one memory (all host, or all on "
            "this rank's GPU)")
    if not t.is_contiguous():
        raise ValueError(f"eplbx: {what} is not contiguous; expert rows must be contiguous")
    return t.device


def _check_int(value, what: str, lo: int, hi: int) -> int:
    """An integral number in [lo, hi], or InvalidArgumentError (never a silent wrap or cut)."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"eplbx: {what} is {value!r}, not an integer")
    if not lo <= int(value) <= hi:
        raise InvalidArgumentError(f"eplbx: {what} is {int(value)}, outside [{lo}, {hi}]")
    return int(value)


def _check_map(indices, what: str) -> np.ndarray:
    """A layer's phy2log as int32: integers in [-1, 2**31 - 1] only (a float, NaN or an id
    past int32 is an error naming the first bad slot, never truncated)."""
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    a = np.asarray(indices).reshape(-1)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgumentError(
            f"eplbx: {what} has dtype {a.dtype}; expert ids must be integers (int32 or int64)")
    bad = np.nonzero((a < -1) | (a > _INT32_MAX))[0]
    if bad.size:
        raise InvalidArgumentError(
            f"eplbx: {what} slot {int(bad[0])} holds expert id {int(a[bad[0]])}, outside "
            f"[-1, {_INT32_MAX}]")
    return np.ascontiguousarray(a, dtype=np.int32)


def _check_timeout(timeout_s) -> float:
    lo, hi = _TIMEOUT_RANGE
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise InvalidArgumentError(f"eplbx: timeout_s is {timeout_s!r}, not a number of seconds")
    t = float(timeout_s)
    if math.isinf(t):
        raise InvalidArgumentError(
            f"eplbx: timeout_s is {t}; every wait has a deadline (no limit is not offered): "
            f"give seconds in [{lo:g}, {hi:g}]")
    if not lo <= t <= hi:  # also NaN
        raise InvalidArgumentError(f"eplbx: timeout_s is {t}, outside [{lo:g}, {hi:g}] seconds")
    return t


def _merged_regions(tensors) -> list[tuple[int, int]]:
    """Memory ranges covering `tensors`, overlapping ranges merged. Merely adjacent ranges
    stay apart: they may be different shared-memory files, each mappable on its own."""
    spans = sorted((t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in tensors if t.numel() > 0)
    out: list[list[int]] = []
    for start, end in spans:
        if out and start < out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e - s) for s, e in out]


class EplbxCommunicator:
    """vLLM's EplbCommunicator interface on eplbx (host or CUDA tensors)."""

    def __init__(self, cpu_group, all_expert_weights, expert_buffer, timeout_s: float = 300.0,
                 transport: str = "auto", paths: str = "", defer_setup: bool = False,
                 allgather=None, members=None, **_ignored):
        """Registers the weights and the buffer. The exchange with the peers (a collective over
        `cpu_group`: agent metadata and layouts, checked on every rank) happens here, or with
        `defer_setup=True` at the first set_transfer_context, as vLLM's NIXL communicator
        defers its remote setup (elastic EP builds communicators before every peer is up).
        Keyword arguments a newer vLLM may add are accepted and ignored.

        `cpu_group` None: the default process group's rank and size. `allgather` (bytes ->
        list of bytes, one per rank, empty for a rank not taking part) replaces the collective
        over `cpu_group`; `members` (one flag per rank): only those ranks take part, the others
        are neither connected to nor read from (eplbx.sglang: an engine's live ranks)."""
        import torch.distributed as dist

        self._group = cpu_group
        timeout_s = _check_timeout(timeout_s)
        rank = dist.get_rank(group=cpu_group)
        world = dist.get_world_size(group=cpu_group)
        self._rank, self._world = rank, world
        self._rows = []  # per layer, per tensor: (dtype, row shape, bytes per row)
        self._layer = None
        self.last_rearrange = None  # figures of the last rearrange() (vLLM drops its return value)
        layers = []
        tensors = []
        self._device = None  # where every tensor lives (cpu or one cuda device)
        self._stream = None  # set_stream(): the engine's stream the transfers are ordered with
        for layer, layer_tensors in enumerate(all_expert_weights):
            spec = []
            for index, w in enumerate(layer_tensors):
                self._device = _check_tensor(w, f"weight tensor {index} of layer {layer}", self._device)
                rows = int(w.shape[0])
                per_expert = _nbytes(w) // rows if rows else 0
                spec.append((f"tensor{index}", str(w.dtype).replace("torch.", ""), [int(d) for d in w.shape[1:]],
                             w.data_ptr(), per_expert, rows))
                tensors.append(w)
            layers.append(spec)
            self._rows.append([(w.dtype, tuple(w.shape[1:]), _nbytes(w) // int(w.shape[0]) if w.shape[0] else 0)
                               for w in layer_tensors])
        for index, b in enumerate(expert_buffer):
            _check_tensor(b, f"expert_buffer tensor {index}", self._device)
            tensors.append(b)

        def gather(blob: bytes) -> list:
            out = [None] * world
            dist.all_gather_object(out, blob, group=cpu_group)
            return out

        self._comm = None
        self._setup_args = (rank, world, gather if allgather is None else allgather, layers,
                            _merged_regions(tensors), float(timeout_s), transport, paths,
                            None if members is None else [bool(m) for m in members])
        if not defer_setup:
            self._setup()

    def _setup(self) -> None:
        """The exchange with every peer (collective), once."""
        if self._comm is None:
            self._comm = _Communicator(*self._setup_args)
            self._setup_args = None

    @property
    def needs_profile_buffer_reservation(self) -> bool:
        return False

    def set_stream(self, stream) -> None:
        """CUDA tensors: the engine's stream. execute() starts its transfers only after the work
        already queued on it (the engine may still be writing the buffer or the rows it sends),
        and returns with the received rows in place, so work queued on it afterwards sees them.
        Host tensors: nothing to order against."""
        self._stream = stream

    def _device_work_done(self) -> None:
        """Waits for the device work queued so far on the engine's stream and on the current
        one (copies this communicator queued itself), so transfers read finished rows."""
        if self._device is None or self._device.type != "cuda":
            return
        import torch

        current = torch.cuda.current_stream(self._device)
        if self._stream is not None and self._stream != current:
            self._stream.synchronize()
        current.synchronize()

    def set_transfer_context(self, old_indices, layer_idx: int, new_indices=None,
                             kept_rows_copied: bool = False, **_ignored) -> None:
        """`old_indices`: the layer's phy2log in force; `new_indices` (optional): the one
        after. Every rank must pass the same maps: execute() compares them across ranks
        before any READ. `kept_rows_copied` (with `new_indices`): the caller already copied out
        the rows whose expert this rank keeps, so those rows may receive. Keyword arguments a
        newer vLLM may add are accepted and ignored."""
        layer = _check_int(layer_idx, "layer_idx", 0, len(self._rows) - 1)
        old = _check_map(old_indices, f"old_indices of layer {layer}")
        new = None if new_indices is None else _check_map(new_indices, f"new_indices of layer {layer}")
        self._setup()  # deferred setup: every rank reaches its first layer together
        self._comm.set_transfer_context(old, layer, new, bool(kept_rows_copied))
        self._layer = layer

    def _refuse(self, error: Exception) -> None:
        """Bad input found here once a layer's context is set: peers are told at once (their
        execute() fails naming this rank) instead of waiting for the deadline."""
        if self._layer is not None:
            self._comm.abort(str(error))
            self._layer = None
        raise error

    def _context(self):
        if self._comm is None:
            raise InvalidArgumentError("eplbx: call set_transfer_context(old_indices, layer_idx) first")
        return self._comm

    def add_send(self, tensors, dst_rank: int, expert_id: int, **_ignored) -> None:
        self._context()
        try:
            dst = _check_int(dst_rank, "dst_rank", 0, self._world - 1)
            expert = _check_int(expert_id, "expert_id", 0, _INT32_MAX)
        except InvalidArgumentError as e:
            self._refuse(e)
        self._comm.add_send(dst, expert)

    def add_recv(self, tensors, src_rank: int, expert_id: int, **_ignored) -> None:
        self._context()
        try:
            src = _check_int(src_rank, "src_rank", 0, self._world - 1)
            expert = _check_int(expert_id, "expert_id", 0, _INT32_MAX)
        except InvalidArgumentError as e:
            self._refuse(e)
        rows = []
        for index, t in enumerate(tensors):
            try:
                _check_tensor(t, f"receive row {index} of expert {expert}", self._device)
            except (InvalidArgumentError, NotImplementedError, ValueError) as e:
                self._refuse(e)  # the peers are told at once, as for other bad rows
            if self._layer is not None and index < len(self._rows[self._layer]):
                dtype, shape, nbytes = self._rows[self._layer][index]
                if t.dtype != dtype or tuple(t.shape) != shape or _nbytes(t) != nbytes:
                    self._refuse(InvalidArgumentError(
                        f"eplbx: rank {self._rank}: receive row {index} of expert {expert} in layer "
                        f"{self._layer} is {str(t.dtype).replace('torch.', '')} {list(t.shape)} "
                        f"({_nbytes(t)} bytes); the weights' rows of that tensor are "
                        f"{str(dtype).replace('torch.', '')} {list(shape)} ({nbytes} bytes)"))
            rows.append((t.data_ptr(), _nbytes(t)))
        self._comm.add_recv(src, expert, rows)

    def execute(self, **_ignored) -> None:
        comm = self._context()
        self._layer = None  # the layer's context ends here, whatever execute() raises
        self._device_work_done()
        comm.execute()  # returns once every read landed (device copies completed)

    @property
    def failed(self) -> bool:
        return self._comm is not None and self._comm.failed

    def rearrange(self, old_maps, new_maps, all_expert_weights, expert_buffer) -> dict:
        """The whole rearrangement in place, layer by layer, reading straight into the final
        weight rows where that is safe: vLLM's `rearrange_expert_weights_inplace` on this
        communicator (install() routes it here), without the copy of every received row out
        of the buffer. `old_maps` / `new_maps`: layers x slots phy2log (the same on every rank);
        `all_expert_weights` and `expert_buffer`: the tensors this communicator registered.

        Per layer, every rank computes the same transfers (eplbx.migrate: fewest, best-sourced),
        and eplbx._inplace (the executor SGLang's update on eplbx uses too) runs them: local
        moves from old rows first, then up to two execute() rounds (rows no peer reads first,
        then the rows peers read), through the buffer row of the same index only where a row
        is still read or in a cycle; then the buffer rows, then second replicas of rows just
        received. Returns this rank's figures, also kept as `last_rearrange` (vLLM drops the
        return value): {"direct_rows" (local copies written straight into their rows count
        too), "buffered_rows", "local_copies", "layers", "bytes_received", "seconds"}.

        If a layer fails (a peer lost, a timeout), that layer's rows named in the error may hold
        partial data and every later layer is untouched: the error says so (vLLM's own loop
        leaves earlier layers moved and its map uncommitted, as here)."""
        old = np.stack([_check_map(m, f"old map of layer {i}") for i, m in enumerate(old_maps)])
        new = np.stack([_check_map(m, f"new map of layer {i}") for i, m in enumerate(new_maps)])
        layers = len(self._rows)
        rows = int(all_expert_weights[0][0].shape[0]) if layers else 0
        if old.shape != new.shape or old.shape != (layers, rows * self._world):
            raise InvalidArgumentError(
                f"eplbx: the maps are {old.shape[0]} x {old.shape[1]} (old) and {new.shape[0]} x "
                f"{new.shape[1]} (new); this communicator has {layers} layers x {rows * self._world} "
                f"slots ({self._world} ranks x {rows} rows)")
        from . import _inplace

        stats = _inplace.rearrange(self, old, new, all_expert_weights,
                                   lambda layer, rows: {r: [b[r] for b in expert_buffer] for r in rows})
        self.last_rearrange = stats
        return stats


# ---------------------------------------------------------------------------------------
# Switching eplbx on in an installed vLLM: `eplb_config={"communicator": "eplbx"}`.

#: The name vLLM's EPLB config takes to select this communicator.
BACKEND = "eplbx"

# Options read from the environment by the communicators install() builds (vLLM's config
# forbids unknown fields, so options travel as environment variables, which vLLM's worker
# processes inherit). name -> (EplbxCommunicator keyword, parser)
_ENV_OPTIONS = {
    "EPLBX_TIMEOUT_S": ("timeout_s", float),
    "EPLBX_TRANSPORT": ("transport", str),
    "EPLBX_PATHS": ("paths", str),
    "EPLBX_DEFER_SETUP": ("defer_setup", lambda v: {"0": False, "1": True}[v]),
}
# EPLBX_DIRECT=0: vLLM's own rearrangement loop (through the buffer) on this communicator
# instead of EplbxCommunicator.rearrange (straight into the weight rows where safe).
_DIRECT_ENV = "EPLBX_DIRECT"
# EPLBX_SHARE_MEMORY=0: keep the engine's host tensors where they are (default 1: moved to
# shared memory once, when the communicator is built).
_SHARE_ENV = "EPLBX_SHARE_MEMORY"

# Where install() patches vLLM, as found in vLLM 0.33 (the communicator interface with
# set_transfer_context and per-expert add_send/add_recv): module -> attributes it must have.
_LAYOUT = {
    "vllm.config.parallel": ("EPLBCommunicatorBackend", "EPLBPolicyOption", "EPLBConfig",
                             "ParallelConfig"),
    "vllm.distributed.eplb.policy": ("EPLB_POLICIES", "AbstractEplbPolicy"),
    "vllm.distributed.eplb.eplb_communicator": ("create_eplb_communicator", "EplbCommunicator"),
    "vllm.distributed.eplb.rebalance_execute": ("rearrange_expert_weights_inplace",),
}
_FACTORY_PARAMS = ("group_coordinator", "backend", "expert_weights", "expert_buffer")
_REARRANGE_PARAMS = ("old_global_expert_indices", "new_global_expert_indices", "expert_weights",
                     "expert_buffer", "ep_group", "communicator", "is_profile", "rank_mapping")


class VllmLayoutError(RuntimeError):
    """The installed vLLM is not laid out as install() expects: it names the version and
    what was not found (install() never patches half of vLLM and stays silent)."""


def options_from_env(environ=None) -> dict:
    """EplbxCommunicator keywords from EPLBX_TIMEOUT_S, EPLBX_TRANSPORT, EPLBX_PATHS and
    EPLBX_DEFER_SETUP (0 or 1); a value that does not parse is an InvalidArgumentError
    naming the variable."""
    import os

    environ = os.environ if environ is None else environ
    out = {}
    for name, (keyword, parse) in _ENV_OPTIONS.items():
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            out[keyword] = parse(raw.strip())
        except (KeyError, ValueError):
            raise InvalidArgumentError(
                f"eplbx: environment variable {name}={raw!r} does not parse as the "
                f"{keyword} option" + (" (0 or 1)" if keyword == "defer_setup" else "")) from None
    if "timeout_s" in out:
        out["timeout_s"] = _check_timeout(out["timeout_s"])
    return out


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        raise VllmLayoutError(f"eplbx.vllm.install(): vLLM is not importable here ({e!r})") from e


def _find_layout(version: str) -> dict:
    import importlib

    found = {}
    missing = []
    for module_name, attrs in _LAYOUT.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001
            missing.append(f"module {module_name} ({type(e).__name__}: {e})")
            continue
        found[module_name] = module
        missing += [f"{module_name}.{a}" for a in attrs if not hasattr(module, a)]
    import inspect

    for module, name, want in (("vllm.distributed.eplb.eplb_communicator", "create_eplb_communicator",
                                _FACTORY_PARAMS),
                               ("vllm.distributed.eplb.rebalance_execute",
                                "rearrange_expert_weights_inplace", _REARRANGE_PARAMS)):
        fn = getattr(found.get(module), name, None)
        if fn is None:
            continue  # already named above
        params = tuple(inspect.signature(getattr(fn, "_eplbx_original", fn)).parameters)
        if params[:len(want)] != want:
            missing.append(f"{name}{want} (this vLLM has {name}{params})")
    abstract = getattr(found.get("vllm.distributed.eplb.eplb_communicator"), "EplbCommunicator", None)
    if abstract is not None and not hasattr(abstract, "set_transfer_context"):
        missing.append("EplbCommunicator.set_transfer_context (the per-expert interface; "
                       "this vLLM has the older per-tensor one)")
    if missing:
        raise VllmLayoutError(
            f"eplbx.vllm.install(): vLLM {version} is not laid out as eplbx expects "
            f"(written against vLLM 0.33): not found: {'; '.join(missing)}. Nothing was "
            "changed; use one of vLLM's own communicators or an eplbx that knows this vLLM")
    return found


def _create(original, group_coordinator, backend, expert_weights, expert_buffer, *args, **kwargs):
    if backend != BACKEND:
        return original(group_coordinator, backend, expert_weights, expert_buffer, *args, **kwargs)
    try:
        from vllm.distributed.stateless_coordinator import StatelessGroupCoordinator
    except Exception:  # noqa: BLE001 - an older vLLM without elastic EP
        StatelessGroupCoordinator = ()  # noqa: N806
    if StatelessGroupCoordinator and isinstance(group_coordinator, StatelessGroupCoordinator):
        raise NotImplementedError(
            "eplbx: vLLM's elastic EP (stateless process groups) is not supported by the eplbx "
            "communicator yet; use communicator 'nixl' or 'pynccl' with elastic EP")
    import os

    share = os.environ.get(_SHARE_ENV, "1")
    if share not in ("0", "1"):
        raise InvalidArgumentError(f"eplbx: environment variable {_SHARE_ENV}={share!r} is not 0 or 1")
    if share == "1":
        _share_memory([w for layer in expert_weights for w in layer] + list(expert_buffer))
    return EplbxCommunicator(group_coordinator.cpu_group, expert_weights, expert_buffer,
                             **options_from_env())


def _share_memory(tensors) -> None:
    """Moves host tensors' storage to shared memory in place (torch's share_memory_(): every
    view, the model's parameters included, follows), so peers map them and READs are plain
    copies (docs/python.md). Device tensors are left alone. Where it fails (a small /dev/shm),
    a warning says so and why, and the communicator reads the plain tensors with CMA."""
    try:
        for t in tensors:
            if t.device.type == "cpu" and not t.is_shared():
                t.share_memory_()
    except RuntimeError as e:
        import logging

        logging.getLogger("eplbx").warning(
            "eplbx: could not move the expert weights to shared memory (%s); peers read them with "
            "process_vm_readv instead (slower; docs/python.md). Make /dev/shm larger, or set %s=0 "
            "to keep plain tensors without this warning", e, _SHARE_ENV)


def _rearrange(original, old_global_expert_indices, new_global_expert_indices, expert_weights,
               expert_buffer, ep_group, communicator, is_profile=False, rank_mapping=None, *args,
               **kwargs):
    """vLLM's rearrange_expert_weights_inplace: on an EplbxCommunicator (outside profiling and
    elastic rank mappings) EplbxCommunicator.rearrange, else vLLM's own."""
    import os

    direct = os.environ.get(_DIRECT_ENV, "1")
    if direct not in ("0", "1"):
        raise InvalidArgumentError(f"eplbx: environment variable {_DIRECT_ENV}={direct!r} is not 0 or 1")
    if (isinstance(communicator, EplbxCommunicator) and direct == "1" and not is_profile
            and rank_mapping is None and not args and not kwargs):
        communicator.rearrange(old_global_expert_indices, new_global_expert_indices, expert_weights,
                               expert_buffer)
        return None
    return original(old_global_expert_indices, new_global_expert_indices, expert_weights, expert_buffer,
                    ep_group, communicator, is_profile, rank_mapping, *args, **kwargs)


def _replace_everywhere(module, name, wrapper) -> None:
    """Wraps module.<name> and every loaded vLLM module's reference to it (modules that
    imported it by name), once."""
    import functools
    import sys

    original = getattr(module, name)
    if getattr(original, "_eplbx_original", None):
        return
    wrapped = functools.wraps(original)(functools.partial(wrapper, original))
    wrapped._eplbx_original = original
    for m in list(sys.modules.values()):
        if getattr(m, "__name__", "").startswith("vllm") and getattr(m, name, None) is original:
            setattr(m, name, wrapped)


def install() -> str:
    """Makes `eplb_config={"communicator": "eplbx"}` valid in the installed vLLM and builds
    EplbxCommunicator for it: adds "eplbx" to the names vLLM's EPLBConfig accepts (its
    pydantic validators are rebuilt) and wraps vLLM's create_eplb_communicator wherever a
    loaded vLLM module holds it (other names go to vLLM's own factory unchanged). Options come
    from EPLBX_TIMEOUT_S, EPLBX_TRANSPORT, EPLBX_PATHS, EPLBX_DEFER_SETUP (options_from_env).
    It also routes vLLM's synchronous rearrangement (rearrange_expert_weights_inplace) on an
    EplbxCommunicator to EplbxCommunicator.rearrange, which reads straight into the weight rows
    where safe (EPLBX_DIRECT=0: vLLM's own loop through the buffer); vLLM's asynchronous EPLB
    keeps its own loop (transfer_layer, then its copy out of the buffer).

    It also registers eplbx's placement as vLLM's EPLB policies "eplbx" (incremental) and
    "eplbx_balanced" (POLICIES; `eplb_config={"policy": "eplbx", "use_async": false}`: vLLM
    0.33 runs only its default policy asynchronously).

    Idempotent (vLLM loads plugins once per process, maybe more). vLLM runs it in every
    process through the `vllm.general_plugins` entry point the build writes next to the
    package; a script that builds EngineArgs from a dict calls it first. An installed vLLM laid
    out otherwise raises VllmLayoutError naming its version and what was not found, before
    anything is changed. Returns the vLLM version."""
    import typing

    version = _vllm_version()
    layout = _find_layout(version)
    parallel = layout["vllm.config.parallel"]
    comm_module = layout["vllm.distributed.eplb.eplb_communicator"]
    policies = layout["vllm.distributed.eplb.policy"]

    widen = []
    names = typing.get_args(parallel.EPLBCommunicatorBackend)
    if BACKEND not in names:
        widen.append(("EPLBCommunicatorBackend", "communicator", True, names, (BACKEND,)))
    policy_names = typing.get_args(parallel.EPLBPolicyOption)
    missing = tuple(name for name in POLICIES if name not in policy_names)
    if missing:
        widen.append(("EPLBPolicyOption", "policy", False, policy_names, missing))
    classes = {name: _policy_class(policies.AbstractEplbPolicy, name) for name in POLICIES}
    if widen:
        _widen_config(version, parallel, widen)
    for name, cls in classes.items():
        policies.EPLB_POLICIES.setdefault(name, cls)

    _replace_everywhere(comm_module, "create_eplb_communicator", _create)
    _replace_everywhere(layout["vllm.distributed.eplb.rebalance_execute"], "rearrange_expert_weights_inplace",
                        _rearrange)
    return version


def _widen_config(version, parallel, widen) -> None:
    """Adds names to Literal fields of vLLM's EPLBConfig (`widen`: (alias in
    vllm.config.parallel, field, optional, names, added) each) and rebuilds the pydantic
    validators that embed them. All or nothing: everything is checked first, and a rebuild
    that fails puts every change back (and rebuilds again) before VllmLayoutError."""
    import typing

    try:
        import pydantic
        import pydantic.dataclasses

        config_cls = parallel.EPLBConfig
        fields = {field: config_cls.__dataclass_fields__[field] for _, field, *_ in widen}
        annotations = config_cls.__annotations__
        embedding = [getattr(parallel, name) for name in ("ParallelConfig",)]
        rebuild = pydantic.dataclasses.rebuild_dataclass
    except Exception as e:  # noqa: BLE001 - named below, nothing changed yet
        raise VllmLayoutError(
            f"eplbx.vllm.install(): vLLM {version}'s EPLBConfig is not a pydantic dataclass with "
            f"the fields eplbx widens ({type(e).__name__}: {e}). Nothing was changed") from e
    saved = [(alias, field, getattr(parallel, alias), annotations.get(field), fields[field].type)
             for alias, field, *_ in widen]
    try:
        for alias, field, optional, names, added in widen:
            accepted = typing.Literal[tuple(names) + tuple(added)]
            setattr(parallel, alias, accepted)
            annotations[field] = typing.Optional[accepted] if optional else accepted
            fields[field].type = annotations[field]
        rebuild(config_cls, force=True)
        # The configs that validate an EPLBConfig given as a dict embed its schema.
        for cls in embedding:
            rebuild(cls, force=True)
    except Exception as e:  # noqa: BLE001 - rolled back, then named
        for alias, field, old_alias, old_annotation, old_type in saved:
            setattr(parallel, alias, old_alias)
            annotations[field] = old_annotation
            fields[field].type = old_type
        for cls in [config_cls] + embedding:
            try:
                rebuild(cls, force=True)
            except Exception:  # noqa: BLE001 - the original schema was built once already
                pass
        added = ", ".join(f"{field} {name!r}" for _, field, _, _, names in widen for name in names)
        raise VllmLayoutError(
            f"eplbx.vllm.install(): rebuilding vLLM {version}'s config validators with {added} "
            f"failed ({type(e).__name__}: {e}). Every change was put back; use one of vLLM's own "
            "communicators and policies") from e


# ---------------------------------------------------------------------------------------
# eplbx's placement as vLLM's EPLB policy: `eplb_config={"policy": "eplbx"}`.

#: vLLM policy name -> eplbx placement policy (docs/placement.md).
POLICIES = {"eplbx": "incremental", "eplbx_balanced": "balanced"}


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                      old_global_expert_indices=None, policy: str = "eplbx") -> np.ndarray:
    """vLLM's AbstractEplbPolicy.rebalance_experts on numpy: the new phy2log (layers x
    num_replicas, int64) for the load `weight` (layers x logical experts).

    Like vLLM's default policy, groups are kept on nodes (hierarchical) when num_groups is a
    multiple of num_nodes, else the placement is global. "eplbx" is incremental from
    `old_global_expert_indices` (the phy2log in force): staying experts keep their slots and
    the fewest experts move at no loss of balance beyond eplbx's tolerance; without a usable
    map in force (none, another shape after a resize, or slots vLLM left empty, -1) it plans
    "balanced". "eplbx_balanced" is eplbx's balanced placement, keeping staying experts in
    their slots where a map is in force. What vLLM's contract cannot express is refused by
    name (InvalidArgumentError)."""
    from . import plan

    if policy not in POLICIES:
        raise InvalidArgumentError(f"eplbx: unknown vLLM EPLB policy {policy!r} (expected one of "
                                   f"{', '.join(POLICIES)})")
    load = np.asarray(weight, dtype=np.float64)
    if load.ndim != 2:
        raise InvalidArgumentError(f"eplbx: the load is {load.ndim}-D; vLLM passes layers x "
                                   "logical experts")
    layers, experts = load.shape
    replicas = _check_int(num_replicas, "num_replicas", 1, _INT32_MAX)
    ranks = _check_int(num_ranks, "num_ranks", 1, _INT32_MAX)
    nodes = _check_int(num_nodes, "num_nodes", 1, _INT32_MAX)
    groups = _check_int(num_groups, "num_groups", 1, _INT32_MAX)
    if replicas % ranks != 0:
        raise InvalidArgumentError(f"eplbx: num_replicas {replicas} is not a multiple of num_ranks "
                                   f"{ranks} (vLLM's contract: every rank holds as many slots)")
    if groups % nodes != 0:  # vLLM's default policy: then global
        groups, nodes = 1, 1
    previous = None
    if old_global_expert_indices is not None:
        old = np.asarray(old_global_expert_indices)
        if old.shape == (layers, replicas) and old.size and old.min() >= 0 and old.max() < experts:
            previous = old.astype(np.int32)
    eplbx_policy = POLICIES[policy]
    if previous is None and eplbx_policy == "incremental":
        eplbx_policy = "balanced"
    result = plan(load, slots=replicas, ranks=ranks, nodes=nodes, groups=groups,
                  policy=eplbx_policy, previous=previous)
    return result.phy2log.astype(np.int64)


def _policy_class(abstract, name: str):
    """A subclass of vLLM's AbstractEplbPolicy that plans with eplbx (policy `name`)."""

    def rebalance(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                  old_global_expert_indices=None):
        import torch

        old = old_global_expert_indices
        phy2log = rebalance_experts(weight.float().cpu().numpy(), num_replicas, num_groups,
                                    num_nodes, num_ranks,
                                    None if old is None else old.cpu().numpy(), policy=name)
        return torch.from_numpy(phy2log)

    rebalance.__doc__ = rebalance_experts.__doc__
    return type(''.join(p.title() for p in name.split('_')) + "Policy", (abstract,),
                {"rebalance_experts": classmethod(rebalance), "__module__": __name__})


def _plugin() -> None:
    """vLLM's `vllm.general_plugins` entry point (run in every vLLM process): install(), and
    where this vLLM is laid out otherwise, a warning naming the version and what was not found
    instead of stopping vLLM (its own communicators still work; selecting "eplbx" then fails in
    vLLM's config validation, after this warning)."""
    import logging

    try:
        install()
    except VllmLayoutError as e:
        logging.getLogger("eplbx").warning("%s", e)
    except Exception as e:  # noqa: BLE001 - vLLM's plugin loader must never see it
        logging.getLogger("eplbx").warning(
            "eplbx.vllm: switching eplbx on failed (%s: %s); vLLM goes on with its own "
            "communicators", type(e).__name__, e)
