"""vllm.utils.torch_utils.PIN_MEMORY: pinned host memory wherever a device exists."""
import torch

PIN_MEMORY = torch.cuda.is_available()
