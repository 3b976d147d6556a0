"""The adapter (hf_statecompose.compat): the one module that reads transformers' internals.

These tests pin what the adapter promises on the installed transformers (the test command runs them on the
lowest and the newest release of the tested range), and that nothing else in the package reads those internals."""

import ast
import pathlib
import re
import warnings

import pytest
import torch
import transformers

import hf_statecompose as hsc
from hf_statecompose import compat
from hf_statecompose.state.layers import ComposableSSMLayer

from helpers import random_ids, tiny_model

PACKAGE = pathlib.Path(hsc.__file__).parent


# ------------------------------------------------------------------------------------------ versions
def test_the_installed_transformers_is_in_the_tested_range():
    assert compat.transformers_version() == transformers.__version__
    assert compat.is_tested_transformers(), (
        f"transformers {transformers.__version__} is outside {compat.TESTED_TRANSFORMERS_TEXT}"
    )


@pytest.mark.parametrize(
    "text, tested",
    [
        ("5.22.2", False),
        ("5.23.0", True),
        ("5.23.1", True),
        ("5.24.0", True),
        ("5.24.3", True),
        ("5.25.0", True),
        ("5.25.4", True),
        ("5.26.0", False),
        ("5.25.0rc1", True),
        ("5.24.0.dev0", True),
        ("6.0.0", False),
        ("4.57.6", False),
    ],
)
def test_tested_range(text, tested):
    assert compat.is_tested_transformers(text) is tested


@pytest.mark.parametrize("text, renamed", [("5.23.0", False), ("5.23.9", False), ("5.24.0", True), ("5.30.1", True)])
def test_cache_rename_release(text, renamed):
    assert compat.cache_is_renamed(text) is renamed


def test_an_untested_transformers_warns_once_naming_the_range(monkeypatch):
    monkeypatch.setattr(compat, "transformers_version", lambda: "5.26.0")
    monkeypatch.setattr(compat, "_warned", False)
    with pytest.warns(UserWarning, match=r"tested with transformers >=5\.23,<5\.26.*transformers 5\.26\.0"):
        compat.warn_if_untested()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_untested()  # once


def test_a_tested_transformers_does_not_warn(monkeypatch):
    monkeypatch.setattr(compat, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_untested()


def test_import_warns_in_a_fresh_process_on_an_untested_release(tmp_path):
    """What a user sees: ``import hf_statecompose`` with a transformers outside the range (faked by metadata)."""
    import subprocess
    import sys

    fake = tmp_path / "transformers-5.26.0.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.26.0\n")
    script = "import warnings; warnings.simplefilter('always'); import hf_statecompose"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("tested with transformers >=5.23,<5.26") == 1, done.stderr


# ------------------------------------------------------------------------------------------ the cache's name
def test_cache_arg_is_what_the_installed_mamba_takes():
    import inspect

    from transformers import MambaModel

    assert compat.CACHE_ARG in inspect.signature(MambaModel.forward).parameters
    assert compat.CACHE_ARG == ("cache" if compat.cache_is_renamed() else "cache_params")


def test_pop_and_resolve_cache_take_either_name_and_refuse_two():
    a, b = object(), object()
    for name in ("cache", "cache_params"):
        kwargs = {name: a, "x": 1}
        assert compat.pop_cache(kwargs) is a and kwargs == {"x": 1}
    assert compat.pop_cache({}) is None
    assert compat.pop_cache({"cache": None, "cache_params": a}) is a
    with pytest.raises(ValueError, match="not both"):
        compat.pop_cache({"cache": a, "cache_params": b})
    kwargs = {"cache_params": a}
    assert compat.resolve_cache(None, kwargs) is a and kwargs == {}
    assert compat.resolve_cache(a, {}) is a
    with pytest.raises(ValueError, match="not both"):
        compat.resolve_cache(a, {"cache_params": b})


