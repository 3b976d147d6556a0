"""``import hf_statecompose`` is light (no torch) yet complete: lazy public names, lm-eval's model
registered, and ``past_states=`` refused by a model that was never enabled."""

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

import hf_statecompose as hsc
from hf_statecompose import _guard

from helpers import VOCAB, random_ids


def run_python(code: str, cwd=None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def stock_model(arch: str, seed: int = 0):
    """A tiny Mamba / Mamba-2 exactly as transformers makes it: never enabled."""
    torch.manual_seed(seed)
    if arch == "mamba":
        return MambaForCausalLM(
            MambaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                state_size=8,
                num_hidden_layers=2,
                pad_token_id=0,
                eos_token_id=1,
                bos_token_id=2,
            )
        ).eval()
    return Mamba2ForCausalLM(
        Mamba2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=8,
            n_groups=2,
            chunk_size=16,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
    ).eval()


# ------------------------------------------------------------------------------------ lazy names
def test_import_does_not_import_torch_and_names_load_on_use():
    out = run_python("""
        import sys
        import hf_statecompose as hsc
        print("torch" in sys.modules, "transformers" in sys.modules, "lm_eval" in sys.modules)
        print(sorted(set(hsc.__all__) - set(dir(hsc))))
        # first use: the state class alone, from its own layer; its encode() is installed by the models
        # layer, which must load too
        import torch
        from hf_statecompose.state import ComposableMambaCache
        from transformers import MambaConfig, MambaForCausalLM
        model = MambaForCausalLM(MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=1)).eval()
        print(ComposableMambaCache.encode(model, torch.tensor([[3, 4, 5]])).batch_size, callable(hsc.enable))
    """)
    assert out.split("\n")[:3] == ["False False False", "[]", "1 True"]


def test_every_public_name_resolves_to_its_definition():
    import hf_statecompose.composition as composition
    import hf_statecompose.generation as generation

    assert set(hsc._EXPORTS) == set(hsc.__all__)
    for name in hsc.__all__:
        assert getattr(hsc, name) is getattr(__import__(f"hf_statecompose.{hsc._EXPORTS[name]}", fromlist=[name]), name)
    assert hsc.enable is generation.enable and hsc.METHODS is composition.METHODS
    assert hsc.store.StateStore is hsc.StateStore  # subpackages as attributes, as before
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hsc.nope  # noqa: B018 - the attribute access is what must raise


# ------------------------------------------------------------------------------------ the guard
def test_past_states_on_a_never_enabled_model_is_refused(arch):
    model = stock_model(arch)
    states = [hsc.encode(hsc.enable(stock_model(arch)), random_ids(6))]
    ids = random_ids(5)
    with pytest.raises(ValueError, match=r"past_states needs hf_statecompose\.enable\(model\) first"):
        model(input_ids=ids, past_states=states, labels=ids)
    with pytest.raises(ValueError, match=r"ForCausalLM\.generate\(\) got past_states.*hf_statecompose\.enable"):
        model.generate(ids, past_states=states, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"Model\.forward\(\) got past_states"):
        model.base_model(input_ids=ids, past_states=states)


def test_the_guard_changes_nothing_else(arch):
    model = stock_model(arch)
    cls = type(model)
    for method in (cls.forward, cls.generate, type(model.base_model).forward):
        assert getattr(method, _guard._MARK) and inspect.signature(method) == inspect.signature(method.__wrapped__)
    ids = random_ids(7)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, cls.forward.__wrapped__(model, input_ids=ids).logits)
        assert torch.equal(model(input_ids=ids, past_states=None).logits, model(input_ids=ids).logits)
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, cls.generate.__wrapped__(model, ids, max_new_tokens=3, do_sample=False))


def test_a_model_enabled_later_works_and_disabling_refuses_again(arch):
    model, reference = stock_model(arch), hsc.enable(stock_model(arch))
    states, ids = [hsc.encode(reference, random_ids(6))], random_ids(5)
    with pytest.raises(ValueError):
        model(input_ids=ids, past_states=states)
    hsc.enable(model)
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=ids, past_states=states).logits, reference(input_ids=ids, past_states=states).logits
        )
    generated = model.generate(ids, past_states=states, max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, reference.generate(ids, past_states=states, max_new_tokens=3, do_sample=False))
    hsc.disable(model)
    with pytest.raises(ValueError, match="or was disabled"):
        model(input_ids=ids, past_states=states)


@pytest.mark.parametrize("order", ["transformers first", "hf_statecompose first"])
def test_the_guard_and_the_lm_eval_model_whatever_the_import_order(order):
    pytest.importorskip("lm_eval")
    imports = ["import hf_statecompose", "from transformers import MambaForCausalLM, Mamba2Model"]
    out = run_python(f"""
        {imports[0] if order == "hf_statecompose first" else imports[1]}
        {imports[1] if order == "hf_statecompose first" else imports[0]}
        from lm_eval.api.registry import get_model
        print(MambaForCausalLM.forward._hf_statecompose_guard, Mamba2Model.forward._hf_statecompose_guard)
        print(get_model("statecompose").__name__, get_model("hf").__name__)
    """)
    assert out.split("\n")[:2] == ["True True", "StateComposeLM HFLM"]


# ---------------------------------------------------------------------------- the post-import hook
def test_when_imported_runs_after_the_module_or_at_once(tmp_path, monkeypatch, caplog):
    (tmp_path / "hsc_probe_a.py").write_text("VALUE = 41\n")
    (tmp_path / "hsc_probe_b.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    _guard.when_imported("hsc_probe_a", lambda module: seen.append(module.VALUE + 1))
    assert seen == []  # not imported yet: nothing runs
    import hsc_probe_a

    assert seen == [42]  # right after its code ran
    assert "exec_module" not in vars(hsc_probe_a.__loader__)  # the module's loader is left as it was
    _guard.when_imported("hsc_probe_a", lambda module: seen.append("again"))
    assert seen == [42, "again"]  # already imported: at once

    def broken(module):
        raise RuntimeError("boom")

    _guard.when_imported("hsc_probe_b", broken)
    import hsc_probe_b

    assert hsc_probe_b.VALUE == 1 and "boom" in caplog.text  # a failing hook never breaks the import
    for name in ("hsc_probe_a", "hsc_probe_b"):
        monkeypatch.delitem(sys.modules, name)
