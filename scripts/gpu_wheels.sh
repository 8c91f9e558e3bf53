#!/usr/bin/env bash
# Download the wheels a GPU machine lacks, to carry there: the GPU machines have torch (CUDA), numba, pyarrow,
# tokenizers and tiktoken, but not torchdata, msgspec or zstandard (nor mosaicml-streaming, which only the MDS source needs:
# add --mds). Resolves the packages and their dependencies for the GPU machine's Python and platform from
# metadata (`pip install --dry-run --report`: nothing large is fetched), drops what the machine already has
# (torch and its CUDA libraries, numpy, numba, pyarrow, ...), and downloads the rest as binary wheels.
#
#   bash scripts/gpu_wheels.sh [--mds] [DEST]          # DEST default .whl/gpu (git-ignored)
#
# On the GPU machine, from the repository root (no network needed):
#   python -m pip install --no-index --no-deps --target .whl/site .whl/gpu/*.whl
#   PYTHONPATH=$PWD:$PWD/.whl/site python benchmarks/gpu/run_all.py --out out/gpu-proof
#
# PYTHON (default python3) runs pip; GPU_PYTHON_VERSION (default 3.12) and GPU_PLATFORMS (default the manylinux
# x86-64 tags) describe the GPU machine; KEEP_OUT (a regex of package names) replaces the list of what it has.
set -euo pipefail

mds=0
dest=.whl/gpu
for arg in "$@"; do
    case "$arg" in
        --mds) mds=1 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        -*) echo "gpu_wheels.sh: unknown option $arg (expected --mds or a destination folder)" >&2; exit 2 ;;
        *) dest=$arg ;;
    esac
done

py=${PYTHON:-python3}
pyver=${GPU_PYTHON_VERSION:-3.12}
abi=cp${pyver/./}
platforms=${GPU_PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64"}
# what the GPU machine already has: torch and everything it pulls in, and the packages its image ships
keep_out=${KEEP_OUT:-'^(torch|torchvision|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec|typing[-_]extensions|setuptools|numpy|numba|llvmlite|pyarrow|tokenizers|tiktoken|regex)$'}

packages=(torchdata msgspec zstandard)
[ "$mds" = 1 ] && packages+=(mosaicml-streaming)

plat_args=()
for p in $platforms; do plat_args+=(--platform "$p"); done
common=(--only-binary=:all: --python-version "$pyver" --implementation cp --abi "$abi" --abi none --abi abi3 "${plat_args[@]}")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip install --quiet --dry-run --ignore-installed --report "$tmp/report.json" --target "$tmp/target" \
    "${common[@]}" "${packages[@]}"

# name==version of every resolved package the GPU machine lacks
"$py" - "$tmp/report.json" "$keep_out" > "$tmp/pins.txt" <<'EOF'
import json, re, sys
report, keep_out = json.load(open(sys.argv[1])), re.compile(sys.argv[2], re.I)
for item in report["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if not keep_out.match(name):
        print(f"{name}=={version}")
EOF

mkdir -p "$dest"
"$py" -m pip download --quiet --no-deps --dest "$dest" "${common[@]}" -r "$tmp/pins.txt"
echo "wheels for Python $pyver in $dest:"
ls -1 "$dest"
du -sh "$dest"
