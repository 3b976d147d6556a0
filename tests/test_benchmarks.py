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
