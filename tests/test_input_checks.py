"""Input checks at the boundary: contexts and queries whose padding cannot be told from tokens without a mask are
refused (never a silently wrong state); tokenizer outputs are taken whole; bad ids, types and shapes are refused
with one clear error; never-enabled SeRpEnt / COFFEE refuse past_states in generate as stock Mamba does."""

import pytest
import torch
from transformers import BatchEncoding

import hf_statecompose as hsc

from helpers import VOCAB, random_ids, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("mamba2")  # pad 0, eos 1, bos 2: a pad token of its own


@pytest.fixture(scope="module")
def shared_pad_model():
    """pad = eos = 0 (as the demo tokenizer and GPT-NeoX Mamba checkpoints have it)."""
    model = tiny_model("mamba")
    model.config.pad_token_id = model.config.eos_token_id = 0
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = 0
    return model


def left_padded(rows, pad=0):
    """Rows of different lengths, left padded with ``pad``; and their mask."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :] = r
        mask[i, length - len(r) :] = 1
    return ids, mask


def same_state(a, b):
    close = all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a.ssm_states, b.ssm_states))
    return close and torch.equal(a.num_tokens, b.num_tokens)


# ------------------------------------------------------------------------------------------ encode: unmasked padding
@pytest.mark.parametrize("fixture", ["model", "shared_pad_model"])
def test_encode_refuses_a_left_padded_batch_without_its_mask(fixture, request):
    model = request.getfixturevalue(fixture)
    ids, mask = left_padded([random_ids(6)[0], random_ids(3)[0]])
    with pytest.raises(ValueError, match=r"pad token id 0.*no attention_mask was given.*attention_mask"):
        hsc.encode(model, ids)
    state = hsc.encode(model, ids, attention_mask=mask)  # with the mask: each row as encoded alone
    assert same_state(state.select([1]), hsc.encode(model, ids[1:, 3:]))


def test_encode_refuses_a_right_padded_batch_without_its_mask(shared_pad_model):
    ids = torch.cat([random_ids(5), torch.cat([random_ids(3), torch.zeros(1, 2, dtype=torch.long)], 1)])
    with pytest.raises(ValueError, match=r"look right padded.*padding_side = 'left'"):
        hsc.encode(shared_pad_model, ids)


def test_encode_without_mask_keeps_unpadded_contexts(shared_pad_model, model):
    """Batches whose rows start and end alike (or a single context) are not padding; nor is anything when the
    config has no pad token; an explicit all-ones mask says a pad id is a real token."""
    ids = random_ids(6, batch=2)
    hsc.encode(model, ids)
    eos_at_end = torch.cat([random_ids(5, batch=2), torch.zeros(2, 1, dtype=torch.long)], 1)  # pad = eos = 0
    hsc.encode(shared_pad_model, eos_at_end)
    hsc.encode(shared_pad_model, eos_at_end[:1])
    with_pad = torch.cat([random_ids(4), torch.zeros(1, 1, dtype=torch.long), random_ids(2)], 1)
    with pytest.raises(ValueError, match=r"row 0 contains the pad token id 0.*torch.ones_like"):
        hsc.encode(model, with_pad)
    hsc.encode(model, with_pad, attention_mask=torch.ones_like(with_pad))
    no_pad = tiny_model("mamba2")
    no_pad.config.pad_token_id = None
    hsc.encode(no_pad, with_pad)


# ------------------------------------------------------------------------------------------ generate: pad == eos
def test_generate_refuses_a_right_padded_query_without_mask_when_pad_is_eos(shared_pad_model):
    model = shared_pad_model
    state = hsc.encode(model, random_ids(6))
    query = torch.cat([random_ids(3), torch.zeros(1, 2, dtype=torch.long)], 1)  # real tokens, then pad = eos
    with pytest.raises(ValueError, match=r"query row 0 ends with token 0, which is both pad_token_id and eos_token_id"):
        model.generate(query, past_states=[state], max_new_tokens=2, do_sample=False)
    batch = torch.cat([random_ids(5), query])
    with pytest.raises(ValueError, match=r"query row 1 ends with token 0"):
        model.generate(batch, past_states=[state], max_new_tokens=2, do_sample=False)


def test_generate_refuses_a_left_padded_query_without_mask_when_pad_is_eos(shared_pad_model):
    model = shared_pad_model
    state = hsc.encode(model, random_ids(6))
    ids, mask = left_padded([random_ids(5)[0], random_ids(3)[0]])
    with pytest.raises(ValueError, match=r"looks left padded.*Pass attention_mask"):
        model.generate(ids, past_states=[state], max_new_tokens=2, do_sample=False)
    out = model.generate(ids, attention_mask=mask, past_states=[state], max_new_tokens=2, do_sample=False)
    alone = model.generate(ids[1:, 2:], past_states=[state], max_new_tokens=2, do_sample=False)
    assert torch.equal(out[1, -2:], alone[0, -2:])


def test_generate_keeps_legitimate_queries_when_pad_is_eos(shared_pad_model):
    model = shared_pad_model
    state = hsc.encode(model, random_ids(6))
    query = random_ids(4, batch=2)  # all real tokens
    out = model.generate(query, past_states=[state], max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)
    bos_only = torch.zeros(1, 1, dtype=torch.long)  # a query of just the bos / eos token (= pad)
    out = model.generate(bos_only, past_states=[state], max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert out.shape == (1, 3)


# ------------------------------------------------------------------------------------------ encode: what it takes
def test_encode_takes_a_tokenizer_output_with_its_mask(model):
    ids, mask = left_padded([random_ids(6)[0], random_ids(3)[0]])
    expected = hsc.encode(model, ids, attention_mask=mask)
    batch = BatchEncoding({"input_ids": ids, "attention_mask": mask})
    for state in (hsc.encode(model, batch), hsc.encode(model, **batch), hsc.encode(model, dict(batch))):
        assert same_state(state, expected) and torch.equal(state.token_ids, expected.token_ids)
    with pytest.raises(ValueError, match="attention_mask came twice"):
        hsc.encode(model, batch, attention_mask=mask)
    with pytest.raises(TypeError, match=r"without 'input_ids'"):
        hsc.encode(model, {"attention_mask": mask})
    with pytest.raises(TypeError, match=r"got list \(return_tensors='pt' makes the tokenizer give tensors\)"):
        hsc.encode(model, BatchEncoding({"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 1]]}))


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (
            "Velmo founded 1880.",
            TypeError,
            r"got str; tokenize first: hsc\.encode\(model, tok\(texts, return_tensors='pt'\)\)",
        ),
        ([[5, 6, 7]], TypeError, r"got list \(return_tensors='pt'"),
        (None, TypeError, r"got NoneType; tokenize first"),
        (torch.tensor([[5.0, 6.0]]), TypeError, r"integer token ids \(torch\.long\), got a torch\.float32 tensor"),
        (torch.tensor([[5, -1, 6]]), ValueError, r"id -1, outside the model's vocabulary \[0, 99\)"),
        (torch.tensor([[5, VOCAB, 6]]), ValueError, r"id 99, outside the model's vocabulary \[0, 99\)"),
        (torch.zeros((0, 4), dtype=torch.long), ValueError, r"no rows \(shape \(0, 4\)\): pass at least one context"),
    ],
)
def test_encode_refuses_what_is_not_token_ids(model, bad, error, match):
    with pytest.raises(error, match=match):
        hsc.encode(model, bad)
    with pytest.raises(error, match=match):
        hsc.ComposableMambaCache.encode(model, bad)


# ------------------------------------------------------------------------------------------ never-enabled own models
def _serpent():
    torch.manual_seed(0)
    config = hsc.SeRpEntMambaConfig(
        vocab_size=VOCAB,
        hidden_size=24,
        num_hidden_layers=1,
        state_size=4,
        resample_window=2,
        num_gaussians=2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return hsc.SeRpEntMambaForCausalLM(config).eval()


def _coffee():
    torch.manual_seed(0)
    config = hsc.CoffeeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        state_size=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return hsc.CoffeeForCausalLM(config).eval()


def _stock_refusal(method):
    """The message a never-enabled stock Mamba gives, with its class name."""
    from transformers import MambaConfig, MambaForCausalLM

    stock = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1)).eval()
    state = hsc.encode(tiny_model("mamba"), random_ids(3))
    with pytest.raises(ValueError) as caught:
        getattr(stock, method)(
            random_ids(2), past_states=[state], **({"max_new_tokens": 1} if method == "generate" else {})
        )
    return str(caught.value).replace("MambaForCausalLM", "{cls}")


@pytest.mark.parametrize("make", [_serpent, _coffee], ids=["serpent", "coffee"])
@pytest.mark.parametrize("method", ["generate", "forward"])
def test_never_enabled_own_models_refuse_past_states_as_stock_mamba_does(make, method):
    model = make()
    state = hsc.encode(model, random_ids(4))
    assert not hsc.is_enabled(model)
    kwargs = {"max_new_tokens": 1, "do_sample": False} if method == "generate" else {}
    with pytest.raises(ValueError, match=r"past_states needs hf_statecompose\.enable\(model\) first") as caught:
        getattr(model, method)(random_ids(2), past_states=[state], **kwargs)
    assert str(caught.value) == _stock_refusal(method).format(cls=type(model).__name__)
    hsc.enable(model)
    assert getattr(model, method)(random_ids(2), past_states=[state], **kwargs) is not None


# ------------------------------------------------------------------------------------------ inputs_embeds width
@pytest.mark.parametrize("method", ["forward", "generate"])
def test_inputs_embeds_of_the_wrong_width_are_refused_with_past_states(model, method):
    state = hsc.encode(model, random_ids(5))
    embeds = torch.randn(1, 3, 31)  # the model's hidden size is 32
    kwargs = {"max_new_tokens": 1} if method == "generate" else {}
    with pytest.raises(ValueError, match=r"inputs_embeds have width 31, the model's embeddings 32"):
        getattr(model, method)(inputs_embeds=embeds, past_states=[state], **kwargs)
    ids = random_ids(3)
    with pytest.raises(ValueError, match=r"width 31"):
        getattr(model, method)(input_ids=ids, inputs_embeds=embeds, past_states=[state], **kwargs)
    right = model.get_input_embeddings()(ids)
    with torch.no_grad():
        assert getattr(model, method)(inputs_embeds=right, past_states=[state], **kwargs) is not None


def test_training_encodes_contexts_holding_the_pad_id_as_tokens(model):
    """composition_loss builds its own batch and knows its padding: a context whose real tokens include the pad
    id is encoded (the mask always goes along), not refused as padding."""
    from hf_statecompose.training import encode_contexts

    with_pad = torch.cat([random_ids(3)[0], torch.zeros(1, dtype=torch.long), random_ids(2)[0]])
    other = random_ids(6)[0]
    states = encode_contexts(model, [with_pad, other], "bp2c")
    expected = hsc.encode(model, with_pad[None], attention_mask=torch.ones(1, 6, dtype=torch.long))
    assert same_state(states[0], expected)


def test_concat_baselines_encode_contexts_holding_the_pad_id_as_tokens(model):
    """concat / piconcat_r re-encode the states' own tokens: a pad id among them is a token, not padding."""
    with_pad = torch.cat([random_ids(3), torch.zeros(1, 1, dtype=torch.long), random_ids(2)], 1)
    states = [hsc.encode(model, with_pad, attention_mask=torch.ones_like(with_pad)), hsc.encode(model, random_ids(4))]
    for method in ("concat", "piconcat_r"):
        assert hsc.StateComposer(method).compose(states, model=model).num_tokens.tolist() == [10]


