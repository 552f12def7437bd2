"""Guard for behaviour-neutral kernel refactors: the machine code of two source trees, kernel by kernel.

    python tools/sass_diff.py --ref daeca01                 # the working tree against a commit
    python tools/sass_diff.py --ref HEAD --arch 120         # one arch only (faster)
    python tools/sass_diff.py --ref-tree A --tree B         # two directories (no git)

Each side is built by ITS OWN build module (kdtree_backend/kernel/build.py, or kdtree_backend/build.py
in trees older than the package's reorganisation), exactly as `python -m kdtree_backend.build` ships
it; a git ref is materialised with `git archive` into a temporary directory. Then, per arch (sm_90,
sm_90a, sm_120 for the default build) and per kernel:

  * the SASS of the library's fat binary (cuobjdump -sass): every instruction with its encoding.
    Normalised: the kernel's name (demangled, namespace qualifiers dropped, so a kernel that moved
    namespace is still paired with itself), the instruction addresses (offsets inside the function,
    redundant with the order), the fat binary's identifier lines (source paths). cuobjdump prints no
    -lineinfo file/line data, and none of it reaches the comparison;
  * the kernel's ELF attributes (cuobjdump -elf: .nv.info.<kernel>, its constant bank 0, its local
    and shared memory sizes; the per-function entries of the global .nv.info), names normalised;
  * the ptxas resource report (registers, barriers, shared memory, stack, spills) from the build log;
  * the cubins byte for byte: every translation unit that the build compiles for the device is
    compiled again with `nvcc -cubin` (the build's own flags minus -lineinfo, whose line tables
    change with any edited comment) per arch, and cubins holding the same kernels under the same
    names are compared with cmp. Where the translation-unit layout changed (a kernel renamed or no
    cubin with the same kernel set), that pair is reported as not comparable; the checks above
    still hold kernel by kernel.

Exit status: 0 identical, 1 a difference (the first differing instructions are printed), 2 the tool
or a build failed. Results are cached per source digest (--cache-dir), so a fixed ref is built once.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

TOOL_VERSION = 2
REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".py")


class ToolError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------------
# finding the toolchain


def _tree_build_module(tree: Path) -> str:
    """The dotted name of the tree's build module (the reorganised layout first)."""
    new = tree / "kdtree_backend" / "kernel" / "build.py"
    if new.is_file() and "def build(" in new.read_text():
        return "kdtree_backend.kernel.build"
    old = tree / "kdtree_backend" / "build.py"
    if old.is_file() and "def build(" in old.read_text():
        return "kdtree_backend.build"
    raise ToolError(f"{tree}: no kdtree_backend build module with a build() function")


def _find_tools() -> tuple[str, str]:
    """(nvcc, cuobjdump), found the way this repository's build finds them."""
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from kdtree_backend.kernel import build as here  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    nvcc, cuobjdump = here.find_nvcc(), here.find_cuobjdump()
    if nvcc is None:
        raise ToolError("nvcc not found (PATH, $NVCC or /usr/local/cuda/bin)")
    if cuobjdump is None:
        raise ToolError("cuobjdump not found (CUDA toolkit or the triton wheel)")
    return nvcc, cuobjdump


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# --------------------------------------------------------------------------------------------------
# source trees


def materialise_ref(ref: str, dest: Path, repo: Path = REPO_ROOT) -> str:
    """`git archive` of the package at `ref` into dest; returns the full commit id."""
    sha = _run(["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"])
    if sha.returncode != 0:
        raise ToolError(f"git rev-parse {ref}: {sha.stderr.strip()}")
    commit = sha.stdout.strip()
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit, "kdtree_backend"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True)
    archive.stdout.close()
    err = archive.stderr.read().decode()
    if archive.wait() != 0 or untar.returncode != 0:
        raise ToolError(f"git archive {commit}: {err.strip()} {untar.stderr.decode().strip()}")
    return commit


