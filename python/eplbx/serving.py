"""eplbx.ServingGroup: the serving runtime for a Python engine (docs/python.md, "Serving").

One ServingGroup per rank owns the EPLB loop (window, trigger, plans, asynchronous
rearrangements of this rank's expert weights) and goes on through any change of the member
set: a rank lost (its process died or hung), a rank drained, a new process joining (a rank
added, or a lost rank's process started again). Membership and the step's collective go
through the built-in coordinator (`eplbx.Store`, a TCP store with epochs), not through the
engine's process group: a gloo or NCCL group whose member died cannot be used any more,
while the coordinator names the loss and the survivors settle over themselves.

    store = eplbx.Store("127.0.0.1", port, token, world)            # on one process
    g = eplbx.ServingGroup(rank, world, ("127.0.0.1", port, token), weights, initial,
                           experts=256, backup_dir="/dev/shm")
    for step in ...:
        forward(...)
        g.step(counts)                  # (layers, experts) token counts, the same on every rank
        for layer, phy2log, rows in g.commit():
            ...                         # switch the engine's map of `layer` now
        if g.sync():                    # the step's collective: True after a membership change
            ...                         # g.placement is the map in force (every layer)
"""

import numpy as np

from ._eplbx import AbortedError, _ServingGroup


class MembershipChangedError(AbortedError):
    """The member set changed and the group could not settle over it (for instance it kept
    changing during every placement). `epoch` and `members` are the last ones this rank saw."""

    def __init__(self, message, epoch, members):
        super().__init__(message)
        self.epoch = epoch
        self.members = members


def _tensor_layout(weights):
    """Per layer, per tensor: (name, dtype, expert shape, address, bytes per expert, rows); and
    the regions to register (address, bytes)."""
    layers, regions = [], []
    rows = None
    for layer, tensors in enumerate(weights):
        specs = []
        for t, w in enumerate(tensors):
            if not w.is_contiguous():
                raise ValueError(f"layer {layer} tensor {t}: weights must be contiguous")
            if w.device.type != "cpu":
                raise ValueError(f"layer {layer} tensor {t}: eplbx.ServingGroup serves CPU tensors "
                                 f"here (got {w.device}); CUDA tensors go through eplbx.vllm")
            if w.dim() < 1 or w.shape[0] < 1:
                raise ValueError(f"layer {layer} tensor {t}: expected [rows, ...], got {tuple(w.shape)}")
            if rows is None:
                rows = w.shape[0]
            elif w.shape[0] != rows:
                raise ValueError(f"layer {layer} tensor {t} has {w.shape[0]} rows; the first has {rows}")
            row_bytes = w[0].numel() * w.element_size()
            specs.append((f"t{t}", str(w.dtype).replace("torch.", ""), list(w.shape[1:]), w.data_ptr(),
                          row_bytes, w.shape[0]))
            regions.append((w.data_ptr(), w.numel() * w.element_size()))
        layers.append(specs)
    return layers, regions


class ServingGroup:
    """One rank of a serving group over torch CPU tensors.

    weights: per MoE layer, a list of tensors [slots per rank, ...] (every layer the same
    tensors), rows holding the experts `initial` puts in this rank's slots.
    initial: (layers, slots) logical expert per physical slot, the same on every rank (None on
    a process that joins a group under way: the store welcomes it as a joiner).
    store: (address, port, token) of the coordinator (eplbx.Store), or "etcd://HOST:PORT[,...]"
    to coordinate on etcd with no coordinator process (then `token` and `group`, the key
    prefix, are given as keywords; docs/deploy.md, "Coordination on etcd").
    """

    def __init__(self, rank, world, store, weights, initial, experts, *, nodes=1,
                 policy="incremental", window=1000, interval=1000, mode="async", deadline_s=10.0,
                 backup_dir=None, node="node", token=None, group="eplbx"):
        if isinstance(store, str):
            if not store.startswith("etcd://") or not token:
                raise ValueError("eplbx: store is a string: it must be etcd://HOST:PORT[,...] and "
                                 "token= must be given")
            addr, port = store, 0
        else:
            addr, port, token = store
        layers, regions = _tensor_layout(weights)
        self._weights = weights  # the group reads and writes them: keep them alive
        self._g = _ServingGroup(rank, world, addr, port, token, layers, regions,
                                None if initial is None else np.asarray(initial, dtype=np.int32),
                                experts, nodes, policy, window, interval, mode, deadline_s,
                                backup_dir or "", node, group)

    def step(self, counts):
        """After every forward step: (layers, experts) token counts, the same on every rank."""
        return self._g.step(np.ascontiguousarray(counts, dtype=np.float64))

    def commit(self):
        """At the safe point: [(layer, phy2log, row_of_slot)] in force from now on."""
        return self._g.commit()

    def poll(self):
        """Between the layers of a forward pass: drives the asynchronous rebalance in flight
        (takes peers' records, posts READs within the step's budget) so it needs fewer steps;
        never switches a layer. Returns at once when nothing is in flight."""
        self._g.poll()

    def sync(self):
        """The step's collective. True when the member set changed and the group settled over
        the new one (see recoveries); raises MembershipChangedError when it could not."""
        try:
            return self._g.sync()
        except AbortedError as e:
            raise MembershipChangedError(str(e), self._g.epoch, self._g.members) from e

    def drain(self, rank):
        """Graceful removal of `rank`, on every member at the same step; on `rank` itself
        `left` is True afterwards and it should close()."""
        self._g.drain(rank)

    def close(self):
        self._g.close()

    @property
    def placement(self):
        """(layers, slots) logical expert per physical slot in force (-1: empty)."""
        return self._g.placement

    def row_table(self, layer):
        return self._g.row_table(layer)

    def prometheus(self):
        """The Balancer's metrics and the serving runtime's (eplbx_recoveries_total{kind},
        eplbx_recovery_seconds, eplbx_experts_recovered_total, eplbx_membership_epoch,
        eplbx_members) as Prometheus text (docs/architecture.md)."""
        return self._g.prometheus()

    @property
    def recoveries(self):
        """Every settling so far: kind (loss, join, drain), step, epoch, members, recovery_s, ..."""
        return self._g.recoveries

    @property
    def epoch(self):
        return self._g.epoch

    @property
    def members(self):
        return self._g.members

    @property
    def steps(self):
        return self._g.step_count

    @property
    def left(self):
        return self._g.left

    @property
    def rebalancing(self):
        return self._g.rebalancing
