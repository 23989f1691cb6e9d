"""`benchmarks/device_check.py --smoke` (issue 28): the accelerator check's every part runs on the CPU with
tiny shapes, and its last line carries every figure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.heavy  # four subprocesses that compile and run train steps and decoders: minutes of CPU
def test_device_check_smoke_reports_every_figure():
    done = subprocess.run([sys.executable, "benchmarks/device_check.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"device=cpu attention=blockwise mfu=(\S+) \(blockwise\) kernels_agree=one_kernel "
                         r"decode_tokens_per_s_b1=(\S+) decode_tokens_per_s_b8=(\S+) spec_speedup=(\S+)", last)
    assert found, last
    mfu, b1, b8, speedup = (float(x) for x in found.groups())
    assert 0 < mfu <= 1 and b1 > 0 and b8 > 0 and speedup >= 0
