"""The composition-method registry (hf_statecompose/ops/compose/methods.py) is the one place a method is described:
every other list of methods derives from it, the C enum and the Triton kernel ids agree with it, and a method
added at run time (one registry entry) composes through the reference, torch and composer paths. Also: the C
sources of the CPU kernels are plain .c files that a C compiler accepts as they are, and state/'s modules
import one way only."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import cli
from hf_statecompose.composition import MODEL_BASED_METHODS, MODEL_FREE_METHODS, StateComposer
from hf_statecompose.ops import backends
from hf_statecompose.ops.compose import compose_ssm_ref, compose_ssm_torch, methods
from hf_statecompose.ops.compose.methods import METHODS, CompositionMethod

from helpers import random_ids, tiny_model

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "hf_statecompose" / "ops" / "csrc"
DOCUMENTED_ORDER = ("soup", "weighted", "caso", "picaso_s", "picaso_r", "concat", "piconcat_r")


def test_every_list_of_methods_is_the_registry():
    assert tuple(METHODS) == DOCUMENTED_ORDER
    assert hsc.METHODS == DOCUMENTED_ORDER and isinstance(hsc.METHODS, tuple)
    assert cli.COMPOSITIONS == DOCUMENTED_ORDER
    assert MODEL_FREE_METHODS == tuple(n for n, m in METHODS.items() if not m.reencodes)
    assert MODEL_BASED_METHODS == ("concat", "piconcat_r") == tuple(n for n, m in METHODS.items() if m.reencodes)
    from hf_statecompose.ops.compose import WEIGHT_FUNCTIONS

    assert set(WEIGHT_FUNCTIONS) == {n for n, m in METHODS.items() if m.weights is not None}
    for name, method in METHODS.items():
        assert method.name == name and method.summary and method.cost and method.exact
        if method.reencodes:
            assert method.kernel_id is None and method.conv is None and method.delta_sum is None
        else:
            assert StateComposer(name, weights=[0.5, 0.5] if method.user_weights else None).conv == method.conv


def test_the_cli_reads_the_registry_without_torch():
    code = "import sys, hf_statecompose.cli as c; print(list(c.COMPOSITIONS), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == f"{list(DOCUMENTED_ORDER)} False"


def test_the_c_enum_and_the_triton_ids_are_the_registrys():
    ids = {name: m.kernel_id for name, m in METHODS.items() if m.kernel_id is not None}
    assert sorted(ids.values()) == list(range(len(ids)))  # dense: the kernels switch on 0..k-1
    source = (CSRC / "compose_ssm.c").read_text(encoding="utf-8")
    enum = re.search(r"enum\s*\{([^}]*)\}", source).group(1)
    c_ids = {key.strip().lower(): int(value) for key, value in (item.split("=") for item in enum.split(","))}
    assert c_ids == ids
    # the Triton kernel (the top-level kernels/ folder): its METHOD branches name their method
    triton = (ROOT / "kernels" / "torch-ext" / "hf_statecompose_kernels" / "_compose.py").read_text(encoding="utf-8")
    branches = {name: int(k) for k, name in re.findall(r"METHOD == (\d+):\s*#\s*(\w+)", triton)}
    assert len(branches) >= len(ids) - 1  # the last method is the final `else`
    assert all(ids[name] == k for name, k in branches.items()), branches
    literal = re.search(r"METHOD_IDS = (\{[^}]*\})", triton)
    assert ast.literal_eval(literal.group(1)) == ids


def test_methods_table_lists_every_method():
    table = methods.methods_table()
    lines = table.strip().splitlines()
    assert lines[0].startswith("| method | what | cost | order-invariant | exact when | re-encodes |")
    assert [line.split("|")[1].strip(" `") for line in lines[2:]] == list(METHODS)
    assert "| `picaso_s` |" in table and "O(n²)" in table


def test_the_docs_show_the_registrys_table():
    """The composition guide's table is the registry's (regenerate it with ``methods_table()`` after an edit)."""
    page = (ROOT / "docs" / "guides" / "composition.md").read_text(encoding="utf-8")
    assert methods.methods_table() in page


def _first_weights(log_decays):
    """Toy method: all the weight on the first (oldest) state."""
    W = torch.zeros_like(log_decays)
    W[0] = 1.0
    return W


@pytest.fixture
def first_method():
    method = methods.register(
        CompositionMethod(
            name="first",
            summary="the first state",
            weights=_first_weights,
            delta_sum="uniform",
            conv="last",
            order_invariant=False,
            exact="n = 1",
            cost="O(n)",
        )
    )
    yield method
    methods.unregister("first")
    assert "first" not in METHODS


@pytest.mark.parametrize("shape,a_shape", [((2, 3, 5), (3, 5)), ((2, 3, 4, 5), (3,))])
def test_a_registered_method_composes_with_one_entry(first_method, shape, a_shape):
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(shape, generator=g) for _ in range(3)]
    delta = torch.rand(3, shape[0], shape[1], generator=g)
    A = -torch.rand(a_shape, generator=g)
    for compose in (compose_ssm_ref, compose_ssm_torch, backends.compose_ssm):
        assert torch.equal(compose(states, delta, A, "first"), states[0]), compose
    assert "| `first` | the first state |" in methods.methods_table()


def test_a_registered_method_composes_states(first_method):
    model = tiny_model("mamba", layers=2)
    g = torch.Generator().manual_seed(1)
    states = [hsc.ComposableMambaCache.encode(model, random_ids(5 + k, generator=g)) for k in range(3)]
    composer = StateComposer("first")
    assert composer.conv == "last"
    out = composer.compose(states)
    for i in range(out.num_layers):
        assert torch.equal(out.ssm_states[i], states[0].ssm_states[i])
        assert torch.equal(out.conv_states[i], states[-1].conv_states[i])
        assert torch.allclose(out.delta_sums[i], torch.stack([s.delta_sums[i] for s in states]).mean(0))


def test_a_method_is_known_only_while_registered():
    with pytest.raises(ValueError, match="unknown composition method 'first'; choose one of soup, weighted"):
        StateComposer("first")
    with pytest.raises(KeyError, match="no registered composition method 'first'"):
        methods.unregister("first")


def test_register_refuses_what_the_kernels_cannot_tell_apart(first_method):
    with pytest.raises(ValueError, match="'first' exists already"):
        methods.register(first_method)
    with pytest.raises(ValueError, match="kernel_id 2 is taken"):
        methods.register(
            CompositionMethod("last", "x", weights=_first_weights, delta_sum="total", conv="last", kernel_id=2)
        )
    with pytest.raises(ValueError, match="re-encodes"):
        methods.register(CompositionMethod("reconcat", "x", reencodes=True))
    with pytest.raises(ValueError, match="built-in"):
        methods.unregister("caso")
    with pytest.raises(ValueError, match="needs weights="):
        CompositionMethod("none", "x", delta_sum="total", conv="mean")
    with pytest.raises(ValueError, match="delta_sum must be one of"):
        CompositionMethod("bad", "x", weights=_first_weights, delta_sum="median", conv="mean")
    with pytest.raises(TypeError, match="CompositionMethod"):
        methods.register("first")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
def test_c_sources_compile_as_files(source):
    run = subprocess.run(
        ["gcc", "-fsyntax-only", "-std=c99", "-fopenmp", "-Wall", "-Werror", f"-I{CSRC}", str(CSRC / source)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


def test_the_kernels_are_the_c_files():
    from hf_statecompose.ops import _native

    assert {p.name for p in CSRC.glob("*.c")} == {"compose_ssm.c", "causal_conv1d.c", "selective_scan.c", "ssd_scan.c"}
    for name in ("compose_ssm", "causal_conv1d", "selective_scan", "ssd_scan"):
        text = _native.read_source(name)
        assert _native.MATH in text and '#include "statecompose_math.h"' not in text
        assert (CSRC / f"{name}.c").read_text(encoding="utf-8").split('#include "statecompose_math.h"\n')[1] in text
    assert not re.search(
        r'r"""\s*#include', "".join(p.read_text() for p in (ROOT / "hf_statecompose" / "ops").rglob("*.py"))
    )


STATE = ROOT / "hf_statecompose" / "state"
# state/'s layers, top to bottom (the import-linter contract "state" in .importlinter): none imports a module above it
STATE_LAYERS = (
    {"serpent_cache", "hybrid_cache"},
    {"cache"},
    {"serialization"},
    {"validation"},
    {"fingerprint", "layers", "files"},
    {"architectures"},
)


@pytest.mark.parametrize("level", range(1, len(STATE_LAYERS)))
def test_state_modules_import_one_way(level):
    above = set().union(*STATE_LAYERS[:level])
    for module in STATE_LAYERS[level]:
        tree = ast.parse((STATE / f"{module}.py").read_text(encoding="utf-8"))
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        }
        assert not imported & above, (module, imported & above)
