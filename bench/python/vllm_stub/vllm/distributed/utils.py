"""vllm.distributed.utils.is_weak_contiguous, with vLLM's semantics: contiguous, or the
storage from the tensor's offset onward is exactly its bytes."""


def is_weak_contiguous(inp):
    return inp.is_contiguous() or (
        inp.storage().nbytes() - inp.storage_offset() * inp.element_size()
        == inp.numel() * inp.element_size())
