"""eplbx: expert-parallel load balancing for Mixture-of-Experts inference.

    import eplbx
    p = eplbx.plan(load, slots=288, ranks=32, nodes=4, groups=8)   # numpy in, numpy out
    m = eplbx.migrate(old_phy2log, p.phy2log, ranks=32, nodes=4)
    b = eplbx.Balancer(p.phy2log, experts=256, ranks=32, window=1000, interval=1000)
    b.step(counts); new_maps = b.commit()                           # the EPLB loop
    from eplbx.vllm import EplbxCommunicator                        # vLLM's EPLB communicator
    g = eplbx.ServingGroup(rank, world, store, weights, initial, experts=256)  # serving runtime

Errors are eplbx.EplbxError subclasses named after the C++ status codes
(InvalidArgumentError, MismatchError, TimeoutError, UnavailableError, ...); the ones that
have a builtin counterpart also derive from it (ValueError, TimeoutError, ConnectionError).
"""

from ._eplbx import (  # noqa: F401
    AbortedError,
    Balancer,
    CorruptionError,
    EplbxError,
    InternalError,
    InvalidArgumentError,
    IoError,
    MismatchError,
    NotFoundError,
    NotSupportedError,
    OutOfRangeError,
    PlanResult,
    Store,
    TimeoutError,
    UnavailableError,
    migrate,
    plan,
)
from .serving import MembershipChangedError, ServingGroup  # noqa: F401,E402

__all__ = [
    "plan",
    "Balancer",
    "migrate",
    "PlanResult",
    "ServingGroup",
    "Store",
    "MembershipChangedError",
    "EplbxError",
    "AbortedError",
    "CorruptionError",
    "InternalError",
    "InvalidArgumentError",
    "IoError",
    "MismatchError",
    "NotFoundError",
    "NotSupportedError",
    "OutOfRangeError",
    "TimeoutError",
    "UnavailableError",
]
