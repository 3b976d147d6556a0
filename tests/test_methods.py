"""The composition-method registry (hf_statecompose/ops/compose/methods.py) is the one place a method is described:
every other list of methods derives from it, the C enum and the Triton kernel ids agree with it, and a method
added at run time (one registry entry) composes through the reference, torch and composer paths, register refuses
what can be known before composing and a registered weight function's output is checked at compose; every entry's
order_invariant and exact claims are tested (parametrised over the registry at collection). Also: the C
sources of the CPU kernels are plain .c files that a C compiler accepts as they are, and state/'s modules
import one way only."""

import ast
import itertools
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
from hf_statecompose.ops.compose import weights as weight_functions
from hf_statecompose.ops.compose.methods import EXACT_CLAIMS, KERNEL_METHODS, METHODS, CompositionMethod

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
    assert KERNEL_METHODS == {k: name for name, k in ids.items()}  # what register accepts is what the kernels do
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
    with pytest.raises(ValueError, match="kernel_id 2 computes the weights of 'caso', not the method's own"):
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
    assert "last" not in METHODS


def _toy(**fields):
    """A model-free toy method (CASO's weights through a function of its own: no kernel, checked at compose)."""
    return CompositionMethod(
        **{"name": "toy", "summary": "x", "weights": _own_caso, "delta_sum": "total", "conv": "last", **fields}
    )


def _own_caso(log_decays):
    return weight_functions.caso_weights(log_decays)


@pytest.mark.parametrize("kernel_id", [5, 99, -1, True, 2.0, "2"])
def test_a_kernel_id_no_kernel_implements_is_refused(kernel_id):
    """The issue's case: kernel_id 5 was registered and composing ignored the method's weights."""
    with pytest.raises(ValueError, match=f"kernel_id {re.escape(repr(kernel_id))} is not implemented by a kernel"):
        _toy(kernel_id=kernel_id)
    methods.register(_toy())  # the same method without the kernel_id is taken
    methods.unregister("toy")


@pytest.mark.parametrize("alias,builtin", [("my_caso", "caso"), ("my_picaso_s", "picaso_s"), ("my_soup", "soup")])
def test_an_alias_of_a_builtin_runs_on_its_kernel_and_nothing_else_may(alias, builtin):
    """A kernel_id is taken with the weights its kernel computes (the same function, by name or object), so an
    alias of a built-in method composes as it does on every path; with its own weights (even equal ones) it is
    refused, since the kernel would not call them."""
    spec = METHODS[builtin]
    fields = dict(weights=spec.weights, fixed_weights=spec.fixed_weights, delta_sum=spec.delta_sum, conv=spec.conv)
    with pytest.raises(ValueError, match=f"computes the weights of {builtin!r}|its weights must be soup's"):
        methods.register(CompositionMethod(alias, "x", **{**fields, "weights": _own_caso}, kernel_id=spec.kernel_id))
    methods.register(CompositionMethod(alias, "x", **fields, kernel_id=spec.kernel_id))
    try:
        g = torch.Generator().manual_seed(2)
        for shape, a_shape in (((2, 3, 5), (3, 5)), ((2, 3, 4, 5), (3,))):
            states = [torch.randn(shape, generator=g) for _ in range(3)]
            delta, A = torch.rand(3, *shape[:2], generator=g), -torch.rand(a_shape, generator=g)
            for compose in (compose_ssm_ref, compose_ssm_torch, backends.compose_ssm):
                torch.testing.assert_close(compose(states, delta, A, alias), compose(states, delta, A, builtin))
    finally:
        methods.unregister(alias)


@pytest.mark.parametrize(
    "weights,error,message",
    [
        ("missing.module:fn", ValueError, r"weights='missing.module:fn' does not resolve \(ModuleNotFoundError"),
        ("hf_statecompose.ops.compose.weights:nope", ValueError, "does not resolve \\(AttributeError"),
        ("math:pi", TypeError, "weights='math:pi' is float, not callable"),
        (42, TypeError, "weights must be a function of the log decays or its name 'module:function', got 42"),
        ("caso_weights", TypeError, "its name 'module:function', got 'caso_weights'"),
    ],
)
def test_a_weights_spec_that_does_not_resolve_is_refused_at_register(weights, error, message):
    with pytest.raises(error, match=message):
        methods.register(_toy(weights=weights))
    assert "toy" not in METHODS
    methods.register(_toy(weights=f"{__name__}:_own_caso"))  # a spec that resolves is taken
    methods.unregister("toy")


