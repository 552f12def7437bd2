"""The SGLang side: the entry point (plugin), the forward_extend hook, eligibility, validate mode
(shadow), Prometheus metrics and structlog events.

Importing this package is cheap (no torch, no sglang): `plugin.register` runs in every SGLang
process before it chooses a GPU. `import sglang` inside these modules is the real SGLang
(absolute imports): this package is `kdtree_backend.sglang`.
"""
