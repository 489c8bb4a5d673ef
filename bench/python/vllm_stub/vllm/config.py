"""vllm.config.ParallelConfig: only named by eplb_utils' type hints here."""


class ParallelConfig:
    pass