def test_register_refuses_contradictory_or_mistyped_fields():
    with pytest.raises(ValueError, match="order_invariant=True with conv='last'"):
        _toy(order_invariant=True)
    with pytest.raises(ValueError, match="not exact always"):
        _toy(exact="always (by definition)")
    with pytest.raises(ValueError, match="needs delta_sum='total' and conv='last'"):
        _toy(exact=EXACT_CLAIMS[1], conv="mean")
    with pytest.raises(ValueError, match="exact must be one of 'n = 1'"):
        _toy(exact="for short contexts")
    with pytest.raises(TypeError, match="summary must be a non-empty str"):
        _toy(summary=3)
    with pytest.raises(TypeError, match="order_invariant must be True or False"):
        _toy(order_invariant="yes", conv="mean")
    with pytest.raises(ValueError, match="identifier"):
        _toy(name=["toy"])
    with pytest.raises(ValueError, match="fixed_weights='uniform' composes with 1/n; its weights must be soup's"):
        methods.register(_toy(fixed_weights="uniform", delta_sum="uniform", conv="mean"))
    _toy(exact=EXACT_CLAIMS[1])  # the same claim with a concatenation's ΣΔ and window is taken


def test_unregister_takes_a_name():
    with pytest.raises(TypeError, match=r"unregister takes a method's name \(a str\), got list \['x'\]"):
        methods.unregister(["x"])
    with pytest.raises(KeyError, match="no registered composition method 'x'"):
        methods.unregister("x")


def test_the_registry_is_changed_only_through_register():
    with pytest.raises(TypeError):
        METHODS["toy"] = _toy()  # type: ignore[index]
    assert "toy" not in METHODS


# bad outputs of a weight function, each refused at compose: (function of the log decays, error, message)
_BAD_WEIGHTS = {
    "negative": (lambda ld: -weight_functions.soup_weights(ld), ValueError, "negative weights"),
    "sum 0": (torch.zeros_like, ValueError, r"off 1|below Π"),
    "sum 2": (lambda ld: 2 * weight_functions.soup_weights(ld), ValueError, r"off 1|below Π"),
    "1e30": (lambda ld: torch.full_like(ld, 1e30), ValueError, r"off 1|above 1"),
    "shape [n]": (lambda ld: torch.full(ld.shape[:1], 1 / ld.shape[0]), ValueError, r"shape \(3,\) for log decays"),
    "int dtype": (lambda ld: torch.ones_like(ld, dtype=torch.int64), TypeError, "int64 weights; weights must be"),
    "NaN": (lambda ld: torch.full_like(ld, float("nan")), ValueError, "NaN or inf weights"),
}


@pytest.mark.parametrize("delta_sum", ["uniform", "total"])
@pytest.mark.parametrize("fault", list(_BAD_WEIGHTS))
def test_a_weight_functions_bad_output_is_refused_at_compose(fault, delta_sum):
    function, error, message = _BAD_WEIGHTS[fault]
    methods.register(_toy(weights=function, delta_sum=delta_sum, conv="mean"))
    try:
        g = torch.Generator().manual_seed(3)
        for shape, a_shape in (((2, 3, 5), (3, 5)), ((2, 3, 4, 5), (3,))):
            states = [torch.randn(shape, generator=g) for _ in range(3)]
            delta, A = torch.rand(3, *shape[:2], generator=g), -torch.rand(a_shape, generator=g)
            for compose in (compose_ssm_ref, compose_ssm_torch, backends.compose_ssm):
                with pytest.raises(error, match=f"the weight function of method 'toy' returned .*({message})"):
                    compose(states, delta, A, "toy")
    finally:
        methods.unregister("toy")


def test_a_bad_weight_function_is_refused_by_the_composer_too():
    model = tiny_model("mamba", layers=1)
    g = torch.Generator().manual_seed(4)
    states = [hsc.ComposableMambaCache.encode(model, random_ids(5, generator=g)) for _ in range(3)]
    methods.register(_toy(weights=_BAD_WEIGHTS["sum 2"][0], delta_sum="uniform", conv="mean"))
    try:
        with pytest.raises(ValueError, match="the weight function of method 'toy' returned weights whose sum"):
            StateComposer("toy").compose(states)
    finally:
        methods.unregister("toy")
    methods.register(_toy(weights=_first_weights, delta_sum="uniform", conv="mean"))  # a good one composes
    try:
        assert torch.equal(StateComposer("toy").compose(states).ssm_states[0], states[0].ssm_states[0])
    finally:
        methods.unregister("toy")


