"""Attention kernels over the KV store.

`kernels.reference` is the PyTorch path: the CPU implementation and the test oracle for the
Triton kernels that later run the same contract on GPUs.
"""
