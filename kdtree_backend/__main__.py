"""`python -m kdtree_backend doctor`: what this machine can run (see kdtree_backend.doctor)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdtree_backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("doctor", help="check sglang, mode, kernel library, GPUs; exit 0 when the mode can run here")
    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        from kdtree_backend import doctor

        return doctor.main(rest)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
