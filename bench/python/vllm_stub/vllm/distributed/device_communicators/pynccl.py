"""vllm's PyNcclCommunicator: a type only (the bench never picks 'pynccl')."""


class PyNcclCommunicator:
    pass
