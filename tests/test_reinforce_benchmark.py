"""benchmarks/reinforce.py at its smallest size (issue 32): our reinforcement run and TRL's GRPOTrainer
from the same exported start, a few updates each; the last line's format and both sides' rewards."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAST = re.compile(r"reinforce_reward_vs_trl=(\S+) steps_per_s_vs_trl=(\S+)")
SIDE = re.compile(r"^(ours|TRL): reward over the last (\d+) rollouts (\S+); (\S+) updates/s", re.MULTILINE)


@pytest.mark.slow
def test_the_benchmark_runs_both_sides_and_prints_its_last_line(tmp_path):
    command = [sys.executable, "benchmarks/reinforce.py", "--out", str(tmp_path), "--sft-steps", "4",
               "--updates", "3", "--prompts", "2", "--group", "2", "--max-new-tokens", "3", "--last", "2",
               "--no-eval"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    match = LAST.fullmatch(lines[-1])
    assert match, lines[-1]
    rate = float(match.group(2))
    assert math.isfinite(rate) and rate > 0
    float(match.group(1))  # a number (nan when both sides rewarded nothing: no ratio to state)
    sides = {m.group(1): m for m in SIDE.finditer(done.stdout)}
    assert set(sides) == {"ours", "TRL"}, done.stdout[-2000:]
    for side in sides.values():
        assert int(side.group(2)) == 2
        reward, per_second = float(side.group(3)), float(side.group(4))
        assert 0.0 <= reward <= 1.0 and math.isfinite(per_second) and per_second > 0
    # both started from the one exported checkpoint
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "ours" / "metrics.jsonl").is_file()
