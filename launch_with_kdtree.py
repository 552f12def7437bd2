#!/usr/bin/env python3
"""Start SGLang with the kdtree verify kernel: `python launch_with_kdtree.py <sglang args>`.

A thin shim over `kdtree_backend.launcher.main` (also `python -m kdtree_backend.launcher`, which
works from any directory once the package is installed). See docs/operations.md.
"""
import os
import sys

if __name__ == "__main__":
    # Running the file from a checkout that is not pip-installed: make the package importable.
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(here, "kdtree_backend")) and here not in sys.path:
        sys.path.insert(0, here)
    from kdtree_backend.launcher.main import main

    sys.exit(main())
