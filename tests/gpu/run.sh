#!/usr/bin/env bash
# The GPU suite on one GPU: TE, megatron-core, NCCL and gloo-on-CUDA. From the repository root, with
# Transformer Engine installed (docs/gpu.md):
#     bash tests/gpu/run.sh                                         # all of tests/gpu
#     GPU_TESTS="tests/gpu/test_trainer.py ..." bash tests/gpu/run.sh  # some files
# Further arguments go to pytest (e.g. --ignore=tests/gpu/FILE). Writes $OUT (default
# runs/gpu_tests): pytest.log, report.jsonl (measured errors), versions.json, run_logs.tgz (each
# trainer run's log); tests/gpu/LAST_RUN.md is written from them.
# tests/gpu/test_flash_backend_gpu.py needs FlashAttention-4 (pip install 'megatron_ulysses[flash]';
# on a node without a package index: bench/prepare_flash4.sh, then . .fa2/install_fa4.sh first).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu_tests}
mkdir -p "$OUT"
# tests/gpu/test_hf_gpu.py needs transformers + safetensors; a machine without them and without
# network gets them from a folder of wheels: HF_WHEELS=/path/to/wheels.
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
