"""vllm.platforms.current_platform: CUDA when torch sees a device (the NIXL communicator's
case), never ROCm."""


class _Platform:
    def is_rocm(self):
        return False

    def is_cuda_alike(self):
        import torch

        return torch.cuda.is_available()

    def is_cuda(self):
        return self.is_cuda_alike()


current_platform = _Platform()
