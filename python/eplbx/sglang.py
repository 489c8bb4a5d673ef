"""A drop-in for SGLang's expert-weight update on eplbx's transfer engine and protocol.

    import eplbx.sglang
    eplbx.sglang.install()      # once per rank process, before SGLang's first rebalance
    # or, with eplbx installed in SGLang's environment, SGLang's plugin loading does it:
    #   EPLBX_SGLANG_UPDATER=1 python -m sglang.launch_server ... --eplb-algorithm eplbx

SGLang moves expert rows after an EPLB rebalance in
`sglang.srt.eplb.expert_location_updater.ExpertLocationUpdater.update` (torch.distributed
batch_isend_irecv per expert on the default group, every received row through a temporary copy
of the layer). install() replaces that method (SGLang calls it through the instance, so the
replacement is found at call time) with `update` below:

- rows move with eplbx: per layer every live rank computes the same transfers (eplbx.migrate:
  fewest, best-sourced, same-node sources first), local copies go first, remote rows are READ
  one-sidedly straight into the weight rows where nothing still reads them (eplbx._inplace);
  only rows in a cycle or still read by a peer go through scratch rows, sized to what the
  update needs (no temporary copy of the layer). Every tensor of the layer (w13, w2, scales...)
  moves, in the same storage.
- dead ranks (SGLang's elastic EP: `ElasticEPStateManager.instance().active_ranks_cpu`; no
  instance means every rank is alive) are neither waited for nor read from: an expert is read
  from any live holder, and only experts whose every old holder is dead are returned as
  missing, `{layer_id: [logical ids]}` (each once, in this rank's row order), for SGLang to load
  from its backup or the checkpoint. Those rows keep what they held.
- SGLang's global expert-location metadata is updated as SGLang's own update does
  (`old_metadata.update(new, update_layer_ids=...)`).
- the communicator (agent, registered weights, connections to the live ranks) is built on the
  first update and rebuilt only when the weights or the live ranks change. Its metadata
  exchange goes through torch.distributed's key-value store among the live ranks (no
  collective over the default group, which would wait for a dead rank).

It also makes "eplbx" and "eplbx_balanced" valid values of SGLang's `--eplb-algorithm`
(`compute_algorithm` / `rebalance_experts` of sglang.srt.eplb.eplb_algorithms, wrapped):
eplbx's incremental placement (staying experts keep their slots; groups kept on nodes when
SGLang's hierarchical condition holds) and its balanced one. SGLang's elastic EP only accepts
its own elasticity-aware algorithm, so these apply without elastic EP.

Options from the environment: EPLBX_TIMEOUT_S, EPLBX_TRANSPORT, EPLBX_PATHS (as for vLLM).
See docs/python.md, "SGLang".
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np

from ._eplbx import InvalidArgumentError, UnavailableError
from .vllm import _check_map, _check_timeout

#: SGLang's --eplb-algorithm values install() adds -> eplbx.vllm's policy names.
ALGORITHMS = {"eplbx": "eplbx", "eplbx_balanced": "eplbx_balanced"}

# Where install() patches SGLang, as found in SGLang 0.5.23: module -> attributes it must have.
_LAYOUT = {
    "sglang.srt.eplb.expert_location_updater": ("ExpertLocationUpdater",),
    "sglang.srt.eplb.expert_location": ("get_global_expert_location_metadata",),
    "sglang.srt.elastic_ep.elastic_ep": ("ElasticEPStateManager",),
    "sglang.srt.eplb.eplb_algorithms": ("compute_algorithm", "rebalance_experts"),
}
_UPDATE_PARAMS = ("self", "routed_experts_weights_of_layer", "new_expert_location_metadata",
                  "update_layer_ids", "nnodes", "rank", "use_flat_topology")
_CANARY_ENV = "SGLANG_EXPERT_LOCATION_UPDATER_CANARY"


class SglangLayoutError(RuntimeError):
    """The installed SGLang is not laid out as install() expects: it names the version and
    what was not found (install() never patches half of SGLang)."""


def live_ranks(world: int, active=None) -> list:
    """One flag per rank of the default group: SGLang's `active_ranks_cpu` (its elastic EP
    state; capacity past the world are reserved slots), or every rank when SGLang has no
    elastic state. `active`: the flags to use instead (tests)."""
    if active is None:
        from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

        state = ElasticEPStateManager.instance()
        active = None if state is None else state.active_ranks_cpu
    if active is None:
        return [True] * world
    flags = [bool(int(x)) for x in (active.tolist() if hasattr(active, "tolist") else active)]
    if len(flags) < world:
        raise InvalidArgumentError(f"eplbx: SGLang's active ranks name {len(flags)} ranks for a "
                                   f"world of {world}")
    return flags[:world]


def mask_dead(old, new, live, rows: int, me: int):
    """Pure: the maps eplbx moves by, and what no live rank can provide. `old`, `new`: layers
    x slots int32 (ranks x rows); `live`: one flag per rank. Slots of dead ranks become -1 in
    both maps (nothing is read from or written to them); a slot whose new expert no live rank
    held before becomes -1 in the new map (its row keeps what it held). Returns (old, new,
    missing): missing[l] = the logical ids rank `me` needs in layer l that only dead ranks
    held, each once, in its row order."""
    old, new = old.copy(), new.copy()
    for r, alive in enumerate(live):
        if not alive:
            old[:, r * rows:(r + 1) * rows] = -1
            new[:, r * rows:(r + 1) * rows] = -1
    missing = []
    for layer in range(old.shape[0]):
        held = np.isin(new[layer], old[layer][old[layer] >= 0])
        gone = (new[layer] >= 0) & ~held
        mine = [int(e) for e in new[layer, me * rows:(me + 1) * rows][gone[me * rows:(me + 1) * rows]]]
        missing.append(list(dict.fromkeys(mine)))
        new[layer][gone] = -1
    return old, new, missing


def _store_gather(store, prefix: str, rank: int, live, timeout_s: float):
    """An all-gather among the live ranks over a torch.distributed key-value store: each
    round's keys are `prefix/round/rank`; a dead rank is not waited for (its entry is empty).
    A live rank that does not contribute within `timeout_s` fails the round by name."""
    from datetime import timedelta

    rounds = itertools.count()

    def gather(blob: bytes) -> list:
        n = next(rounds)
        store.set(f"{prefix}/{n}/{rank}", blob)
        out = []
        for r, alive in enumerate(live):
            if not alive:
                out.append(b"")
            elif r == rank:
                out.append(bytes(blob))
            else:
                try:
                    store.wait([f"{prefix}/{n}/{r}"], timedelta(seconds=timeout_s))
                except Exception as e:  # noqa: BLE001 - torch's store errors vary by version
                    raise UnavailableError(
                        f"eplbx: rank {rank}: rank {r} did not join the exchange of the live ranks "
                        f"within {timeout_s:g} s ({type(e).__name__}: {e}); SGLang still counts it "
                        "alive (active_ranks_cpu): mark it inactive or restart it") from None
                out.append(store.get(f"{prefix}/{n}/{r}"))
        return out

    return gather


def _default_store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class Mover:
    """Moves one rank's expert rows for SGLang's update: the communicator over the weights and
    the live ranks (rebuilt when either changes), scratch rows, the optional canary."""

    def __init__(self, timeout_s: float = 300.0, transport: str = "auto", paths: str = "",
                 canary: bool = False, share: bool = False, store=None):
        self.timeout_s = _check_timeout(timeout_s)
        self.share = share
        self.transport, self.paths = transport, paths
        self.canary = canary
        self._store = store
        self._comm = None
        self._key = None
        self._scratch = {}  # (dtype, row shape) per tensor -> [tensors], rows = capacity
        self._registered = {}  # data_ptr of scratch -> its handle in the communicator
        self._canary = {}  # layer id -> int64 tensor (rows x 1): the expert each row holds
        self.last_update = None  # figures of the last update

    def _build(self, weights, ids, live, rank, world, old_cpu):
        from .vllm import EplbxCommunicator

        import torch

        if self.canary and not self._canary:
            rows = int(weights[ids[0]][0].shape[0])
            for i in ids:
                c = old_cpu[i, rank * rows:(rank + 1) * rows].to(torch.int64).reshape(rows, 1).clone()
                self._canary[i] = c.to(weights[i][0].device)
        layers = [list(weights[i]) + ([self._canary[i]] if self.canary else []) for i in ids]
        if self.share:
            from .vllm import _share_memory

            # EPLBX_SHARE_MEMORY=1: host rows in shared memory (in place; every view follows):
            # peers map them and READs are plain copies (GPU rows are left alone).
            _share_memory([t for layer in layers for t in layer])
        store = self._store if self._store is not None else _default_store()
        signature = "".join("1" if x else "0" for x in live)
        # Every live rank adds 1 per build with this live set: the same round on every rank,
        # a process that comes back included.
        build = (store.add(f"eplbx/sglang/{signature}/builds", 1) - 1) // sum(live)
        prefix = f"eplbx/sglang/{signature}/{build}"
        self._comm = None  # the old agent and connections go first
        self._comm = EplbxCommunicator(None, layers, [], timeout_s=self.timeout_s,
                                       transport=self.transport, paths=self.paths,
                                       allgather=_store_gather(store, prefix, rank, live, self.timeout_s),
                                       members=live)
        self._registered = {}

    def _reserve(self, layers, count: int):
        """Scratch rows for `count` buffered rows of every layer shape in `layers`."""
        import torch

        for tensors in layers:
            sig = tuple((t.dtype, tuple(t.shape[1:]), str(t.device)) for t in tensors)
            have = self._scratch.get(sig)
            if have is None or have[0].shape[0] < count:
                for s in have or []:  # unregistered before it is freed
                    handle = self._registered.pop(s.data_ptr(), None)
                    if handle is not None:
                        self._comm._comm.unregister_local(handle)
                self._scratch[sig] = [torch.empty((max(count, 1),) + tuple(t.shape[1:]), dtype=t.dtype,
                                                  device=t.device) for t in tensors]
            for s in self._scratch[sig]:
                if s.data_ptr() not in self._registered:
                    self._registered[s.data_ptr()] = self._comm._comm.register_local(
                        s.data_ptr(), s.element_size() * s.numel())

    def update(self, weights: dict, old_cpu, new_cpu, update_layer_ids, rank: int, world: int,
               nodes: int = 1, active=None) -> dict:
        """Moves rank `rank`'s rows of the layers `update_layer_ids` from the maps `old_cpu`
        to `new_cpu` (layers x slots, every layer of the model); returns {layer_id: [missing
        logical ids]} for the layers with experts only dead ranks held."""
        from . import _inplace

        ids = sorted(int(i) for i in weights)
        if not ids:
            return {}
        rows = int(weights[ids[0]][0].shape[0])
        for i in ids:
            for index, t in enumerate(weights[i]):
                if int(t.shape[0]) != rows or not t.is_contiguous():
                    raise InvalidArgumentError(
                        f"eplbx: rank {rank}: tensor {index} of layer {i} has {int(t.shape[0])} rows"
                        f"{'' if t.is_contiguous() else ' and is not contiguous'}; every expert tensor "
                        f"must be contiguous with {rows} rows (one per local physical expert)")
        unknown = [int(i) for i in update_layer_ids if int(i) not in weights]
        if unknown:
            raise InvalidArgumentError(f"eplbx: rank {rank}: update_layer_ids name layers {unknown} "
                                       "that routed_experts_weights_of_layer does not hold")
        slots = rows * world
        if old_cpu.shape[-1] != slots or new_cpu.shape[-1] != slots:
            raise InvalidArgumentError(
                f"eplbx: rank {rank}: the expert-location maps have {old_cpu.shape[-1]} (old) and "
                f"{new_cpu.shape[-1]} (new) physical experts; {world} ranks x {rows} rows is {slots}")
        live = live_ranks(world, active)
        if not live[rank]:
            raise InvalidArgumentError(f"eplbx: rank {rank} calls update but SGLang's active ranks "
                                       "count it dead")
        old = np.stack([_check_map(old_cpu[i], f"old map of layer {i}") for i in ids])
        wanted = np.stack([_check_map(new_cpu[i], f"new map of layer {i}") for i in ids])
        old, new, missing = mask_dead(old, wanted, live, rows, rank)
        key = (tuple((i, tuple((t.data_ptr(), tuple(t.shape), str(t.dtype)) for t in weights[i]))
                     for i in ids), tuple(live))
        built = 0.0
        if self._comm is None or self._key != key or self._comm.failed:
            self._key = None
            t0 = time.perf_counter()
            self._build(weights, ids, live, rank, world, old_cpu)
            built = time.perf_counter() - t0
            self._key = key
        at = {i: k for k, i in enumerate(ids)}
        layers = [list(weights[i]) + ([self._canary[i]] if self.canary else []) for i in ids]
        work = [at[int(i)] for i in update_layer_ids]

        def buffer_rows(layer, buffered):
            sig = tuple((t.dtype, tuple(t.shape[1:]), str(t.device)) for t in layers[layer])
            scratch = self._scratch[sig]
            return {row: [s[k] for s in scratch] for k, row in enumerate(buffered)}

        stats = _inplace.rearrange(self._comm, old, new, layers, buffer_rows, layers=work,
                                   nodes=nodes, reserve=lambda n: self._reserve([layers[k] for k in work], n),
                                   name=lambda k: f"layer {ids[k]}")
        out = {ids[k]: missing[k] for k in work if missing[k]}
        if self.canary:
            self._check_canary(ids, work, new, wanted, rank, rows)
        stats["missing"] = sum(len(v) for v in out.values())
        stats["build_seconds"] = built  # the communicator built (or rebuilt) by this update
        self.last_update = stats
        return out

    def _check_canary(self, ids, work, moved, wanted, rank, rows):
        """SGLang's canary check on eplbx (SGLANG_EXPERT_LOCATION_UPDATER_CANARY): a small
        tensor per layer whose row holds the id of the expert in that weight row moves with
        every row; afterwards each row moved must hold the expert the new map names. Rows of
        missing experts (`moved` -1, `wanted` the id), which SGLang loads afterwards, take
        their new id."""
        for k in work:
            want = moved[k, rank * rows:(rank + 1) * rows]
            canary = self._canary[ids[k]]
            got = canary.reshape(-1).cpu().numpy()
            bad = [r for r in range(rows) if want[r] >= 0 and int(got[r]) != int(want[r])]
            if bad:
                raise AssertionError(f"eplbx: rank {rank}: layer {ids[k]}: rows {bad} hold experts "
                                     f"{[int(got[r]) for r in bad]}, the new map names "
                                     f"{[int(want[r]) for r in bad]}")
            for r in range(rows):
                if want[r] < 0:
                    canary[r] = int(wanted[k, rank * rows + r])


# ---------------------------------------------------------------------------------------
# Switching eplbx on in an installed SGLang.

_MOVER = None  # this process's Mover (install() builds it; one per rank process)


def _options_from_env(environ=None) -> dict:
    """Mover keywords from EPLBX_TIMEOUT_S, EPLBX_TRANSPORT, EPLBX_PATHS (eplbx.vllm's
    parser: a value that does not parse is named), EPLBX_SHARE_MEMORY (0 or 1) and SGLang's
    canary variable."""
    from .vllm import options_from_env

    environ = os.environ if environ is None else environ
    out = {k: v for k, v in options_from_env(environ).items() if k in ("timeout_s", "transport", "paths")}
    out["canary"] = environ.get(_CANARY_ENV, "").strip().lower() in ("1", "true", "yes", "y")
    # Off by default here (unlike eplbx.vllm): moving the weights to shared memory costs more
    # at the first update than it saves over the next few (docs/perf.md, SGLang).
    share = environ.get("EPLBX_SHARE_MEMORY", "0").strip()
    if share not in ("0", "1"):
        raise InvalidArgumentError(f"eplbx: environment variable EPLBX_SHARE_MEMORY={share!r} is not 0 or 1")
    out["share"] = share == "1"
    return out


def update(self, routed_experts_weights_of_layer, new_expert_location_metadata, update_layer_ids,
           nnodes, rank, use_flat_topology=False):
    """SGLang's ExpertLocationUpdater.update on eplbx (install() puts it in place): moves this
    rank's expert rows of `update_layer_ids` to `new_expert_location_metadata`, updates SGLang's
    global expert-location metadata as SGLang's own update does, and returns {layer_id:
    [logical ids]} of the experts only dead ranks held (empty when none)."""
    import torch.distributed as dist
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    global _MOVER
    if _MOVER is None:
        _MOVER = Mover(**_options_from_env())
    old_metadata = get_global_expert_location_metadata()
    if old_metadata is None:
        raise InvalidArgumentError("eplbx: SGLang has no global expert-location metadata to update from")
    world = dist.get_world_size()
    if int(rank) != dist.get_rank():
        raise InvalidArgumentError(
            f"eplbx: SGLang passed rank {int(rank)} but this process is rank {dist.get_rank()} of the "
            "default group; eplbx (like SGLang's own updater, which sends to global ranks) needs the "
            "expert-parallel ranks to be the default group's")
    if int(old_metadata.num_local_physical_experts) * world != int(old_metadata.num_physical_experts):
        raise InvalidArgumentError(
            f"eplbx: SGLang's metadata has {old_metadata.num_physical_experts} physical experts over "
            f"ep_size {old_metadata.ep_size}, but the default group has {world} ranks")
    missing = _MOVER.update(routed_experts_weights_of_layer, old_metadata.physical_to_logical_map_cpu,
                            new_expert_location_metadata.physical_to_logical_map_cpu,
                            list(update_layer_ids), int(rank), world,
                            nodes=1 if use_flat_topology else int(nnodes))
    old_metadata.update(new_expert_location_metadata, update_layer_ids=update_layer_ids)
    return missing


update._eplbx = True


class _Algorithm:
    """What the wrapped compute_algorithm returns for "eplbx" / "eplbx_balanced"."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"EplbxAlgorithm({self.name!r})"


