"""benchmarks/reinforce.py at its smallest size (issue 32): our reinforcement run and TRL's GRPOTrainer
from the same exported start, a few updates each at two seeds; the per-seed and summary lines, the last
line's format, and the one-line refusals of bad flags."""

import math
import re
import subprocess
import sys

import pytest

from tests.scripts import ROOT, load_script

LAST = re.compile(r"reinforce_reward_vs_trl=(\S+) steps_per_s_vs_trl=(\S+)")
PER_SEED = re.compile(r"^(ours|TRL) seed=(\d+): reward over the last (\d+) rollouts (\S+); (\S+) updates/s",
                      re.MULTILINE)
SIDE = re.compile(r"^(ours|TRL): reward over the last (\d+) rollouts (\S+) \(s\.e\. (\S+), seeds ([\d,]+): "
                  r"([^)]*)\); (\S+) updates/s \(median: ([^)]*)\)", re.MULTILINE)


@pytest.mark.heavy
def test_the_benchmark_runs_both_sides_at_two_seeds_and_prints_its_last_line(tmp_path):
    command = [sys.executable, "benchmarks/reinforce.py", "--out", str(tmp_path), "--sft-steps", "4",
               "--updates", "3", "--prompts", "2", "--group", "2", "--max-new-tokens", "3", "--last", "2",
               "--no-eval", "--seeds", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    match = LAST.fullmatch(lines[-1])
    assert match, lines[-1]
    rate = float(match.group(2))
    assert math.isfinite(rate) and rate > 0
    float(match.group(1))  # a number (nan when both sides rewarded nothing: no ratio to state)
    runs = {(m.group(1), int(m.group(2))): m for m in PER_SEED.finditer(done.stdout)}
    assert set(runs) == {("ours", 0), ("ours", 1), ("TRL", 0), ("TRL", 1)}, done.stdout[-2000:]
    sides = {m.group(1): m for m in SIDE.finditer(done.stdout)}
    assert set(sides) == {"ours", "TRL"}, done.stdout[-2000:]
    rates = {}
    for name, side in sides.items():
        assert int(side.group(2)) == 2 and side.group(5) == "0,1"
        seeds = [float(runs[(name, k)].group(4)) for k in (0, 1)]
        assert [float(v) for v in side.group(6).split()] == pytest.approx(seeds, abs=1e-3)
        mean, error = float(side.group(3)), float(side.group(4))
        assert mean == pytest.approx(sum(seeds) / 2, abs=1e-3)
        # K=2: the standard error is half the two values' distance
        assert error == pytest.approx(abs(seeds[0] - seeds[1]) / 2, abs=1e-3)
        per_second = [float(runs[(name, k)].group(5)) for k in (0, 1)]
        assert all(math.isfinite(r) and r > 0 for r in per_second)
        rates[name] = float(side.group(7))
        assert rates[name] == pytest.approx(sum(per_second) / 2, rel=1e-2)  # the median of two
    assert rate == pytest.approx(rates["ours"] / rates["TRL"], rel=2e-2)
    # every run started from the one exported checkpoint, each seed in its own workdir
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert all((tmp_path / f"ours-seed{k}" / "metrics.jsonl").is_file() for k in (0, 1))


@pytest.mark.parametrize("flags, named", [(["--seeds", "0"], "--seeds=0"), (["--updates", "1"], "--updates=1"),
                                          (["--last", "5", "--updates", "4"], "--last=5")])
def test_bad_flags_are_refused_in_one_line_naming_the_flag(tmp_path, flags, named):
    done = subprocess.run([sys.executable, "benchmarks/reinforce.py", "--out", str(tmp_path), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and done.stderr.startswith(named), done.stderr
    assert not any(tmp_path.iterdir())  # refused before any training or export


def _benchmark():
    return load_script("benchmarks/reinforce.py", "reinforce_benchmark")


def test_the_summary_is_the_mean_over_seeds_with_its_standard_error_and_the_median_rate(capsys):
    bench = _benchmark()
    # Three seeds, 4 updates each; the last 2 rollouts average to 0.25, 0.35 and 0.6.
    results = [{"rewards": [0.0, 0.1, 0.2, 0.3], "seconds_after_first": 3.0},
               {"rewards": [0.0, 0.1, 0.3, 0.4], "seconds_after_first": 6.0},
               {"rewards": [0.9, 0.9, 0.5, 0.7], "seconds_after_first": 1.5}]
    mean, error, rate = bench.summary("ours", [0, 1, 2], results, updates=4, last=2)
    assert mean == pytest.approx(0.4)
    # Bessel-corrected sample std over sqrt(K): sqrt(((0.15² + 0.05² + 0.2²) / 2) / 3)
    assert error == pytest.approx(math.sqrt((0.15 ** 2 + 0.05 ** 2 + 0.2 ** 2) / 2 / 3))
    assert rate == pytest.approx(1.0)  # the median of 3 / 3.0, 3 / 6.0 and 3 / 1.5 updates/s
    side = SIDE.search(capsys.readouterr().out)
    assert side and side.group(5) == "0,1,2" and float(side.group(3)) == pytest.approx(0.4)
    assert bench.mean_and_error([0.3])[0] == 0.3 and math.isnan(bench.mean_and_error([0.3])[1])
