#!/usr/bin/env bash
# The GPU suite on one GPU (the lent H200): TE, megatron-core 0.19, NCCL and gloo-on-CUDA.
# Prepare TE first (../shared/device/prepare_te.sh; its header says how), then, on the GPU machine:
#     . .te6/install_te.sh && bash tests/gpu/run.sh
# Writes $OUT (default runs/gpu_tests): pytest.log, report.jsonl (measured errors), versions.json,
# run_logs.tgz (each trainer run's log);
# tests/gpu/LAST_RUN.md is written from them. About 11 minutes on an H200 (31 tests), before
# test_trainer_sp.py (11 tests; aimed at 3-5 minutes, not yet measured): split the files over
# 600 s calls with --ignore=tests/gpu/FILE (the arguments go to pytest), or name the files to run:
# GPU_TESTS="tests/gpu/FILE ..." (default tests/gpu).
# FlashAttention-4 (tests/gpu/test_flash_backend_gpu.py; skipped without it): FA4_INSTALL=1 installs
# it from the carry folders of bench/prepare_flash4.sh (its header: .fa1 copied to /root/fa by an
# earlier call on this warm machine, .fa2 carried in this one), e.g.
#     . .te6/install_te.sh && FA4_INSTALL=1 GPU_TESTS=tests/gpu/test_flash_backend_gpu.py \
#         bash tests/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu_tests}
mkdir -p "$OUT"
if [[ -n "${FA4_INSTALL:-}" ]]; then
    # shellcheck source=/dev/null
    . .fa2/install_fa4.sh || { echo "run.sh: FA4_INSTALL: .fa2/install_fa4.sh failed (carry" \
        ".fa2; /root/fa/libs_part0 from .fa1: bench/prepare_flash4.sh)" >&2; exit 1; }
    python3 -c "import flash_attn.cute" || { echo "run.sh: flash_attn.cute does not import" >&2; exit 1; }
fi
# tests/gpu/test_hf_gpu.py needs transformers + safetensors; a machine without them (and without
# network, as the lent H200) gets them from a folder of wheels: HF_WHEELS=/path/to/wheels.
if [[ -n "${HF_WHEELS:-}" ]] && ! python3 -c "import transformers, safetensors" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hf_site \
        "$HF_WHEELS"/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/hf_site
fi
export GPU_TEST_REPORT=$OUT/report.jsonl
rm -f "$GPU_TEST_REPORT"
start=$(date +%s)
rm -rf "$OUT/tmp"
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
python3 -m pytest -q -rfE -p no:cacheprovider --basetemp="$OUT/tmp" ${GPU_TESTS:-tests/gpu} "$@" 2>&1 \
    | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
# every trainer run's log, without the checkpoints
(cd "$OUT/tmp" && find . -name log.txt | tar czf ../run_logs.tgz -T -) && rm -rf "$OUT/tmp"
python3 - "$OUT/versions.json" "$(( $(date +%s) - start ))" <<'PY'
import json, sys, torch
versions = {"wall_s": int(sys.argv[2]), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(0)}
for name in ("transformer_engine", "megatron.core"):
    try:
        module = __import__(name, fromlist=["__version__"])
        versions[name] = module.__version__
    except ImportError:
        versions[name] = None
from importlib.metadata import PackageNotFoundError, version
for name in ("flash-attn-4", "nvidia-cutlass-dsl"):
    try:
        versions[name] = version(name)
    except PackageNotFoundError:
        versions[name] = None
json.dump(versions, open(sys.argv[1], "w"), indent=1)
PY
exit $rc