def tree_digest(tree: Path) -> str:
    """Digest of everything under kdtree_backend/ that can reach a build (sources, build module)."""
    h = hashlib.sha256()
    pkg = tree / "kdtree_backend"
    for p in sorted(pkg.rglob("*")):
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts and "_lib" not in p.parts:
            h.update(str(p.relative_to(tree)).encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# building one side

_WRAPPER = """#!{python}
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
os.execv({nvcc!r}, [{nvcc!r}] + sys.argv[1:])
"""

_BUILD_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import importlib
mod = importlib.import_module(sys.argv[2])
archs = tuple(int(a) for a in sys.argv[4].split(",")) if sys.argv[4] else None
rep = mod.build(sys.argv[3], archs)
print(json.dumps({"module": mod.__file__, "log": rep.ptxas_log}))
"""


def build_side(tree: Path, workdir: Path, archs, nvcc: str) -> dict:
    """Build the tree's library with its own build module; returns the .so path, ptxas log and the
    nvcc command lines the build ran."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "nvcc_calls.jsonl"
    log.unlink(missing_ok=True)
    wrapper = workdir / "nvcc"
    wrapper.write_text(_WRAPPER.format(python=sys.executable, log=str(log), nvcc=nvcc))
    wrapper.chmod(0o755)
    out = workdir / "libkdtree_verify.so"
    env = dict(os.environ, NVCC=str(wrapper), PYTHONDONTWRITEBYTECODE="1")
    module = _tree_build_module(tree)
    proc = _run([sys.executable, "-c", _BUILD_SCRIPT, str(tree), module, str(out),
                 ",".join(str(a) for a in archs) if archs else ""], env=env, cwd=str(workdir))
    if proc.returncode != 0:
        raise ToolError(f"build of {tree} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    calls = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {"so": str(out), "ptxas_log": res["log"], "module": res["module"], "nvcc_calls": calls}


def _cubin_jobs(calls: list[list[str]]) -> list[tuple[str, str, list[str]]]:
    """(source, gencode, flags) for every device compile of the build, without -lineinfo."""
    jobs = []
    for args in calls:
        sources = [a for a in args if a.endswith(".cu")]
        gencodes, flags = [], []
        i = 0
        while i < len(args):
            a = args[i]
            if a.startswith("-gencode="):
                gencodes.append(a)
            elif a == "-gencode" and i + 1 < len(args):
                gencodes.append("-gencode=" + args[i + 1])
                i += 1
            elif a.startswith(("-D", "-I", "-std=", "-O")) or a in ("-use_fast_math",):
                flags.append(a)
            elif a in ("-I", "-D") and i + 1 < len(args):
                flags += [a, args[i + 1]]
                i += 1
            i += 1
        gencodes = [g for g in gencodes if re.search(r"code=sm_\w+", g)]  # PTX-only gencodes (code=compute_NN) have no SASS
        for src in sources:
            for g in gencodes:
                jobs.append((src, g, flags))
    return jobs


def build_cubins(calls, workdir: Path, nvcc: str, tree: Path) -> list[dict]:
    out = []
    for n, (src, gencode, flags) in enumerate(_cubin_jobs(calls)):
        arch = re.search(r"code=(sm_\w+)", gencode).group(1)
        path = workdir / f"tu{n}_{Path(src).stem}.{arch}.cubin"
        proc = _run([nvcc, "-cubin", *flags, gencode, src, "-o", str(path)])
        if proc.returncode != 0:
            raise ToolError(f"nvcc -cubin {src} ({arch}) failed:\n{proc.stderr[-4000:]}")
        try:
            label = Path(src).resolve().relative_to(tree.resolve()).as_posix()
        except ValueError:
            label = src
        out.append({"source": label, "arch": arch, "path": str(path), "kernels": sorted(elf_kernels(path))})
    return out


# --------------------------------------------------------------------------------------------------
# reading what was built


def elf_sections(path) -> dict[str, bytes]:
    """Section name -> contents of an ELF64 little-endian file (a cubin)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ToolError(f"{path}: not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff, strsize = heads[shstrndx][4], heads[shstrndx][5]
    strtab = data[stroff:stroff + strsize]
    out = {}
    for name_off, sh_type, _flags, _addr, off, size, *_ in heads:
        name = strtab[name_off:strtab.index(b"\0", name_off)].decode()
        out[name] = b"" if sh_type == 8 else data[off:off + size]  # SHT_NOBITS has no bytes
    return out


def elf_kernels(path) -> set[str]:
    return {n[len(".text."):] for n in elf_sections(path) if n.startswith(".text.")}


_DEMANGLE_CACHE: dict[str, str] = {}


def demangle(names) -> None:
    todo = [n for n in names if n not in _DEMANGLE_CACHE]
    if not todo:
        return
    tool = shutil.which("c++filt")
    if tool is None:
        _DEMANGLE_CACHE.update({n: n for n in todo})
        return
    proc = subprocess.run([tool], input="\n".join(todo) + "\n", capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or len(lines) != len(todo):
        _DEMANGLE_CACHE.update({n: n for n in todo})
        return
    _DEMANGLE_CACHE.update(dict(zip(todo, lines)))


def normalise_name(mangled: str, renames=()) -> str:
    """A kernel's name with its namespaces dropped: `void verify_attention_kernel<VerifyConfig<4, 2,
    32, 2> >(KdtreeVerifyParams)`. `renames`: (old, new) regex pairs applied afterwards."""
    demangle([mangled])
    name = _DEMANGLE_CACHE.get(mangled, mangled)
    prev = None
    while prev != name:
        prev = name
        name = re.sub(r"\b[A-Za-z_]\w*::", "", name)
    name = re.sub(r"\$__internal_\d+_\$", "$__internal_$", name)
    for old, new in renames:
        name = re.sub(old, new, name)
    return name


def parse_sass(text: str) -> dict[str, dict[str, list[str]]]:
    """arch -> mangled kernel name -> its instructions: `TEXT ; /* enc */ /* enc */`, addresses
    dropped. The .headerflags line stays (it is part of the kernel)."""
    out: dict[str, dict[str, list[str]]] = {}
    arch = None
    cur: list[str] | None = None
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"arch = (sm_\w+)", s)
        if m:
            arch = m.group(1)
            cur = None
            continue
        m = re.match(r"Function : (\S+)", s)
        if m:
            cur = out.setdefault(arch, {}).setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        if s.startswith(".headerflags"):
            cur.append(s)
            continue
        m = re.match(r"/\*[0-9a-f]+\*/\s+(.*?)\s*(/\* 0x[0-9a-f]+ \*/)$", s)
        if m:
            cur.append(f"{m.group(1)} {m.group(2)}")
            continue
        m = re.match(r"(/\* 0x[0-9a-f]+ \*/)$", s)
        if m and cur:
            cur[-1] += " " + m.group(1)
            continue
        if s.startswith("....."):
            cur = None
    return out


def parse_elf_dump(text: str, renames=()) -> dict[str, dict[str, list[str]]]:
    """arch -> normalised kernel name -> its attribute lines from `cuobjdump -elf`: the
    .nv.info.<kernel> section, the kernel's constant bank 0 and shared/local sizes, and the global
    .nv.info entries naming it (symbol indices dropped). Key '' holds the arch's other .nv.info
    entries and constant banks (not tied to one kernel)."""
    out: dict[str, dict[str, list[str]]] = {}
    arch = None
    section = None
    body: list[str] = []

    def flush():
        if arch is None or section is None:
            return
        per = out.setdefault(arch, {})
        if section.startswith(".nv.info."):
            per.setdefault(normalise_name(section[len(".nv.info."):], renames), []).extend(
                ["nv.info: " + ln for ln in body])
        elif section.startswith(".nv.constant0."):
            per.setdefault(normalise_name(section[len(".nv.constant0."):], renames), []).extend(
                ["constant0: " + ln for ln in body])
        elif section.startswith(".text."):
            per.setdefault(normalise_name(section[len(".text."):], renames), []).extend(
                ["text: " + ln for ln in body[:1]])  # lmem=/smem= (the words are the SASS)
        elif section == ".nv.info":
            entries, entry = [], []
            for ln in body:
                if re.match(r"<0x[0-9a-f]+>", ln):
                    if entry:
                        entries.append(entry)
                    entry = []
                else:
                    entry.append(ln)
            if entry:
                entries.append(entry)
            for e in entries:
                joined = " | ".join(e)
                m = re.search(r"function: (\S+)\(0x[0-9a-f]+\)", joined)
                key = normalise_name(m.group(1), renames) if m else ""
                joined = re.sub(r"function: (\S+)\(0x[0-9a-f]+\)", lambda mm: "function: " + normalise_name(
                    mm.group(1), renames), joined)
                per.setdefault(key if not key.startswith("$__internal") else "", []).append("nv.info: " + joined)
        elif re.match(r"\.nv\.constant\d+$", section) or section.startswith(".nv.global.init"):
            per.setdefault("", []).extend([f"{section}: " + ln for ln in body])

    for raw in text.splitlines():
        line = raw.rstrip()
        m = re.match(r"arch = (sm_\w+)", line.strip())
        if m:
            flush()
            section, body = None, []
            arch = m.group(1)
            continue
        if line.startswith("Fatbin ") or line.startswith("===="):
            continue
        if line and not line[0].isspace() and (line.startswith(".") or line.startswith("section")):
            flush()
            section = line.split()[1] if line.startswith(".section") else line.split()[0]
            body = []
            continue
        if section is not None and line.strip():
            body.append(line.strip())
    flush()
    for per in out.values():  # the global entries come in symbol order: compare them as a set
        for k in per:
            per[k] = sorted(per[k]) if k == "" else per[k]
    return out


def parse_ptxas(log: str, renames=()) -> dict[str, dict[str, list[str]]]:
    """arch -> normalised kernel name -> its resource lines (stack, spills, registers, barriers,
    shared memory); key '' holds the arch's global-memory total."""
    out: dict[str, dict[str, list[str]]] = {}
    cur = None
    gmem: list[int] = []
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            cur = out.setdefault(m.group(2), {}).setdefault(normalise_name(m.group(1), renames), [])
            continue
        m = re.search(r"(\d+) bytes gmem", line)
        if m:
            gmem.append(int(m.group(1)))
            cur = None
            continue
        if cur is None or "Compile time" in line or "Function properties for" in line:
            continue
        s = re.sub(r"^ptxas info\s*:\s*", "", line.strip())
        if s:
            cur.append(s)
    for per in out.values():
        per[""] = [f"gmem total {sum(gmem)} bytes (all archs)"]
    return out


def extract(side: dict, cuobjdump: str, renames=()) -> dict:
    sass = _run([cuobjdump, "-sass", side["so"]])
    if sass.returncode != 0:
        raise ToolError(f"cuobjdump -sass: {sass.stderr.strip()}")
    elf = _run([cuobjdump, "-elf", side["so"]])
    if elf.returncode != 0:
        raise ToolError(f"cuobjdump -elf: {elf.stderr.strip()}")
    raw = parse_sass(sass.stdout)
    demangle([k for per in raw.values() for k in per])
    by_name: dict[str, dict[str, dict]] = {}
    for arch, per in raw.items():
        for mangled, lines in per.items():
            by_name.setdefault(arch, {})[normalise_name(mangled, renames)] = {"mangled": mangled, "sass": lines}
    return {"sass": by_name, "elf": parse_elf_dump(elf.stdout, renames),
            "ptxas": parse_ptxas(side["ptxas_log"], renames)}


# --------------------------------------------------------------------------------------------------
# comparing


@dataclasses.dataclass
class Outcome:
    differences: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    checked: list[str] = dataclasses.field(default_factory=list)


def _first_diff(a: list[str], b: list[str], context: int = 3, limit: int = 12) -> str:
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        lines = [f"      first difference at instruction {i1} (ref) / {j1} (tree):"]
        for k in range(max(0, i1 - context), i1):
            lines.append(f"        {a[k]}")
        for k in range(i1, min(i2, i1 + limit)):
            lines.append(f"      - {a[k]}")
        for k in range(j1, min(j2, j1 + limit)):
            lines.append(f"      + {b[k]}")
        return "\n".join(lines)
    return "      (same lines, different count)"


def compare(ref: dict, tree: dict, out: Outcome) -> None:
    archs = sorted(set(ref["sass"]) | set(tree["sass"]))
    for arch in archs:
        a, b = ref["sass"].get(arch, {}), tree["sass"].get(arch, {})
        for name in sorted(set(a) - set(b)):
            out.differences.append(f"{arch}: kernel only in the ref: {name}")
        for name in sorted(set(b) - set(a)):
            out.differences.append(f"{arch}: kernel only in the tree: {name}")
        same = 0
        for name in sorted(set(a) & set(b)):
            if a[name]["sass"] != b[name]["sass"]:
                out.differences.append(f"{arch}: SASS of {name} differs ({len(a[name]['sass'])} vs "
                                       f"{len(b[name]['sass'])} lines)\n" + _first_diff(a[name]["sass"], b[name]["sass"]))
            else:
                same += 1
            if a[name]["mangled"] != b[name]["mangled"]:
                out.notes.append(f"{arch}: {name}: mangled name changed {a[name]['mangled']} -> {b[name]['mangled']}")
        out.checked.append(f"{arch}: SASS of {same} of {len(set(a) | set(b))} kernels identical")
    for what in ("elf", "ptxas"):
        label = {"elf": "ELF attributes", "ptxas": "ptxas resources"}[what]
        for arch in sorted(set(ref[what]) | set(tree[what])):
            a, b = ref[what].get(arch, {}), tree[what].get(arch, {})
            bad = 0
            for name in sorted(set(a) | set(b)):
                la, lb = a.get(name), b.get(name)
                if la != lb:
                    bad += 1
                    title = name or "(not tied to one kernel)"
                    if la is None or lb is None:
                        out.differences.append(f"{arch}: {label} of {title} only in the {'tree' if la is None else 'ref'}")
                    else:
                        out.differences.append(f"{arch}: {label} of {title} differ\n" + _first_diff(la, lb, 1, 6))
            out.checked.append(f"{arch}: {label}: {len(set(a) | set(b)) - bad} of {len(set(a) | set(b))} entries identical")


def compare_cubins(ref_cubins: list[dict], tree_cubins: list[dict], out: Outcome) -> None:
    """Pairs cubins by (arch, kernel names) and compares them byte for byte."""
    def key(c):
        return (c["arch"], tuple(c["kernels"]))

    tree_by = {}
    for c in tree_cubins:
        tree_by.setdefault(key(c), []).append(c)
    identical = 0
    for c in ref_cubins:
        if not c["kernels"]:
            continue
        match = tree_by.get(key(c))
        if not match:
            out.notes.append(f"cubin {c['source']} ({c['arch']}): no tree cubin holds the same kernels "
                             f"under the same names (translation-unit layout changed): not compared byte for byte")
            continue
        other = match.pop(0)
        if Path(c["path"]).read_bytes() == Path(other["path"]).read_bytes():
            identical += 1
            continue
        sa, sb = elf_sections(c["path"]), elf_sections(other["path"])
        diff = sorted(n for n in set(sa) | set(sb) if sa.get(n) != sb.get(n))
        out.differences.append(f"cubin {c['source']} -> {other['source']} ({c['arch']}): bytes "
                               f"differ; sections: {', '.join(diff) or '(headers/layout only)'}")
    out.checked.append(f"cubins (nvcc -cubin, no -lineinfo): {identical} identical byte for byte")


# --------------------------------------------------------------------------------------------------
# driver


def side_data(tree: Path, label: str, args, nvcc: str, tmp: Path) -> dict:
    key_src = json.dumps({"tool": TOOL_VERSION, "digest": tree_digest(tree), "archs": args.arch, "cubin": not args.no_cubin,
                          "nvcc": _run([nvcc, "--version"]).stdout.strip().splitlines()[-1:]}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    cache = Path(args.cache_dir) / key if args.cache_dir else None
    if cache is not None and (cache / "side.json").is_file():
        data = json.loads((cache / "side.json").read_text())
        if all(Path(c["path"]).is_file() for c in data["cubins"]):
            print(f"{label}: cached build {cache}")
            return data
    work = cache if cache is not None else tmp / label
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    print(f"{label}: building {tree} ({_tree_build_module(tree)}) ...", flush=True)
    side = build_side(tree, work, args.arch, nvcc)
    cubins = [] if args.no_cubin else build_cubins(side["nvcc_calls"], work, nvcc, tree)
    data = {"tree": str(tree), "build": side, "cubins": cubins, "extract_so": side["so"]}
    (work / "side.json").write_text(json.dumps(data))
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--ref", default="HEAD", help="git ref to compare against (default HEAD)")
    src.add_argument("--ref-tree", type=Path, help="a directory holding kdtree_backend/ to compare against")
    ap.add_argument("--tree", type=Path, default=REPO_ROOT, help="the tree under test (default: this checkout)")
    ap.add_argument("--arch", type=int, action="append", help="build only these archs (x10, repeatable; default the "
                                                              "build's default, 90 + 120, which includes sm_90a)")
    ap.add_argument("--no-cubin", action="store_true", help="skip the nvcc -cubin byte comparison")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="regex applied to normalised kernel names of both sides (a kernel that was renamed)")
    ap.add_argument("--cache-dir", default=os.environ.get("KDTREE_SASS_CACHE", str(Path(tempfile.gettempdir()) /
                                                                                 "kdtree-sass-cache")),
                    help="where built sides are kept by source digest ('' disables)")
    args = ap.parse_args(argv)
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    try:
        nvcc, cuobjdump = _find_tools()
        with tempfile.TemporaryDirectory(prefix="kdtree-sass-diff-") as tmpname:
            tmp = Path(tmpname)
            if args.ref_tree is not None:
                ref_tree, ref_label = args.ref_tree.resolve(), str(args.ref_tree)
            else:
                ref_tree = tmp / "ref"
                commit = materialise_ref(args.ref, ref_tree)
                ref_label = f"{args.ref} ({commit[:12]})"
            ref = side_data(ref_tree, "ref", args, nvcc, tmp)
            tree = side_data(args.tree.resolve(), "tree", args, nvcc, tmp)
            ref_x = extract({"so": ref["extract_so"], "ptxas_log": ref["build"]["ptxas_log"]}, cuobjdump, renames)
            tree_x = extract({"so": tree["extract_so"], "ptxas_log": tree["build"]["ptxas_log"]}, cuobjdump, renames)
            out = Outcome()
            compare(ref_x, tree_x, out)
            if not args.no_cubin:
                compare_cubins(ref["cubins"], tree["cubins"], out)
    except ToolError as e:
        print(f"sass_diff: {e}", file=sys.stderr)
        return 2
    print(f"ref:  {ref_label}\ntree: {args.tree}")
    for line in out.checked:
        print(f"  {line}")
    for line in out.notes:
        print(f"  note: {line}")
    if out.differences:
        print(f"DIFFERENT: {len(out.differences)} difference(s)")
        for d in out.differences:
            print(f"  {d}")
        return 1
    print("IDENTICAL: the machine code, kernel attributes and resources of every kernel match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
