"""The process-aware launcher: `python launch_with_kdtree.py <sglang args>` / `python -m kdtree_backend.launcher`.

- `main`: order of work (own flags, mode + kernel library, --help, argument preflight, watched child).
- `preflight`: SGLang's parser and resolution in a subprocess; configuration errors -> one line, exit 78.
- `readiness`: the child supervisor (liveness on every probe, /health_generate, signals, output tail).
- `sdnotify`: READY=1 / STATUS= / EXTEND_TIMEOUT_USEC= to $NOTIFY_SOCKET without a library.

Importing this package is cheap (stdlib only); sglang is imported only by the preflight subprocess.
"""