# --- the order_invariant and exact claims, for every method of the registry (parametrised at collection) ---


def _user_weights(spec, n):
    if not spec.user_weights:
        return None
    return [0.2, 0.3, 0.5] if n == 3 else [1.0]


def _compose(name, states, model, weights=None):
    spec = METHODS[name]
    composer = StateComposer(name, weights=weights if weights is not None else _user_weights(spec, len(states)))
    return composer.compose(states, model=model if spec.reencodes else None)


def _close(a, b, rtol=1e-4, atol=1e-5) -> bool:
    return all(
        torch.allclose(x, y, rtol=rtol, atol=atol)
        for i in range(a.num_layers)
        for x, y in ((a.ssm_states[i], b.ssm_states[i]), (a.conv_states[i], b.conv_states[i]))
    ) and all(torch.allclose(a.log_decay(i), b.log_decay(i), rtol=rtol, atol=atol) for i in range(a.num_layers))


def _order_invariant(name, arch) -> bool:
    """Whether composing 3 states of a tiny ``arch`` in every order gives one state (user weights move along)."""
    model = tiny_model(arch, layers=2)
    g = torch.Generator().manual_seed(5)
    states = [hsc.ComposableMambaCache.encode(model, random_ids(4 + 3 * k, generator=g)) for k in range(3)]
    weights = [0.2, 0.3, 0.5] if METHODS[name].user_weights else None
    first = _compose(name, states, model, weights)
    for order in list(itertools.permutations(range(3)))[1:]:
        w = None if weights is None else [weights[k] for k in order]
        if not _close(_compose(name, [states[k] for k in order], model, w), first):
            return False
    return True


def _exact_up_to(name, arch) -> str | None:
    """The strongest claim of EXACT_CLAIMS that holds for ``name`` on a tiny ``arch``, checked against ``concat``
    (and ``concat`` against encoding the concatenated tokens); None if not even one state composes to itself."""
    holds = None
    for claim, (layers, conv_kernel, n) in zip(EXACT_CLAIMS, ((2, 4, 1), (1, 1, 3), (2, 4, 3))):
        model = tiny_model(arch, layers=layers, conv_kernel=conv_kernel)
        contexts = [random_ids(length, generator=torch.Generator().manual_seed(length)) for length in (9, 4, 13)[:n]]
        states = [hsc.ComposableMambaCache.encode(model, c) for c in contexts]
        concat = StateComposer("concat").compose(states, model=model)
        assert _close(concat, hsc.ComposableMambaCache.encode(model, torch.cat(contexts, 1)))
        if not _close(_compose(name, states, model), concat):
            return holds
        holds = claim
    return holds


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
@pytest.mark.parametrize("name", list(METHODS))
@torch.no_grad()
def test_every_methods_order_invariant_flag_is_true(name, arch):
    """order_invariant=True: every permutation of the states composes to the same state; False: some does not
    (the docs' table says no more and no less)."""
    assert _order_invariant(name, arch) == METHODS[name].order_invariant


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
@pytest.mark.parametrize("name", list(METHODS))
@torch.no_grad()
def test_every_methods_exact_claim_is_the_one_that_holds(name, arch):
    """``exact``: the method equals concat where it claims to (one state; one SSM layer without conv leakage; any
    model) and not in the next setting up (the claim is the strongest that holds)."""
    assert _exact_up_to(name, arch) == METHODS[name].exact


@torch.no_grad()
def test_the_claim_checks_catch_a_false_claim():
    """The two checks above fail for a method claiming what it does not do: CASO's weights flagged order-invariant
    (its window the mean), PICASO-R's claiming CASO's exactness."""
    methods.register(_toy(conv="mean", order_invariant=True))
    try:
        assert not _order_invariant("toy", "mamba")
    finally:
        methods.unregister("toy")
    methods.register(_toy(weights=lambda ld: weight_functions.picaso_r_weights(ld), exact=EXACT_CLAIMS[1]))
    try:
        assert _exact_up_to("toy", "mamba") == "n = 1" != METHODS["toy"].exact
    finally:
        methods.unregister("toy")


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
