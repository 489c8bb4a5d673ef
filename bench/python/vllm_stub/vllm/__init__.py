"""Not vLLM: the few names vLLM 0.33's EPLB files (vllm/distributed/eplb/, taken unchanged from
the PyPI wheel by bench/python/gpu_carry.py) import from the rest of vLLM, for
bench/python/bench_vllm_nixl.py on a machine where vLLM cannot be installed. Each stub does
what the real one does for a single-node, non-elastic, CUDA (or host) run and nothing more;
the communicators and the rearrangement loop under test are vLLM's own code."""
__version__ = "stub"