@torch.no_grad()
def test_our_outputs_carry_the_cache_under_both_names():
    model = hsc.SeRpEntMambaForCausalLM(
        hsc.SeRpEntMambaConfig(
            vocab_size=50,
            hidden_size=24,
            state_size=4,
            num_hidden_layers=1,
            branch_compressions=[1.0, 0.5],
            resample_window=2,
        )
    ).eval()
    out = model(random_ids(5) % 50, use_cache=True)
    assert compat.CACHE_ARG in out.keys()  # what the installed release's generate() reads back
    assert out.cache is out.cache_params is compat.output_cache(out)
    assert isinstance(out.cache, hsc.ComposableSeRpEntCache)
    # the older name as an argument still works, and the cache continues
    again = model(random_ids(2) % 50, cache_params=out.cache, use_cache=True)
    assert again.cache is out.cache and out.cache.num_tokens.tolist() == [7]


# ------------------------------------------------------------------------------------------ the cache layer
@torch.no_grad()
def test_the_layer_is_transformers_linear_attention_layer_and_owns_its_decay():
    from transformers.cache_utils import LinearAttentionLayer

    model = tiny_model("mamba")
    state = hsc.encode(model, torch.cat([random_ids(9, batch=1) for _ in range(3)]))
    layer = state.layers[0]
    assert isinstance(layer, LinearAttentionLayer) and isinstance(layer, ComposableSSMLayer)
    assert layer.delta_sum is state.delta_sums[0] and layer.A is state.A[0]
    assert not hasattr(state, "_delta_sums") and "delta_sums" not in vars(state)  # no parallel list


@torch.no_grad()
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_transformers_batch_operations_keep_every_tensor_of_a_row_together(arch):
    """transformers' own Cache methods (dispatching to the layers) move ΣΔ with the SSM state, by construction."""
    model = tiny_model(arch)
    rows = [random_ids(n) for n in (4, 9, 15)]
    alone = [hsc.encode(model, r) for r in rows]
    width = 15
    ids = torch.stack([torch.nn.functional.pad(r[0], (width - r.shape[1], 0)) for r in rows])
    mask = torch.stack(
        [torch.nn.functional.pad(torch.ones(r.shape[1], dtype=torch.long), (width - r.shape[1], 0)) for r in rows]
    )

    def check(cache, order):
        assert cache.batch_size == len(order)
        for position, row in enumerate(order):
            for i in range(cache.num_layers):
                torch.testing.assert_close(cache.ssm_states[i][position], alone[row].ssm_states[i][0])
                torch.testing.assert_close(cache.delta_sums[i][position], alone[row].delta_sums[i][0])
            assert cache.num_tokens[position] == rows[row].shape[1]

    cache = hsc.encode(model, ids, attention_mask=mask)
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    check(cache, [2, 0, 1])
    cache.batch_select_indices(torch.tensor([1, 2]))
    check(cache, [0, 1])
    cache.batch_repeat_interleave(2)
    check(cache, [0, 0, 1, 1])
    for layer in cache.layers:  # what Cache.offload(l) / prefetch(l) call per layer
        layer.offload()
        layer.prefetch()
    check(cache, [0, 0, 1, 1])
    cache.reset()
    assert all(layer.delta_sum is None and not layer.filled for layer in cache.layers)
    assert cache.num_tokens is None


# ------------------------------------------------------------------------------------------ one module reads internals
# what only the adapter may name: transformers' cache internals, private generation hooks, modeling modules,
# the cache argument's old name as a key, version checks
_INTERNALS = [
    r"\bcache_utils\b",
    r"\brecurrent_states\b",
    r"\bhas_previous_state\b",
    r"\bis_conv_states_initialized\b",
    r"\bconv_kernel_size\[",
    r"\b_prepare_cache_for_generation\b",
    r"\b_validate_model_kwargs\b",
    r"transformers\.models\.(?!auto\.)[a-z_0-9]+\.modeling_",
    r"transformers\.generation\.utils",
    r"""["']cache_params["']""",
    r"transformers\.__version__",
    r"version\(\s*[\"']transformers[\"']\s*\)",
    r"\bLinearAttentionLayer\b",
]


