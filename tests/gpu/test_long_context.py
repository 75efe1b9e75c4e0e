"""Lengths where 32-bit offsets break, on one GPU: TE's fused RoPE and the 1M-token example.

- TE's fused RoPE kernel (2.20) indexes with 32-bit offsets; k reaches it as a view into the
  fused qkv projection, so it is exact while that tensor has < 2^31 elements and reads out of
  bounds past it. `rope.fused_rope_fits` draws the line where the kernel's breaks (checked on
  both sides, each in its own process: past it the kernel may leave an illegal address).
- `examples/gpt1b_1m_one_gpu.sh` (with 2 of its 16 layers) trains one 1,000,064-token step with
  a finite loss and gradient norm: past the line the trainer runs RoPE unfused (said once).
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
REPORT = os.environ.get("GPU_TEST_REPORT")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# One [s, 1, g, (h/g + 2) * d] qkv projection of the 1B shape (h 32, g 8, d 64), TE's fused RoPE
# on its k view against megatron-core's unfused RoPE; prints the largest difference.
PROBE = """
import sys, torch
from megatron.core.extensions.transformer_engine import fused_apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
s, g, hpg, d = int(sys.argv[1]), 8, 4, 64
torch.manual_seed(0)
mixed = torch.randn(s, 1, g, (hpg + 2) * d, device="cuda", dtype=torch.bfloat16)
_, k, _ = torch.split(mixed, [hpg * d, d, d], dim=3)
inv = 1.0 / 500000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
freqs = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv)
freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
reference = _apply_rotary_pos_emb_bshd(k.float(), freqs).to(k.dtype)
fused = fused_apply_rotary_pos_emb(k, freqs)
print((fused.float() - reference.float()).abs().max().item(), flush=True)
"""


def report(name: str, **values) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


def test_te_fused_rope_breaks_where_fused_rope_fits_says():
    from megatron_ulysses.sp.rope import fused_rope_fits

    last = (2**31 - 1) // (48 * 64)  # the most tokens whose qkv (48 heads x 64) fits
    assert fused_rope_fits(last, 32, 8, 64) and not fused_rope_fits(last + 1000, 32, 8, 64)
    results = {}
    for s in (last, last + 1000):
        probe = subprocess.run([sys.executable, "-c", PROBE, str(s)], capture_output=True,
                               text=True, timeout=300)
        diff = float(probe.stdout.split()[-1]) if probe.returncode == 0 else math.nan
        results[s] = {"rc": probe.returncode, "max_abs_diff": diff,
                      "error": probe.stderr.strip().splitlines()[-1] if probe.returncode else ""}
    report("te_fused_rope_limit", **{str(s): r for s, r in results.items()})
    inside, past = results[last], results[last + 1000]
    assert inside["rc"] == 0 and inside["max_abs_diff"] <= 2**-6, inside  # bf16 rounding
    # Past the line TE's kernel crashes or is wrong. If this fails, TE indexes with 64 bits
    # now: widen `fused_rope_fits` to what it handles.
    assert past["rc"] != 0 or not past["max_abs_diff"] <= 2**-6, past


def test_million_token_example_trains_with_a_finite_gradient(tmp_path):
    env = dict(os.environ, RUN_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    run = subprocess.run(["bash", str(REPO / "examples/gpt1b_1m_one_gpu.sh"), "--num-layers", "2"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    output = run.stdout + run.stderr
    (tmp_path / "log.txt").write_text(output)
    assert run.returncode == 0, output[-4000:]
    line = re.search(r"iteration\s+1/\s*1 \|.*", output).group(0)
    values = dict(re.findall(r"\| ([a-zA-Z /()]+): (\S+)", "| " + line.split("| ", 1)[1]))
    report("million_token_example", layers=2, **values)
    assert math.isfinite(float(values["lm loss"])) and math.isfinite(float(values["grad norm"]))
    assert output.count("RoPE runs unfused") == 1  # the warning, said once by rank 0
