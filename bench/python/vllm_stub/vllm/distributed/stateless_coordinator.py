"""vllm.distributed.stateless_coordinator: elastic EP is not used here."""


class StatelessGroupCoordinator:
    pass
