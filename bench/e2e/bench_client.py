"""Run SGLang's own benchmark client, `python -m sglang.bench_serving ARGS`, unchanged.

The only difference from running the module directly: when Hugging Face `datasets` is not
installed, the stand-in in bench/e2e/stubs/ is appended to the END of sys.path (so a real
installation always wins), because sglang 0.5.23's client imports `datasets` at module level for
a dataset this check does not use (see stubs/datasets/__init__.py).

    python3 bench/e2e/bench_client.py --backend sglang --dataset-name random-ids --tokenize-prompt ...
"""
import importlib.util
import os
import runpy
import sys

if importlib.util.find_spec("datasets") is None:
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs"))
sys.argv = ["sglang.bench_serving", *sys.argv[1:]]
runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
