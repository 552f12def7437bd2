import sys

from kdtree_backend.launcher.main import main

sys.exit(main())
