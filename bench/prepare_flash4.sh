#!/usr/bin/env bash
# Packs FlashAttention-4 (flash-attn-4 4.0.0b36, CuTe-DSL kernels; nvidia-cutlass-dsl 4.8.1, CUDA 13
# flavor) for a GPU node with no package index (Python 3.12, torch 2.11+cu130), in folders small
# enough for a transfer limit of 64 MiB. Run on a machine with pip access, in the project's root:
#     bash bench/prepare_flash4.sh
# (FA4_WHEELS=dir keeps the downloads and the slow xz of step 2 between runs; default /tmp/fa4dl.)
#
# The DSL's CUDA 13 library wheel is 92 MB zipped; re-stored without compression and xz'd it is
# 61 MB, so FA4 takes two folders: .fa1 (57 MiB, the first part of that .xz) and .fa2 (~21 MB: the
# rest of it, the other wheels, install_fa4.sh). On the GPU node: copy .fa1/* to /root/fa/, then
#     . .fa2/install_fa4.sh && export PYTHONPATH=$PWD:$PYTHONPATH && ...
# e.g. ... && PYTHONUNBUFFERED=1 python3 bench/flash_attention.py   (writes under $OUT).
# install_fa4.sh rebuilds the wheel, pip-installs everything (--no-index --no-deps) under
# /tmp/site_fa4 once per machine (~10 s), and exports PYTHONPATH.
set -euo pipefail
dl=${FA4_WHEELS:-/tmp/fa4dl}
flavor=cu13
cutlass=4.8.1
libs=nvidia_cutlass_dsl_libs_${flavor}-${cutlass}-cp312-cp312-manylinux_2_28_x86_64.whl
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qxF '/.fa*/' "$exclude" 2>/dev/null || echo '/.fa*/' >> "$exclude"
mkdir -p "$dl"
pip_dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dl" "$@"; }
# FA4 and what it needs beyond the image (Requires-Dist, checked wheel by wheel: the image has torch,
# numpy, packaging; the DSL's cu12 libs, a hard requirement of nvidia-cutlass-dsl, are left out:
# the loader takes the newest flavour installed that the driver (CUDA 13.0) runs).
main_wheels=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==$cutlass nvidia-cutlass-dsl-libs-base==$cutlass
  nvidia-cutlass-dsl-libs-core==$cutlass quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5)
# The image has these (KINDS.md) at versions not read: install_fa4.sh installs ours only where its
# own is missing or older than the wheels above require.
fallback_wheels=(cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 einops==0.8.2 protobuf==7.36.2
  typing-extensions==4.16.0)
pip_dl "${main_wheels[@]}" "${fallback_wheels[@]}" "nvidia-cutlass-dsl-libs-$flavor==$cutlass"
if [ ! -f "$dl/$libs.stored.xz" ]; then  # ~6 minutes on two cores
  python3 - "$dl/$libs" "$dl/$libs.stored" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_STORED) as dst:
    for info in src.infolist():
        dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_STORED)
EOF
  xz -9e -T2 "$dl/$libs.stored"
fi
rm -rf .fa1 .fa2 && mkdir -p .fa1 .fa2/fallback
split -b 57M -d -a 1 "$dl/$libs.stored.xz" "$dl/libs_part"
mv "$dl/libs_part0" .fa1/ && mv "$dl/libs_part1" .fa2/
whl() { ls "$dl"/"$(echo "$1" | cut -d= -f1 | tr - _)"-"$(echo "$1" | cut -d= -f3)"-*.whl; }
for w in "${main_wheels[@]}"; do cp "$(whl "$w")" .fa2/; done
for w in "${fallback_wheels[@]}"; do cp "$(whl "$w")" .fa2/fallback/; done
cat > .fa2/install_fa4.sh <<EOS
# sourced on the GPU node: rebuild the DSL's $flavor wheel once, install everything under /tmp/site_fa4
if [ ! -f /tmp/site_fa4/.fa4-ok ]; then
  cat /root/fa/libs_part0 .fa2/libs_part1 | python3 -c \\
    "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), open(sys.argv[1], 'wb'))" \\
    /root/fa/$libs || return 1
  python3 - .fa2/fallback > /tmp/fa4_fallback.txt <<'EOF' || return 1
# the fallback wheels whose package the image lacks, or has older than FA4's wheels require
import glob, re, sys
from importlib.metadata import PackageNotFoundError, version
need = {"cuda_bindings": (13,), "cuda_pathfinder": (1, 4, 2), "einops": (0, 8),
        "protobuf": (4, 21, 12), "typing_extensions": (4, 13)}
for name, minimum in need.items():
    try:
        have = tuple(int(n) for n in re.findall(r"\\d+", version(name))[:3])
    except PackageNotFoundError:
        have = ()
    # the DSL's CUDA 13 flavour calls CUDA 13 bindings
    if have < minimum or (name == "cuda_bindings" and have[0] != 13):
        print(*glob.glob(f"{sys.argv[1]}/{name}-*.whl"))
EOF
  echo "install_fa4.sh: image packages replaced by carried wheels: \$(cat /tmp/fa4_fallback.txt)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_fa4 \\
    /root/fa/$libs .fa2/*.whl \$(cat /tmp/fa4_fallback.txt) || return 1
  touch /tmp/site_fa4/.fa4-ok
fi
# A --target folder on PYTHONPATH runs no .pth file: add the DSL's package folder that
# nvidia_cutlass_dsl_packages.pth would have put on sys.path.
export PYTHONPATH=/tmp/site_fa4:/tmp/site_fa4/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}
EOS
du -sh .fa1 .fa2
