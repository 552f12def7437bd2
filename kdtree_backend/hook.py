"""Placeholder: the forward_extend AROUND hook (owned by the validate/on work; see docs/interfaces.md)."""


def forward_extend_hook(original_fn, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    return original_fn(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


forward_extend_hook.__kdtree_hook__ = True


def is_kdtree_hook(fn) -> bool:
    """True when `fn` is (a wrapper around) this package's hook."""
    return getattr(fn, "__kdtree_hook__", False) or getattr(getattr(fn, "__wrapped__", None), "__kdtree_hook__", False)
