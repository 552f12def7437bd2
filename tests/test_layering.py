"""The package's parts import only the parts above them (docs/architecture.md, "The parts"): no
cycles, no upward imports. Read from the sources with ast (imports inside functions included)."""
from __future__ import annotations

import ast
from pathlib import Path

import kdtree_backend

ROOT = Path(kdtree_backend.__file__).resolve().parent
# part -> rank; a module may import its own part and parts of LOWER rank only
RANK = {"__init__": 0, "errors": 1, "config": 2, "kernel": 3, "sglang": 4, "launcher": 5, "tools": 6, "testing": 7}
TOOLS = {"doctor", "__main__", "build", "plugin"}  # top-level entry modules (build/plugin: documented aliases)


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    head = parts[1]
    return "tools" if head in TOOLS and len(parts) == 2 else head


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for a in node.names:
                yield f"{node.module}.{a.name}"


def test_no_upward_imports():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        mod = ".".join(rel.parts)
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        me = _part(mod) if "." in mod else "__init__"
        for target in _imports(path):
            if not target.startswith("kdtree_backend"):
                continue
            other = _part(target)
            if other in RANK and RANK[other] > RANK[me] and not (me == "tools" and other == "tools"):
                bad.append(f"{mod} ({me}) imports {target} ({other})")
    assert not bad, "\n".join(sorted(set(bad)))


def test_package_import_is_cheap():
    import subprocess
    import sys

    code = ("import sys, kdtree_backend, kdtree_backend.sglang, kdtree_backend.kernel, kdtree_backend.testing;"
            "print(sorted(m for m in ('torch', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
