"""The entry point's value before the package was split by part (`kdtree_backend.plugin:register`).

An environment installed before that still carries the old value in its metadata; SGLang would
then fail to import it and serve stock Triton. This alias keeps such an install working (and the
launcher accepts it) until it is reinstalled. New installs point at kdtree_backend.sglang.plugin.
"""
from kdtree_backend.sglang.plugin import register

__all__ = ["register"]
