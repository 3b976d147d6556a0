"""The top-level ``kernels/`` folder as a Hugging Face kernel: it stands alone (torch and Triton only), it is not a
module named ``kernels`` (that name belongs to the PyPI package transformers probes), the package runs it as
``hf_statecompose._kernels`` from a source checkout, and the Triton backend takes a Hub / local kernel through the
``kernels`` package where it can, falling back to the bundled one with a one-line warning where it cannot.

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1), on tiny inputs.
"""

import ast
import importlib.util
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from hf_statecompose.ops import _triton

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "kernels" / "torch-ext" / "hf_statecompose_kernels"
STDLIB = {"__future__", "functools", "math"}


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    """Each test starts with no kernel chosen (HSC_KERNEL unset) and leaves none behind."""
    monkeypatch.delenv(_triton.KERNEL_ENV, raising=False)
    monkeypatch.setattr(_triton, "_choice", _triton._UNSET)
    monkeypatch.setattr(_triton, "_module", None)


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ------------------------------------------------------------------------------------------ the folder
def test_the_kernels_folder_is_not_a_module_named_kernels():
    """No ``kernels/__init__.py``: with the repository root first on sys.path (as in the tests), ``kernels`` is the
    PyPI package where it is installed (a regular package always wins over a folder), else nothing importable
    runs from the folder: at most an empty PEP 420 namespace, which transformers' probe reports as absent."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    out = _run(
        "import importlib.util, sys; sys.path.insert(0, '.'); spec = importlib.util.find_spec('kernels')\n"
        "print(spec is None or spec.origin is None, spec is not None and spec.origin is not None and "
        # not from the repository's kernels/ folder (the test sessions' venvs live under the root, in .nox/)
        f"not spec.origin.startswith({str(ROOT / 'kernels')!r}))\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "import importlib.metadata as md\n"
        "try:\n    md.version('kernels'); installed = True\nexcept md.PackageNotFoundError:\n    installed = False\n"
        "print(installed, is_kernels_available() if not installed else 'n/a')\n"
        "if spec is not None and spec.origin is None:\n"
        "    import kernels; print(sorted(n for n in vars(kernels) if not n.startswith('__')))\n"
    ).split("\n")
    no_module_file, pypi_file = out[0].split()
    installed, available = out[1].split()
    if installed == "True":
        assert pypi_file == "True", "find_spec('kernels') is not the installed PyPI package"
    else:
        assert no_module_file == "True" and available == "False"
        if out[2]:
            assert out[2] == "[]", f"the kernels/ folder exposes {out[2]}"


def test_the_kernel_sources_import_only_torch_and_triton():
    """A Hub kernel stands alone: nothing from hf_statecompose (what it needs is passed in by the wrappers)."""
    files = sorted(SOURCE.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "_selective_scan.py", "_ssd.py", "_conv.py", "_compose.py"}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and (node.module or "_").startswith("_"), (path.name, node.module)
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] in {"torch", "triton"} | STDLIB, f"{path.name} imports {name}"


# ------------------------------------------------------------------------------------ the bundled kernels
triton = pytest.importorskip("triton")


def test_a_source_checkout_loads_its_own_kernels_as_hf_statecompose_kernels():
    out = _run(
        "import sys; sys.path.insert(0, '.')\n"
        "from hf_statecompose.ops._triton import bundled_kernels, kernel_module, KERNEL_FUNCTIONS\n"
        "import hf_statecompose\n"
        "m = bundled_kernels()\n"
        "import hf_statecompose._kernels as again\n"
        "print(m.__name__, m.__file__, kernel_module() is m is again is hf_statecompose._kernels, "
        "all(callable(getattr(m, n)) for n in KERNEL_FUNCTIONS))\n"
    )
    name, path, same, complete = out.split()
    assert name == "hf_statecompose._kernels" and Path(path) == SOURCE / "__init__.py"
    assert same == "True" and complete == "True"


def test_the_compose_method_ids_agree_with_the_kernel():
    from hf_statecompose.ops.compose.methods import METHODS

    registry = {name: m.kernel_id for name, m in METHODS.items() if m.kernel_id is not None}
    assert _triton.bundled_kernels().COMPOSE_METHOD_IDS == registry


def test_use_kernel_refuses_a_malformed_name():
    with pytest.raises(ValueError, match="neither an existing folder nor a Hub repo id"):
        _triton.use_kernel("no such folder")
    with pytest.raises(TypeError, match="a kernel is a Hub repo id or a folder"):
        _triton.use_kernel(3)
    _triton.use_kernel("some-org/some-kernel@v2")  # a Hub id: loaded (or refused) at the first Triton call


# ------------------------------------------------------------------------------------------- fallback
def _compose_inputs():
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(2, 4, 8, generator=g) for _ in range(3)]
    return states, torch.rand(3, 2, 4, generator=g), -torch.rand(4, 8, generator=g)


def _fake_kernels(monkeypatch, get_local_kernel):
    fake = types.ModuleType("kernels")
    fake.get_kernel = lambda *args, **kwargs: pytest.fail("no Hub kernel here")
    fake.get_local_kernel = get_local_kernel
    monkeypatch.setitem(sys.modules, "kernels", fake)


def test_without_the_kernels_package_the_bundled_kernels_run_with_a_warning(monkeypatch, tmp_path):
    from hf_statecompose.ops.compose.triton_wrapper import compose_ssm_triton

    monkeypatch.setitem(sys.modules, "kernels", None)  # `import kernels` raises ImportError
    _triton.use_kernel(tmp_path)
    states, delta, A = _compose_inputs()
    with pytest.warns(UserWarning, match=r"cannot use the kernel .*the `kernels` package is not installed") as got:
        out = compose_ssm_triton(states, delta, A, "caso")
    assert len(got) == 1 and "\n" not in str(got[0].message)
    assert _triton.kernel_module() is _triton.bundled_kernels()
    assert torch.equal(out, _triton.bundled_kernels().compose(states, delta, A, 2))


def test_a_broken_or_incomplete_kernel_falls_back_with_the_reason(monkeypatch, tmp_path):
    def missing(path):
        raise FileNotFoundError(f"Cannot find a build variant for this system in {path}:\n\n(trace)")

    _fake_kernels(monkeypatch, missing)
    monkeypatch.setenv(_triton.KERNEL_ENV, str(tmp_path))  # the environment variable names it
    with pytest.warns(
        UserWarning, match=r"\(Cannot find a build variant for this system in .*:\); running the bundled"
    ):
        assert _triton.kernel_module() is _triton.bundled_kernels()

    incomplete = types.ModuleType("incomplete")
    incomplete.compose = incomplete.selective_scan = lambda *args, **kwargs: None
    _fake_kernels(monkeypatch, lambda path: incomplete)
    _triton.use_kernel(tmp_path)
    with pytest.warns(UserWarning, match=r"it has no ssd_scan, causal_conv1d, linear_recurrence"):
        assert _triton.kernel_module() is _triton.bundled_kernels()


def test_a_loaded_kernel_is_what_the_triton_ops_call(monkeypatch, tmp_path):
    """The module get_local_kernel returns is called by the ops (here a wrapper around the bundled one)."""
    from hf_statecompose.ops.compose.triton_wrapper import compose_ssm_triton

    calls = []
    bundled = _triton.bundled_kernels()
    module = types.ModuleType("custom")
    for name in _triton.KERNEL_FUNCTIONS:
        setattr(module, name, getattr(bundled, name))
    module.compose = lambda *args: calls.append(args[3]) or bundled.compose(*args)
    _fake_kernels(monkeypatch, lambda path: module if Path(path) == tmp_path else pytest.fail(str(path)))
    _triton.use_kernel(str(tmp_path))
    states, delta, A = _compose_inputs()
    compose_ssm_triton(states, delta, A, "picaso_r")
    assert calls == [4] and _triton.kernel_module() is module
    _triton.use_kernel(None)  # back to the bundled kernels
    assert _triton.kernel_module() is bundled


# ----------------------------------------------------------------------------- through the kernels package
def test_get_local_kernel_on_the_kernels_folder_gives_the_bundled_results(tmp_path):
    """kernels.get_local_kernel on a build of kernels/ (build_universal.py) returns a module whose functions give
    the bundled kernels' results bit for bit (same source), and the ops run through it."""
    kernels = pytest.importorskip("kernels", reason="the optional `kernels` package (extra hub-kernels)")
    if not hasattr(kernels, "get_local_kernel"):
        pytest.skip("the `kernels` package is not installed (only the repository's kernels/ folder)")
    spec = importlib.util.spec_from_file_location("build_universal", ROOT / "kernels" / "build_universal.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    builder.build(tmp_path)
    from hf_statecompose.ops import compose_ssm_ref, linear_recurrence
    from hf_statecompose.ops.backends import causal_conv1d
    from hf_statecompose.ops.compose.triton_wrapper import compose_ssm_triton

    g = torch.Generator().manual_seed(1)
    states, delta, A = _compose_inputs()
    x, w = torch.randn(2, 4, 6, generator=g), torch.randn(4, 3, generator=g)
    a, b = torch.rand(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    expected = (
        compose_ssm_triton(states, delta, A, "picaso_s"),
        causal_conv1d(x, w, activation="silu", backend="triton"),
        linear_recurrence(a, b, backend="triton"),
    )
    _triton.use_kernel(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # loaded: no fallback warning
        got = (
            compose_ssm_triton(states, delta, A, "picaso_s"),
            causal_conv1d(x, w, activation="silu", backend="triton"),
            linear_recurrence(a, b, backend="triton"),
        )
    loaded = _triton.kernel_module()
    assert loaded is not _triton.bundled_kernels() and loaded.__name__.startswith("_hf_statecompose_kernels_universal_")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    assert all(torch.equal(g_, e_) for g_, e_ in zip(got[1], expected[1]))
    torch.testing.assert_close(got[0], compose_ssm_ref(states, delta, A, "picaso_s"))
