"""Stand-in for Hugging Face `datasets`, used ONLY when it is not installed (bench_client.py).

sglang 0.5.23's benchmark client imports `from datasets import load_dataset` at module level for its
MMMU dataset (sglang/benchmark/datasets/mmmu.py), so `python -m sglang.bench_serving` cannot even
start without it, although the token-id dataset used here (`--dataset-name random-ids
--tokenize-prompt`) never touches it. `datasets` pulls pyarrow (~40 MB), which does not fit the
transfer to the GPU machine. Any real use fails loudly.
"""


def load_dataset(*args, **kwargs):
    raise RuntimeError("bench/e2e/stubs/datasets is a stand-in: Hugging Face `datasets` is not installed here")
