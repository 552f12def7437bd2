"""`python -m kdtree_backend.build`: the documented command; the build lives in kdtree_backend.kernel.build."""
import sys

from kdtree_backend.kernel.build import main

if __name__ == "__main__":
    sys.exit(main())