def _code_without_docstrings(path: pathlib.Path) -> str:
    """The source with docstrings and comments blanked (they may name what they explain)."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            for n in range(body[0].lineno - 1, body[0].end_lineno):
                lines[n] = ""
    return "\n".join(re.sub(r"#.*$", "", line) for line in lines)


def test_only_the_adapter_reads_transformers_internals():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py" and path.parent == PACKAGE:
            continue
        code = _code_without_docstrings(path)
        for pattern in _INTERNALS:
            for match in re.finditer(pattern, code):
                line = code[: match.start()].count("\n") + 1
                offenders.append(f"{path.relative_to(PACKAGE)}:{line}: {match.group(0)}")
    assert not offenders, "transformers internals outside hf_statecompose/compat.py:\n" + "\n".join(offenders)


def test_the_internals_check_would_catch_a_violation(tmp_path):
    """The scan above is not vacuous: the same scan flags code that reads an internal."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""doc: recurrent_states is fine here"""\nx = layer.recurrent_states[0]  # and here\n')
    code = _code_without_docstrings(probe)
    assert [p for p in _INTERNALS if re.search(p, code)] == [r"\brecurrent_states\b"]


# what only the torch adapter (hf_statecompose/_torch_compat.py) may name: torch's private namespaces anywhere in
# the package; in the fingerprint also the private tensor / storage / compiled-module attributes it reads
_TORCH_PRIVATES = [r"\btorch\._[A-Za-z]", r"\b_C\.", r"\b_lazy_clone\b", r"\b_is_cow_tensor\b"]
_TORCH_PRIVATE_ATTRIBUTES = [r"\._cdata\b", r"\._version\b", r"\b_orig_mod\b"]


def _torch_privates(path: pathlib.Path) -> list[str]:
    code = _code_without_docstrings(path)
    patterns = _TORCH_PRIVATES + (_TORCH_PRIVATE_ATTRIBUTES if path.name == "fingerprint.py" else [])
    return [
        f"{path.name}:{code[: match.start()].count(chr(10)) + 1}: {match.group(0)}"
        for pattern in patterns
        for match in re.finditer(pattern, code)
    ]


def test_only_the_torch_adapter_calls_torch_privates():
    offenders = [
        offender
        for path in sorted(PACKAGE.rglob("*.py"))
        if not (path.name == "_torch_compat.py" and path.parent == PACKAGE)
        for offender in _torch_privates(path)
    ]
    assert not offenders, "torch privates outside hf_statecompose/_torch_compat.py:\n" + "\n".join(offenders)
    assert _torch_privates(PACKAGE / "_torch_compat.py")  # the adapter does name them: the scan sees them


def test_the_torch_privates_check_would_catch_a_violation(tmp_path):
    probe = tmp_path / "fingerprint.py"
    probe.write_text(
        '"""torch._lazy_clone in a docstring is fine"""\n'
        "a = torch._C._is_cow_tensor(t)  # torch._x in a comment too\n"
        "b = torch._lazy_clone(t)\n"
        "c = t._version\n"
    )
    assert [offender.split(": ")[1] for offender in _torch_privates(probe)] == [
        "torch._C",
        "torch._l",
        "_C.",
        "_lazy_clone",
        "_is_cow_tensor",
        "._version",
    ]


def test_every_guarded_class_exists_in_the_installed_transformers():
    import importlib

    from hf_statecompose.models.mixers import stock_mixer_classes
    from hf_statecompose.state.architectures import guarded_classes

    for module, names in guarded_classes().items():
        loaded = importlib.import_module(module)
        assert all(hasattr(loaded, name) for name in names), module
    assert set(stock_mixer_classes()) == {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "zamba2",
        "bamba",
        "granitemoehybrid",
        "nemotron_h",
        "falcon_h1",
        "qwen3_next",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "olmo_hybrid",
        "kimi_linear",
    }


@pytest.mark.parametrize("arch", ["qwen3_5_text", "bamba"])
def test_an_enabled_forward_compiles_in_one_graph(arch):
    """The enabled forward (without past_states) stays one graph under torch.compile(fullgraph=True), as the stock one
    does (transformers' test_generate_compile_model_forward_fullgraph): the deprecation-wrapper check it runs on every
    call reads a plain global (a functools.cache made the tracer trace into transformers' deprecate_kwarg and fail)."""
    import torch

    from architectures import hybrid_model, ids

    model = hybrid_model(arch, dtype=torch.float32)
    query = ids(5, seed=1)
    with torch.no_grad():
        expected = model(query).logits
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
        assert torch.allclose(compiled(query).logits, expected, atol=1e-5)