@pytest.mark.parametrize("method", ["forward", "generate"])
@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_query_ids_outside_the_vocabulary_are_refused_with_past_states(model, method, bad):
    state = hsc.encode(model, random_ids(6))
    query = random_ids(3)
    call = model.generate if method == "generate" else model
    extra = {"max_new_tokens": 2, "do_sample": False} if method == "generate" else {}
    call(input_ids=query, past_states=[state], **extra)  # the good query runs
    query[0, 1] = bad
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        call(input_ids=query, past_states=[state], **extra)


def test_save_and_load_paths_and_devices_get_clear_errors(model, tmp_path):
    state = hsc.encode(model, random_ids(6))
    with pytest.raises(IsADirectoryError, match="give a file name"):
        state.save(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        state.save(tmp_path / "missing" / "s.safetensors")
    state.save(tmp_path / "s.safetensors")
    with pytest.raises(TypeError, match="file path"):
        hsc.ComposableMambaCache.load(None)
    with pytest.raises(ValueError, match="not a torch device"):
        hsc.ComposableMambaCache.load(tmp_path / "s.safetensors", device="nope")
    with pytest.raises(TypeError, match="repeats must be an int"):
        state.repeat_interleave("2")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        state.repeat_interleave(0)
    assert state.repeat_interleave(2).batch_size == 2
