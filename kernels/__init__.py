"""Attention and storage kernels over the KV store.

`kernels.torch_attention` is the PyTorch path: the CPU implementation and the test oracle.
`kernels.triton_attention` (decode attention with the attention mass) and
`kernels.triton_store_ops` (quantize-on-append, compaction) run the same contracts on GPUs;
`kernels.dispatch` picks one per call (`AGENT_KV_KERNELS=auto|triton|torch`).
"""