def _rebalance(original, tokens_per_expert, num_physical_experts, num_local_physical_experts,
               num_groups, num_nodes, algorithm):
    """SGLang's eplb_algorithms.rebalance_experts: eplbx's placement for an _Algorithm, else
    SGLang's own. Returns SGLang's (physical_to_logical_map, logical_to_all_physical_map,
    expert_count)."""
    if not isinstance(algorithm, _Algorithm):
        return original(tokens_per_expert, num_physical_experts, num_local_physical_experts,
                        num_groups, num_nodes, algorithm)
    import torch
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    from .vllm import rebalance_experts

    weight = tokens_per_expert.sum(dim=0) if tokens_per_expert.dim() == 3 else tokens_per_expert
    ranks = num_physical_experts // num_local_physical_experts
    in_force = get_global_expert_location_metadata()
    previous = None if in_force is None else in_force.physical_to_logical_map_cpu.numpy()
    phy2log = rebalance_experts(weight.float().cpu().numpy(), num_physical_experts,
                                1 if num_groups is None else num_groups, num_nodes, ranks,
                                previous, policy=ALGORITHMS[algorithm.name])
    return tuple(torch.from_numpy(a).to(tokens_per_expert.device) for a in replicas_of(phy2log, weight.shape[-1]))


def replicas_of(phy2log, experts: int):
    """Pure: SGLang's (physical_to_logical_map, logical_to_all_physical_map, expert_count)
    from a phy2log (layers x slots): each expert's slots in ascending order, padded with -1."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers, _ = phy2log.shape
    count = np.zeros((layers, experts), dtype=np.int64)
    for layer in range(layers):
        np.add.at(count[layer], phy2log[layer][phy2log[layer] >= 0], 1)
    width = max(1, int(count.max()) if count.size else 1)
    log2phy = np.full((layers, experts, width), -1, dtype=np.int64)
    for layer in range(layers):
        seen = np.zeros(experts, dtype=np.int64)
        for slot, e in enumerate(phy2log[layer]):
            if e >= 0:
                log2phy[layer, e, seen[e]] = slot
                seen[e] += 1
    return phy2log, log2phy, count


def _compute(original, raw_algorithm, num_groups, num_nodes):
    if raw_algorithm in ALGORITHMS:
        return _Algorithm(raw_algorithm)
    return original(raw_algorithm, num_groups, num_nodes)


def _sglang_version() -> str:
    try:
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        raise SglangLayoutError(f"eplbx.sglang.install(): SGLang is not importable here ({e!r})") from e


def _find_layout(version: str) -> dict:
    import importlib
    import inspect

    found, missing = {}, []
    for module_name, attrs in _LAYOUT.items():
        try:
            found[module_name] = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001
            missing.append(f"module {module_name} ({type(e).__name__}: {e})")
            continue
        missing += [f"{module_name}.{a}" for a in attrs if not hasattr(found[module_name], a)]
    cls = getattr(found.get("sglang.srt.eplb.expert_location_updater"), "ExpertLocationUpdater", None)
    fn = getattr(cls, "update", None)
    if fn is not None:
        params = tuple(inspect.signature(getattr(fn, "_eplbx_original", fn)).parameters)
        if params[:len(_UPDATE_PARAMS)] != _UPDATE_PARAMS:
            missing.append(f"ExpertLocationUpdater.update{_UPDATE_PARAMS} (this SGLang has update{params})")
    if missing:
        raise SglangLayoutError(f"eplbx.sglang.install(): SGLang {version} is not laid out as eplbx "
                                f"expects (checked against 0.5.23): {'; '.join(missing)}. Nothing was "
                                "changed; SGLang's own updater stays in place")
    return found


def _wrap(module, name, wrapper) -> None:
    import functools

    original = getattr(module, name)
    if getattr(original, "_eplbx_original", None):
        return
    wrapped = functools.wraps(original)(functools.partial(wrapper, original))
    wrapped._eplbx_original = original
    setattr(module, name, wrapped)


def install(updater: bool = True, algorithms: bool = True) -> str:
    """Switches SGLang's expert-weight update to eplbx (ExpertLocationUpdater.update, see the
    module's docstring; `updater`) and adds "eplbx" / "eplbx_balanced" to the EPLB algorithms
    SGLang accepts (`--eplb-algorithm eplbx`; `algorithms`). Call once per rank process
    (before SGLang's first rebalance; torch.distributed need not be up yet); idempotent.
    SGLang's plugin loading does it without a call (the `sglang.srt.plugins` entry point,
    `_plugin`). An SGLang laid out otherwise raises SglangLayoutError naming its version and
    what was not found, before anything is changed. Options are read at the first update
    (EPLBX_TIMEOUT_S, EPLBX_TRANSPORT, EPLBX_PATHS; SGLang's canary variable); a variable that
    does not parse is named here already. Returns the SGLang version."""
    version = _sglang_version()
    layout = _find_layout(version)
    _options_from_env()  # a bad variable is named now, not at the first rebalance
    if updater:
        cls = layout["sglang.srt.eplb.expert_location_updater"].ExpertLocationUpdater
        if not getattr(cls.update, "_eplbx", False):
            update._eplbx_original = cls.update
            cls.update = update
    if algorithms:
        module = layout["sglang.srt.eplb.eplb_algorithms"]
        _wrap(module, "compute_algorithm", _compute)
        _wrap(module, "rebalance_experts", _rebalance)
    return version


#: EPLBX_SGLANG_UPDATER=1: SGLang's plugin loading also switches the updater (default: only
#: the algorithms, which SGLang uses only when --eplb-algorithm names them).
_UPDATER_ENV = "EPLBX_SGLANG_UPDATER"


def _plugin() -> None:
    """SGLang's `sglang.srt.plugins` entry point (run in every SGLang process): install() with
    the updater when EPLBX_SGLANG_UPDATER=1, else the algorithms only (a value other than 0 or
    1 is named in a warning and counts as 0). Where this SGLang is laid
    out otherwise, a warning naming the version and what was not found instead of stopping
    SGLang (its own updater and algorithms keep working)."""
    import logging

    log = logging.getLogger("eplbx")
    try:
        raw = os.environ.get(_UPDATER_ENV, "0").strip()
        if raw not in ("0", "1"):
            log.warning("eplbx: environment variable %s=%r is not 0 or 1; SGLang keeps its own "
                        "updater (eplbx's EPLB algorithms are added)", _UPDATER_ENV, raw)
        install(updater=raw == "1")
    except SglangLayoutError as e:
        log.warning("%s", e)
    except Exception as e:  # noqa: BLE001 - SGLang's plugin loader must never see it
        log.warning("eplbx.sglang: switching eplbx on failed (%s: %s); SGLang goes on with its own "
                    "updater and algorithms", type(e).__name__, e)


def uninstall() -> None:
    """Puts SGLang's own updater and algorithm selection back (tests and benchmarks that
    compare both in one process)."""
    import sglang.srt.eplb.eplb_algorithms as algorithms
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    if getattr(ExpertLocationUpdater.update, "_eplbx", False):
        ExpertLocationUpdater.update = update._eplbx_original
    for name in ("compute_algorithm", "rebalance_experts"):
        original = getattr(getattr(algorithms, name), "_eplbx_original", None)
        if original is not None:
            setattr(algorithms, name, original)
