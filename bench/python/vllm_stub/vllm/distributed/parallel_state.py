"""vllm.distributed.parallel_state: no pipeline parallelism (the NIXL communicator names its
agent after the pipeline rank only when there are several)."""
from types import SimpleNamespace


class GroupCoordinator:  # a type in signatures; the bench passes process groups directly
    pass


def get_pp_group():
    return SimpleNamespace(world_size=1, rank_in_group=0)


def is_local_first_rank():
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
