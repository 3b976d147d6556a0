"""scripts/check_install.py's offline logic: the per-Python direct requirements and floors (which noxfile.py's
tests-lowest pins), and the reading of pip's --report for the GPU install. The checks themselves read PyPI and
are run by hand (their results: docs/getting-started/install.md)."""

import copy
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_install", ROOT / "scripts" / "check_install.py")
check_install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_install)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
DECLARED_PYTHONS = [
    c.rsplit(":: ", 1)[1]
    for c in PYPROJECT["project"]["classifiers"]
    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
]


def _floors(python):
    requirements = check_install.direct_requirements(environment=check_install.environment_for(python))
    return {r.name: check_install.lower_bound(r) for r in requirements}, requirements


@pytest.mark.parametrize("python", DECLARED_PYTHONS)
def test_each_declared_python_gets_exactly_one_range_per_package(python):
    """One floor per package: a package named twice (accelerate by [train] and [eval]; transformers by the core and,
    as transformers[kernels], by [hub-kernels]) names the same range each time."""
    _, requirements = _floors(python)
    names = [check_install._name(r.name) for r in requirements]
    ranges: dict[str, set[str]] = {}
    for requirement, name in zip(requirements, names):
        ranges.setdefault(name, set()).add(str(requirement.specifier))
    assert {name: found for name, found in ranges.items() if len(found) > 1} == {}
    assert {"torch", "transformers", "numpy", "pyarrow", "matplotlib", "triton"} <= set(names)


def test_the_floors_without_cp313_wheels_are_raised_on_python_3_13_only():
    floors = {python: _floors(python)[0] for python in ("3.11", "3.12", "3.13")}
    assert floors["3.11"] == floors["3.12"]
    changed = {name: (floors["3.11"][name], floors["3.13"][name]) for name in floors["3.11"]}
    changed = {name: pair for name, pair in changed.items() if pair[0] != pair[1]}
    assert changed == {"numpy": ("2.0", "2.1"), "pyarrow": ("17", "18"), "matplotlib": ("3.9", "3.9.2")}
    # the split requirements keep one upper cap
    for name in changed:
        uppers = {
            str(s) for python in ("3.11", "3.13") for r in _floors(python)[1] if r.name == name for s in r.specifier
        }
        assert len([u for u in uppers if u.startswith("<")]) == 1, uppers


def test_floor_pins_name_every_floor_and_skip_what_is_asked():
    requirements = [Requirement("torch>=2.13,<2.16"), Requirement("ray[data]>=2.60,<2.61"), Requirement("nofloor<3")]
    assert check_install.floor_pins(requirements) == "torch==2.13\nray==2.60\n"
    assert check_install.floor_pins(requirements, skip=("torch",)) == "ray==2.60\n"


def test_off_floor_names_a_lifted_or_missing_dependency():
    requirements = [Requirement("torch>=2.13"), Requirement("numpy>=2.1,<2.5"), Requirement("Py_Arrow>=18")]
    at_floor = {"torch": "2.13.0+cpu", "numpy": "2.1.0", "py-arrow": "18.0.0"}
    assert check_install.off_floor(at_floor, requirements) == []
    lifted = dict(at_floor, numpy="2.4.1")
    assert check_install.off_floor(lifted, requirements) == ["numpy resolved to 2.4.1, its declared floor is 2.1"]
    missing = {k: v for k, v in at_floor.items() if k != "py-arrow"}
    assert check_install.off_floor(missing, requirements) == ["Py_Arrow is not in the resolution"]


def test_uv_pins_are_read_with_normalised_names():
    text = "# header\nRay[data]==2.60.0\nnumpy==2.1.0 ; python_version >= '3.13'\n    # via x\nmy_pkg==1.0\n"
    assert check_install._pins(text) == {"ray": "2.60.0", "numpy": "2.1.0", "my-pkg": "1.0"}


def _item(name, version, url=None):
    url = url or f"https://files.pythonhosted.org/x/{name}-{version}-cp311-cp311-manylinux_2_28_x86_64.whl"
    return {"metadata": {"name": name, "version": version}, "download_info": {"url": url}}


GOOD_REPORT = {
    "install": [
        _item("torch", "2.14.1"),
        _item("nvidia-cublas", "13.1.0.3"),
        _item("triton", "3.8.0"),
        _item("mamba_ssm", "2.3.2.post1", url="https://files.pythonhosted.org/x/mamba_ssm-2.3.2.post1.tar.gz"),
        _item("causal_conv1d", "1.7.0", url="https://files.pythonhosted.org/x/causal_conv1d-1.7.0.tar.gz"),
    ]
}


def _check(report, torch="2.14.1"):
    cuda, triton = check_install._cuda_specifiers()
    return check_install.check_cuda_report(report, torch, cuda, triton)


def test_the_declared_cuda_and_triton_ranges_are_the_ones_checked():
    cuda, triton = check_install._cuda_specifiers()
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert cuda == {check_install._name(Requirement(t).name): Requirement(t).specifier for t in extras["cuda"]}
    assert set(cuda) == set(check_install.CUDA_PACKAGES)
    (dev_triton,) = [Requirement(t) for t in extras["dev"] if Requirement(t).name == "triton"]
    assert triton == dev_triton.specifier
    # every torch the checks try pins a triton this range admits (2.13 -> 3.7.1, 2.14.1 -> 3.8.x, 2.15 -> 3.9.x)
    assert all(v in triton for v in ("3.7.1", "3.8.0", "3.9.0")) and "3.10.0" not in triton


def test_a_report_with_the_torch_kept_and_the_cuda_packages_in_range_passes():
    assert _check(GOOD_REPORT) == []


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda r: r["install"].pop(0), "torch is not in the resolution"),
        (lambda r: r["install"][0]["metadata"].update(version="2.15.0"), "torch resolved to 2.15.0"),
        (lambda r: r["install"][0]["metadata"].update(version="2.14.1+cpu"), "torch resolved to 2.14.1+cpu"),
        (lambda r: r["install"][0]["download_info"].update(url="https://x/torch-2.14.1.tar.gz"), "from source"),
        (lambda r: r["install"].pop(1), "no nvidia-* libraries"),
        (lambda r: r["install"][2]["metadata"].update(version="3.10.0"), "triton 3.10.0"),
        (lambda r: r["install"].pop(2), "triton is not in the resolution"),
        (lambda r: r["install"][3]["metadata"].update(version="2.1.0"), "mamba-ssm 2.1.0 is outside"),
        (lambda r: r["install"].pop(4), "causal-conv1d is not in the resolution"),
    ],
)
def test_a_report_that_replaces_torch_or_leaves_a_range_fails_naming_it(edit, problem):
    report = copy.deepcopy(GOOD_REPORT)
    edit(report)
    problems = _check(report)
    assert problems and any(problem in p for p in problems), problems


def test_the_script_explains_itself_and_refuses_unknown_checks(capsys):
    with pytest.raises(SystemExit) as done:
        check_install.main(["--help"])
    assert done.value.code == 0 and "lowest" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        check_install.main(["everything"])
    assert done.value.code == 2
