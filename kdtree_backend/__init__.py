"""kdtree-backend: a CUDA kernel for SGLang's TARGET_VERIFY tree attention on MLA models.

Importing this package is cheap and side-effect free (no torch, no CUDA, no sglang): SGLang loads
the plugin (`kdtree_backend.sglang.plugin:register`) in every process before it chooses a GPU.
"""

__version__ = "0.1.0"
