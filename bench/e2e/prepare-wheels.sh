#!/bin/bash
# Build, on a CPU machine with PyPI, ONE wheel set (.whl-e2e/) that runs on the GPU machine
# (Python 3.12, torch 2.11.0+cu130, triton 3.6.0, no network) both
#   - a real sglang 0.5.23 server through the launcher (bench/e2e/e2e_server.py), and
#   - the GPU kernel tests (tests/sglang/test_backend_gpu.py, kdtree_backend/testing/scene.py),
#     which import SGLang's attention test kit `sglang.test.kits.attention_unittest`.
# Self-contained copy of ../shared/gpu/e2e/prepare-wheels.sh (same pins, same hybrid sglang-kernel)
# with two changes: the trimmed sglang wheel KEEPS sglang/test/kits/attention_unittest/ and every
# sglang/test module it imports (found by scanning the imports inside the wheel), and the project
# itself is added as a wheel (SGLang finds the plugin through its entry point).
#
#   bash bench/e2e/prepare-wheels.sh [OUTDIR]      (default: .whl-e2e/ in this checkout)
#   KW=/tmp/kw  (default) caches the three big downloads (~0.8 GB) between runs.
#
# Prints the set's size; fails if the set plus the tracked checkout exceed 64 MiB (one transfer).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
OUT=${1:-$root/.whl-e2e}
KW=${KW:-/tmp/kw}
LIMIT=$((64 * 1024 * 1024))
exclude="$(git -C "$root" rev-parse --git-common-dir 2>/dev/null || echo "$root/.git")/info/exclude"
case "$exclude" in /*) ;; *) exclude="$root/$exclude" ;; esac
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl-e2e/' "$exclude" 2>/dev/null || echo '/.whl-e2e/' >> "$exclude"
WORK=$(mktemp -d /tmp/e2e-prep.XXXX)
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT"
mkdir -p "$OUT" "$KW"
PIP=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
     --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
     -c /dev/null)

# 1. what the GPU machine lacks for the server path (the shared script's list, unchanged);
#    sgl-flash-mla: the EAGLE v2 draft worker imports flashmla_backend during graph capture
cat > "$WORK/deps.txt" <<'EOF'
annotated-types==0.8.0
apache-tvm-ffi==0.1.11
asttokens==3.0.2
cffi==2.1.1
compressed-tensors==0.18.0
dill==0.4.1
distro==1.9.0
executing==2.3.0
fastapi==0.165.0
gguf==0.19.0
ipython==9.18.1
ipython-pygments-lexers==1.1.1
jedi==0.20.1
jiter==0.19.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
loguru==0.7.3
matplotlib-inline==0.2.2
msgspec==0.23.0
openai==2.8.0
opentelemetry-api==1.45.2
orjson==3.13.0
parso==0.8.7
partial-json-parser==0.2.1.1.post7
pexpect==4.9.0
prompt-toolkit==3.0.53
ptyprocess==0.7.0
pure-eval==0.2.4
pybase64==1.5.1
pycparser==3.12
pydantic==2.14.4
pydantic-core==2.50.5
python-multipart==0.0.34
pyzmq==27.3.0
referencing==0.37.0
rpds-py==2026.9.1
setproctitle==1.3.8
sniffio==1.3.1
soundfile==0.13.1
stack-data==0.6.3
starlette==1.10.0
traitlets==5.16.1
typing-inspection==0.4.5
uvicorn==0.54.0
wcwidth==0.9.4
xgrammar==0.2.7
sgl-flash-mla==1.0.0
structlog==26.1.0
EOF
"${PIP[@]}" -q -d "$OUT" -r "$WORK/deps.txt" 2>&1 | { grep -v "^WARNING: Location" || true; }

# 2. big inputs, cached in $KW (sglang cp312 39 MB, sglang-kernel 0.4.10 373 MB, 0.4.6 377 MB)
ls "$KW"/sglang-0.5.23-cp312-*.whl >/dev/null 2>&1 || "${PIP[@]}" -q -d "$KW" sglang==0.5.23
ls "$KW"/sglang_kernel-0.4.10-*.whl >/dev/null 2>&1 || "${PIP[@]}" -q -d "$KW" sglang-kernel==0.4.10
ls "$KW"/sglang_kernel-0.4.6-*.whl >/dev/null 2>&1 || "${PIP[@]}" -q -d "$KW" sglang-kernel==0.4.6

python3 - "$KW" "$OUT" <<'PY'
import ast, base64, glob, hashlib, posixpath, re, sys, zipfile
kw, out = sys.argv[1], sys.argv[2]
def rec(n, d):
    return f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"

# 2a. sglang 0.5.23 cp312 minus multimodal_gen/, the bench/grpc/server Rust extensions and test/,
#     except the attention test kit and the sglang/test modules it imports (closure over the wheel)
src = glob.glob(f"{kw}/sglang-0.5.23-cp312-*.whl")[0]
zi = zipfile.ZipFile(src)
names = set(zi.namelist())

def module_file(mod):
    p = mod.replace(".", "/")
    for cand in (p + "/__init__.py", p + ".py"):
        if cand in names:
            return cand
    return None

keep, todo = set(), [n for n in names if n.startswith("sglang/test/kits/attention_unittest/") and n.endswith(".py")]
todo += ["sglang/test/__init__.py", "sglang/test/kits/__init__.py"]
while todo:
    f = todo.pop()
    if f in keep or f not in names:
        continue
    keep.add(f)
    pkg = posixpath.dirname(f).replace("/", ".")
    for node in ast.walk(ast.parse(zi.read(f))):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                m = ".".join(base + ([node.module] if node.module else []))
            else:
                m = node.module or ""
            mods = [m] + [f"{m}.{a.name}" for a in node.names]
        for m in mods:
            if m.startswith("sglang.test"):
                parts = m.split(".")
                for i in range(2, len(parts) + 1):
                    mf = module_file(".".join(parts[:i]))
                    if mf:
                        todo.append(mf)
# package data next to kept modules (none today; keeps e.g. a .json beside a kit module)
keep |= {n for n in names if n.startswith("sglang/test/kits/attention_unittest/") and not n.endswith("/")}

drop_re = re.compile(r"^sglang/(multimodal_gen/|test/|srt/rust_extensions/_(bench|grpc|server)\.cpython)")
def dropped(n):
    return bool(drop_re.match(n)) and n not in keep

zo = zipfile.ZipFile(f"{out}/{src.rsplit('/', 1)[1]}", "w", zipfile.ZIP_DEFLATED, compresslevel=9)
for i in zi.infolist():
    if dropped(i.filename):
        continue
    d = zi.read(i.filename)
    if i.filename.endswith(".dist-info/RECORD"):
        d = ("\n".join(l for l in d.decode().splitlines() if not dropped(l.split(",")[0])) + "\n").encode()
    zo.writestr(i, d, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
zo.close()
kept_test = sorted(n for n in keep if n.startswith("sglang/test/"))
print(f"sglang wheel: kept {len(kept_test)} files of sglang/test/ "
      f"({sum(zi.getinfo(n).file_size for n in kept_test) / 1e3:.0f} kB uncompressed)")

# 2b. hybrid kernel: sglang-kernel 0.4.10 Python layer + 0.4.6 sm90/common_ops.abi3.so (torch 2.11 ABI)
so = zipfile.ZipFile(glob.glob(f"{kw}/sglang_kernel-0.4.6-*.whl")[0]).read("sgl_kernel/sm90/common_ops.abi3.so")
src = zipfile.ZipFile(glob.glob(f"{kw}/sglang_kernel-0.4.10-*.whl")[0])
v_old, v_new = "0.4.10", "0.4.10+t211.so046"
zo = zipfile.ZipFile(f"{out}/sglang_kernel-{v_new}-cp310-abi3-manylinux2014_x86_64.whl", "w", zipfile.ZIP_DEFLATED, compresslevel=9)
records = []
for i in src.infolist():
    n = i.filename
    if n.startswith("triton_kernels/") or n.endswith("RECORD") or (n.endswith(".so") and n != "sgl_kernel/sm90/common_ops.abi3.so"):
        continue
    d = so if n == "sgl_kernel/sm90/common_ops.abi3.so" else src.read(n)
    if n.startswith(f"sglang_kernel-{v_old}.dist-info/"):
        n = n.replace(f"sglang_kernel-{v_old}.dist-info/", f"sglang_kernel-{v_new}.dist-info/")
        if n.endswith("METADATA"):
            d = re.sub(rb"Requires-Dist: torch==[^\n]*\n", b"", d.replace(f"Version: {v_old}".encode(), f"Version: {v_new}".encode(), 1))
    zo.writestr(n, d); records.append(rec(n, d))
records.append(f"sglang_kernel-{v_new}.dist-info/RECORD,,")
zo.writestr(f"sglang_kernel-{v_new}.dist-info/RECORD", "\n".join(records) + "\n")
zo.close()
PY

# 3. the project itself (entry point sglang.srt.plugins: kdtree), from a copy of the checkout
#    (tracked files and untracked ones git does not ignore: what a transfer carries), so that a
#    locally built kdtree_backend/_lib/*.so or other ignored files never travel in the wheel
python3 - "$root" "$WORK/src" <<'PY'
import os, shutil, subprocess, sys
root, dst = sys.argv[1], sys.argv[2]
files = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       check=True, capture_output=True).stdout.decode().split("\0")
for f in filter(None, files):
    src = os.path.join(root, f)
    if os.path.isfile(src) and not os.path.islink(src):
        os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, f))
PY
# what a transfer carries: tracked files and untracked ones git does not ignore (files only)
checkout_bytes=$(find "$WORK/src" -type f -printf '%s\n' | awk '{s+=$1} END{print s+0}')
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$WORK/src" 2>/dev/null \
  || python3 -m pip wheel -q --no-deps -w "$OUT" "$WORK/src"

set_bytes=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
echo "wheels: $(ls "$OUT"/*.whl | wc -l) files, $set_bytes bytes ($(awk "BEGIN{printf \"%.1f\", $set_bytes/1048576}") MiB) in $OUT"
echo "checkout (tracked + untracked not ignored): $checkout_bytes bytes; together $(awk "BEGIN{printf \"%.1f\", ($set_bytes+$checkout_bytes)/1048576}") MiB of 64 MiB"
if [ $((set_bytes + checkout_bytes)) -gt $LIMIT ]; then
  echo "error: wheel set + checkout exceed 64 MiB; one transfer cannot carry them" >&2
  exit 1
fi
