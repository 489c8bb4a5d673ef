"""vllm's ncclDataTypeEnum: a type only (the bench never picks 'pynccl')."""


class ncclDataTypeEnum:  # noqa: N801 - vLLM's name
    @staticmethod
    def supports_torch_dtype(dtype):
        return True
