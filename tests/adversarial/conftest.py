"""Runs benchmarks/adversarial.py once per session (``--scale ci``) and loads the script as a module for the
oracle's own tests."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "adversarial.py")
CI_TIMEOUT = 900  # the trial itself takes under 4 minutes on one core; a hung trial fails here, never waits forever


@pytest.fixture(scope="session")
def bench():
    """benchmarks/adversarial.py as a module (a name of its own: ``adversarial`` is this test package)."""
    spec = importlib.util.spec_from_file_location("hsc_adversarial_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ci_report(tmp_path_factory):
    """The JSON report of ``benchmarks/adversarial.py --seed 0 --scale ci`` (run in a subprocess: it forks
    per case and kills its own children)."""
    out = tmp_path_factory.mktemp("adversarial") / "adversarial-ci.json"
    env = dict(
        os.environ,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
    )
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, SCRIPT, "--seed", "0", "--scale", "ci", "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=CI_TIMEOUT,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    report["stdout"] = done.stdout
    return report
