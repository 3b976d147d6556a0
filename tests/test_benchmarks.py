"""Every benchmark script starts (its imports and argument parsing), run as `python benchmarks/<name>.py`."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_benchmark_script_starts(script):
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout


def test_ttft_runs_at_tiny_size(tmp_path):
    """benchmarks/ttft.py end to end on a tiny Mamba-2 (seconds): its table, its JSON, the store path's answer."""
    import json

    out = tmp_path / "ttft.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ttft.py"), "--size", "tiny", "--repeats", "1",
                           "--baseline-repeats", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| tiny | 10 |" in done.stdout
    result = json.loads(out.read_text())
    (size,) = result["results"]
    assert [row["k"] for row in size["rows"]] == [1, 4, 10] and result["threads"] == 1
    for row in size["rows"]:
        assert row["baseline_tokens"] == row["k"] * 256 + 16 and row["speedup"] > 0
        assert set(row["seconds"]) >= {"ttft", "store_open", "retrieval", "read_verify", "compose", "prefill_first_token",
                                       "baseline_prefill", "fingerprint_check"}
