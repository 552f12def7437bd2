"""The kernel part: the C ABI mirror (abi), the library loader, the op, the nvcc build, the CUDA sources (csrc/).

Imports nothing of sglang; `ops` imports torch, `loader` and `abi` do not.
"""
