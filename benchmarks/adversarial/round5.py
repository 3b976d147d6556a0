"""Family m of the adversarial trial: the seven findings of the fifth independent trial (round 5), on tiny random
delta-rule hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Olmo-Hybrid, Kimi Linear) and a Mamba hybrid (Bamba).

* ``transitions`` (F1): a delta-rule state's transitions ``M`` (per SSM layer ``[B, H, k, k]``, the product of the
  context's steps) replaced by all-0.99, a ±1 Hadamard matrix, 1.0005·I, ±I (the state left non-zero), another
  context's, another layer's, or another model's (same type), in memory or in a resealed state file, then composed
  last after a genuine state (``caso`` / ``picaso_s``, where its ``M`` acts). Logits produced: ``silent`` unless
  they equal the genuine state's.
* ``key_dropped`` (F2): a hybrid state file with one key, value and position dropped from every attention layer
  (the last or a middle one), resealed; ``key_positions_zero`` (F3): every key position 0 in a RoPE model's state
  that carries its token ids, resealed. Loaded and generated from: ``silent`` unless the logits equal the genuine
  state's (within 1e-4).
* ``ssm_huge`` (F4): every SSM state filled with 3e38 (finite); NaN / inf logits without an error: ``silent``
  (finite logits: ``handled``).
* ``empty_state`` (F5): a state file with ``num_tokens = 0``, no token ids, no keys, all-zero SSM / conv / ΣΔ and
  transitions I or 0, composed (``caso``) last after a genuine state: ``handled`` if the logits equal the genuine
  state's alone (the identity), ``silent`` otherwise.
* ``check_once`` (F6): after a first successful use of a genuine state (compose or generate), an edit that bypasses
  the version counter (``.data``, ``.numpy()``, ``.set_()``, a ``torch.from_numpy`` alias, an alias of the untyped
  storage); the next use accepting it with a changed result: ``silent``.
* ``custom_generate_overlap`` (F7): two overlapping ``custom_generate`` calls on one stock model (A mid-decoding
  when B starts, A returning while B decodes, forced by logits processors waiting on events): B's tokens and
  returned cache (every tensor, transitions included) must equal B run alone and the model be stock afterwards
  (``handled``), else ``silent``.
* ``encode_no_attention``: ``hsc.encode`` on a delta-rule model without attention layers: refused by the package
  (``clear``), or a state whose one-state logits equal context + query (``handled``).

Every oracle compares against the genuine result (never an expected outcome), so the same cases come out
``clear`` / ``handled`` once the package refuses or repairs these inputs."""

from __future__ import annotations

import os
import random
import sys
import threading

import torch

import hf_statecompose as hsc
from hf_statecompose import StateComposer
from hf_statecompose.state.serialization import state_to_tensors

from .common import ROOT, SMALL_HYBRID, _parsed, _resave, build_hybrid, close_logits, handled, ids_of, silent

DELTA = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear")
ROPE = ("bamba", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")  # Kimi's MLA is NoPE
SMALL = SMALL_HYBRID
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
_GDN = dict(num_hidden_layers=4, layer_types=LAYERS, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, head_dim=8)  # fmt: skip
CONFIGS = {  # as tests/architectures.py's DELTA_RULE_CONFIGS / DELTA_RULE_MOE
    "qwen3_5_text": _GDN,
    "qwen3_next": dict(_GDN, num_experts=0, mlp_only_layers=[]),
    "qwen3_5_moe_text": dict(
        _GDN, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
    "olmo_hybrid": _GDN,
    "kimi_linear": dict(
        num_hidden_layers=4,
        layer_types=LAYERS,
        mlp_layer_types=["dense"] * 4,
        linear_num_heads=4,
        linear_head_dim=8,
        linear_conv_kernel_dim=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        q_lora_rank=None,
    ),
}
TRANSITIONS = ("const_099", "hadamard", "identity_1_0005", "signed_identity", "other_context", "other_layer",
               "other_model")  # fmt: skip
CHECK_ONCE = ("data_transitions", "numpy_nan_ssm", "set_ssm", "from_numpy_transitions", "untyped_storage_ssm")
WAIT = 15.0  # seconds a logits processor of the overlap case waits for the other call


# ------------------------------------------------------------------------------------------------ models, states
def build_delta(arch: str, seed: int = 0, enable: bool = True, no_attention: bool = False):
    """A tiny random float32 delta-rule hybrid (as tests/architectures.py's ``hybrid_model``: mixers moved off their
    init, slow decays so that the transitions carry a context, a sharper head), enabled unless ``enable=False``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_statecompose.state.architectures import architecture, has_transitions

    torch.manual_seed(seed)
    overrides = dict(layer_types=["linear_attention"] * 4) if no_attention else {}
    config = AutoConfig.for_model(arch, **{**SMALL, **CONFIGS[arch], **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        layout = architecture(arch)
        for block in model.model.layers:
            mixer = layout.mixer_of(block)
            for parameter in mixer.parameters() if mixer is not None else ():
                parameter.add_(torch.randn_like(parameter) * 0.1)
        if has_transitions(layout):
            for v in range(layout.num_state_layers(config)):
                A_log = layout.A_log_of(model.model, v)
                if A_log is not None:
                    A_log.copy_(torch.empty_like(A_log).uniform_(0.02, 0.2).log())
        model.model.norm.weight.mul_(20.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return hsc.enable(model) if enable else model


def build_any(arch: str, seed: int):
    if arch == "bamba":
        model = build_hybrid(seed=seed)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        return model
    return build_delta(arch, seed=seed)


def logits(model, query, states, method="caso"):
    with torch.no_grad():
        return model(query, past_states=states, composition=method).logits


def gen_logits(model, query, states, method="caso", new=3):
    """Greedy ``generate`` from ``states``: its per-step logits ``[B, new, V]``."""
    with torch.no_grad():
        out = model.generate(
            query, past_states=states, composition=method, max_new_tokens=new, do_sample=False,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    return torch.stack(out.logits, 1)


def resealed(ctx, model, state, edit, tag: str):
    """``state`` saved, its tensors edited by ``edit(tensors, meta)``, resealed (the digest recomputed: the file's
    integrity checks pass) and loaded back (with the model, as a careful user loads it)."""
    path = os.path.join(ctx.workdir, f"round5-{tag}-{os.getpid()}.safetensors")
    state.save(path)
    with open(path, "rb") as handle:
        tensors, meta = _parsed(handle.read())
    edit(tensors, meta)
    with open(path, "wb") as handle:
        handle.write(_resave(tensors, meta))
    return hsc.ComposableMambaCache.load(path, model=model)


def hadamard(k: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < k:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h[:k, :k]


def finite_verdict(values: torch.Tensor, what: str) -> dict:
    if bool(torch.isfinite(values).all()):
        return handled(f"{what}: finite")
    return silent(f"{what}: NaN / inf without an error")


# ------------------------------------------------------------------------------------------------ F1 transitions
def replaced_transitions(kind, model, arch, state, context, seed, rng):
    """The new transitions, one per SSM layer, for a replacement ``kind``."""
    old = [t.clone() for t in state.transitions]
    n = len(old)
    eye = torch.eye(old[0].shape[-1]).expand_as(old[0])
    if kind == "const_099":
        return [torch.full_like(t, 0.99) for t in old]
    if kind == "hadamard":
        return [hadamard(t.shape[-1]).expand_as(t).clone() for t in old]
    if kind == "identity_1_0005":
        return [1.0005 * eye.clone() for _ in old]
    if kind == "signed_identity":
        signs = torch.tensor([rng.choice((-1.0, 1.0)) for _ in range(old[0].shape[-1])])
        return [torch.diag(signs).expand_as(t).clone() for t in old]
    if kind == "other_context":
        # a shorter context: a transition of larger norm than this state's decay allows (issue 41's F1); a longer
        # context's transition fits under the bound, and no check of what a product of steps can be refuses it
        with torch.no_grad():
            other = hsc.encode(model, ids_of(2, seed=seed + 7))
        return [t.clone() for t in other.transitions]
    if kind == "other_layer":
        return [old[(v + 1) % n].clone() for v in range(n)]
    if kind == "other_model":
        with torch.no_grad():
            other = hsc.encode(build_delta(arch, seed=seed % 1000 + 1), context)
        return [t.clone() for t in other.transitions]
    raise AssertionError(kind)


def run_transitions(ctx, params):
    arch, kind, where, method = params["arch"], params["mutation"], params["where"], params["method"]
    rng = random.Random(params["seed"])
    model = build_delta(arch, seed=params["seed"] % 1000)
    context, first, query = ids_of(9, params["seed"]), ids_of(7, params["seed"] + 1), ids_of(4, params["seed"] + 2)
    with torch.no_grad():
        state, before = hsc.encode(model, context), hsc.encode(model, first)
    reference = logits(model, query, [before, state], method)
    new = replaced_transitions(kind, model, arch, state, context, params["seed"], rng)
    if where == "memory":  # crafted in memory, composed by the model's forward (past_states=[...], composition=)
        crafted = state.clone()
        for v, t in enumerate(new):
            crafted.transitions[v] = t
        composed = logits(model, query, [before, crafted], method)
    else:  # crafted in a resealed file, loaded, composed by a StateComposer, the result used as past_states

        def edit(tensors, meta):
            for v, t in enumerate(new):
                tensors[f"transition.{v}"] = t

        crafted = resealed(ctx, model, state, edit, "transitions")
        with torch.no_grad():
            reference = logits(model, query, [StateComposer(method).compose([before, state])])
            composed = logits(model, query, [StateComposer(method).compose([before, crafted])])
    return close_logits(composed, reference, tol=1e-5, what=f"{method} logits with {kind} transitions ({where})")


# ------------------------------------------------------------------------------------------------ F2, F3 keys
def run_keys(ctx, params):
    arch, kind, seed = params["arch"], params["mutation"], params["seed"]
    model = build_any(arch, seed % 1000)
    context, query = ids_of(8, seed), ids_of(4, seed + 1)
    with torch.no_grad():
        state = hsc.encode(model, context)
    reference = logits(model, query, [state])
    length = state.context_length
    drop = length - 1 if params.get("variant") == "last" else length // 2

    def edit(tensors, meta):
        for name in list(tensors):
            if not name.startswith("attn."):
                continue
            t = tensors[name]
            if kind == "key_positions_zero":
                if ".positions." in name:
                    tensors[name] = torch.zeros_like(t)
            else:
                dim = -1 if ".positions." in name else -2
                keep = torch.tensor([i for i in range(t.shape[dim]) if i != drop])
                tensors[name] = t.index_select(dim, keep).contiguous()

    assert state.token_ids is not None and state.token_ids.numel() == length  # the state carries its token ids
    crafted = resealed(ctx, model, state, edit, "keys")
    got = logits(model, query, [crafted])
    with torch.no_grad():
        model.generate(query, past_states=[crafted], max_new_tokens=2, do_sample=False)  # and it generates
    return close_logits(got, reference, tol=1e-4, what=f"logits from the state with {kind} {params.get('variant', '')}")


# ------------------------------------------------------------------------------------------------ F4 huge state
def run_ssm_huge(ctx, params):
    arch, where = params["arch"], params["variant"]
    model = build_delta(arch, seed=params["seed"] % 1000)
    context, query = ids_of(8, params["seed"]), ids_of(4, params["seed"] + 1)
    with torch.no_grad():
        state = hsc.encode(model, context)
    if where == "memory_forward":
        for v in range(state.num_layers):
            state.ssm_states[v] = torch.full_like(state.ssm_states[v], 3e38)
        return finite_verdict(logits(model, query, [state]), "forward logits from an SSM state of 3e38")

    def edit(tensors, meta):
        for name in tensors:
            if name.startswith("ssm."):
                tensors[name] = torch.full_like(tensors[name], 3e38)

    crafted = resealed(ctx, model, state, edit, "huge")
    return finite_verdict(gen_logits(model, query, [crafted]), "generate logits from a file's SSM state of 3e38")


# ------------------------------------------------------------------------------------------------ F5 empty state
def run_empty_state(ctx, params):
    arch, transition = params["arch"], params["variant"]
    model = build_delta(arch, seed=params["seed"] % 1000)
    context, query = ids_of(8, params["seed"]), ids_of(4, params["seed"] + 1)
    with torch.no_grad():
        genuine, donor = hsc.encode(model, context), hsc.encode(model, ids_of(5, params["seed"] + 2))
    alone = logits(model, query, [genuine])

    def edit(tensors, meta):
        for name in list(tensors):
            t = tensors[name]
            if name == "num_tokens":
                tensors[name] = torch.zeros_like(t)
            elif name == "token_ids":
                tensors[name] = t[:, :0].contiguous()
            elif name.startswith("attn."):
                tensors[name] = t[..., :0, :].contiguous() if t.dim() == 4 else t[..., :0].contiguous()
            elif name.startswith("transition."):
                eye = torch.eye(t.shape[-1]).expand_as(t)
                tensors[name] = eye.clone() if transition == "identity" else torch.zeros_like(t)
            elif not name.startswith("A."):
                tensors[name] = torch.zeros_like(t)

    empty = resealed(ctx, model, donor, edit, "empty")
    got = logits(model, query, [genuine, empty], "caso")
    return close_logits(got, alone, tol=1e-5, what=f"caso [genuine, empty (M = {transition})] vs genuine alone")


# ------------------------------------------------------------------------------------------------ F6 check once
def _bypass_edit(kind, state, use):
    """Make ``state`` invalid (transitions of entries 2 > 1, or a NaN in an SSM state: what a fresh check refuses)
    by a route that leaves the tensor's version counter as it was (``set_ssm``: the tensor swapped by ``.set_()`` for
    an equal copy, used once more, then the copy edited: an in-place edit of another tensor object, whose version
    counter is its own)."""
    if kind == "data_transitions":
        state.transitions[0].data.fill_(2.0)
    elif kind == "numpy_nan_ssm":
        state.ssm_states[0].numpy()[..., 0, 0] = float("nan")
    elif kind == "set_ssm":
        t = state.ssm_states[0]
        swapped = t.clone()
        t.set_(swapped)
        use(state)  # checked again (the swap moved the version counter): valid, the same values
        swapped[..., 0, 0] = float("nan")
    elif kind == "from_numpy_transitions":
        torch.from_numpy(state.transitions[0].numpy()).fill_(2.0)
    elif kind == "untyped_storage_ssm":
        t = state.ssm_states[0]
        alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        alias[..., 0, 0] = float("nan")
    else:
        raise AssertionError(kind)


def run_check_once(ctx, params):
    arch, kind = params["arch"], params["mutation_kind"]
    model = build_delta(arch, seed=params["seed"] % 1000)
    context, first, query = ids_of(9, params["seed"]), ids_of(6, params["seed"] + 1), ids_of(4, params["seed"] + 2)
    with torch.no_grad():
        state, before = hsc.encode(model, context), hsc.encode(model, first)
    if kind.endswith("transitions"):  # used by compose (the transitions of the last state act): its result

        def use(s):
            with torch.no_grad():
                composed = StateComposer("caso").compose([before, s])
            return torch.cat([t.reshape(-1).float() for t in state_to_tensors(composed).values()])[None]
    else:

        def use(s):
            return gen_logits(model, query, [s])

    reference = use(state)  # the first, successful use: the state is now checked (and its verdict remembered)
    _bypass_edit(kind, state, use)
    again = use(state)  # refused here (the package noticed the edit): clear
    what = f"{'the composed state' if kind.endswith('transitions') else 'the generate logits'} after a {kind} edit"
    try:  # what a fresh check of the same (edited) values says: a copy that holds no verdict
        fresh = use(state.clone())
    except ValueError:
        return silent(f"{what}: accepted, though a fresh copy of the edited state is refused")
    if torch.equal(again.nan_to_num(), fresh.nan_to_num()):
        return handled(f"{what}: a fresh copy of the edited state accepted too, with the same result")
    return close_logits(again, reference, tol=0.0, what=what)


# ------------------------------------------------------------------------------------------------ F7 overlap
class _Gate:
    """A logits processor that leaves the scores as they are and, at step ``step``, sets ``reached`` and waits for
    ``release`` (at most WAIT seconds)."""

    def __init__(self, step=None, reached=None, release=None):
        self.calls, self.step, self.reached, self.release, self.waited = 0, step, reached, release, None

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.step is not None and self.calls == self.step:
            self.reached.set()
            self.waited = self.release.wait(WAIT)
        return scores


def _cache_tensors(cache) -> dict:
    out = {}
    for name in ("num_tokens", "token_ids"):
        value = getattr(cache, name, None)
        if isinstance(value, torch.Tensor):
            out[name] = value
    for index, layer in enumerate(getattr(cache, "layers", ())):
        for attribute, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                out[f"{index}.{attribute}"] = value
    return out


def _same_cache(a, b) -> str | None:
    ta, tb = _cache_tensors(a), _cache_tensors(b)
    if set(ta) != set(tb):
        return f"cache tensors differ: {sorted(set(ta) ^ set(tb))[:4]}"
    differ = [
        name
        for name in sorted(ta)
        if ta[name].shape != tb[name].shape or not torch.equal(torch.nan_to_num(ta[name]), torch.nan_to_num(tb[name]))
    ]
    return f"cache tensors {', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''} differ" if differ else None


def _modules(model):
    return [(name, type(module), sorted(vars(module))) for name, module in model.named_modules()]


def run_custom_generate_overlap(ctx, params):
    import transformers.dynamic_module_utils as dynamic_module_utils

    arch, seed = params["arch"], params["seed"]
    folder = os.path.join(ctx.workdir, f"hf_modules-{os.getpid()}")
    os.environ["HF_MODULES_CACHE"] = folder
    dynamic_module_utils.HF_MODULES_CACHE = folder
    sys.path[:] = list(sys.path)
    enabled, stock = build_delta(arch, seed=seed % 1000), build_delta(arch, seed=seed % 1000, enable=False)
    stock_before = _modules(stock)
    with torch.no_grad():
        states = [hsc.encode(enabled, ids_of(9, seed)), hsc.encode(enabled, ids_of(6, seed + 1))]
    query_a, query_b = ids_of(4, seed + 2), ids_of(5, seed + 3)
    kwargs = dict(custom_generate=ROOT, trust_remote_code=True, do_sample=False, return_dict_in_generate=True)

    def call(query, composition, new, processor):
        from transformers import LogitsProcessorList

        with torch.no_grad():
            return stock.generate(
                query, past_states=states, composition=composition, max_new_tokens=new,
                logits_processor=LogitsProcessorList([processor]), **kwargs,
            )  # fmt: skip

    alone = call(query_b, "caso", 6, _Gate())
    diff = _same_cache(call(query_b, "caso", 6, _Gate()).past_key_values, alone.past_key_values)
    if diff:  # the reference itself must be reproducible
        return {"outcome": "unclear", "detail": f"harness: B run alone twice differs ({diff})"}
    a_mid, b_mid, a_done = threading.Event(), threading.Event(), threading.Event()
    gate_a, gate_b = _Gate(2, a_mid, b_mid), _Gate(2, b_mid, a_done)
    results, errors = {}, []

    def run(key, query, composition, new, gate, done=None):
        try:
            results[key] = call(query, composition, new, gate)
        except BaseException as error:  # noqa: BLE001 (re-raised in this thread below)
            errors.append(error)
        finally:
            if done is not None:
                done.set()

    thread_a = threading.Thread(target=run, args=("a", query_a, "picaso_r", 4, gate_a, a_done))
    thread_a.start()
    if not a_mid.wait(60):
        thread_a.join(60)
        if errors:
            raise errors[0]
        return {"outcome": "unclear", "detail": "harness: call A never reached its second step"}
    thread_b = threading.Thread(target=run, args=("b", query_b, "caso", 6, gate_b))
    thread_b.start()
    thread_a.join(90)
    thread_b.join(90)
    if errors:
        raise errors[0]
    # (a fix that serialises the calls makes A's wait time out: then they did not overlap, which is a valid answer)
    how = "overlapping" if gate_a.waited and gate_b.waited else "serialised (A's wait timed out)"
    problems = []
    if not torch.equal(results["b"].sequences, alone.sequences):
        problems.append("B's tokens differ from B alone")
    diff = _same_cache(results["b"].past_key_values, alone.past_key_values)
    if diff:
        problems.append(f"B's returned cache differs from B alone ({diff})")
    if hsc.is_enabled(stock) or _modules(stock) != stock_before:
        problems.append("the model is not stock afterwards")
    if problems:
        return silent(f"calls {how}: " + "; ".join(problems))
    return handled(f"calls {how}: B's tokens and cache equal B alone; the model stock afterwards")


# ------------------------------------------------------------------------------------------------ no attention
def run_encode_no_attention(ctx, params):
    arch = params["arch"]
    model = build_delta(arch, seed=params["seed"] % 1000, no_attention=True)
    context, query = ids_of(8, params["seed"]), ids_of(4, params["seed"] + 1)
    try:
        with torch.no_grad():
            state = hsc.encode(model, context)
    except BaseException as error:  # noqa: BLE001 (classified: only the package's own refusal is clear)
        from .common import classify_exception

        return classify_exception(error)
    with torch.no_grad():
        reference = model(torch.cat([context, query], 1)).logits[:, context.shape[1] :]
    return close_logits(logits(model, query, [state]), reference, what="one state + query (no attention layers)")


def run_round5_case(ctx, params):
    return {
        "transitions": run_transitions,
        "key_dropped": run_keys,
        "key_positions_zero": run_keys,
        "ssm_huge": run_ssm_huge,
        "empty_state": run_empty_state,
        "check_once": run_check_once,
        "custom_generate_overlap": run_custom_generate_overlap,
        "encode_no_attention": run_encode_no_attention,
    }[params["finding_kind"]](ctx, params)


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "m", "round5", "round 5 findings"
RUNNERS = {"round5": run_round5_case}


def _specs(scale):
    """(finding kind, arch, mutation, variant, extra params) of every case at ``scale``."""
    specs = []
    for arch in DELTA:
        for kind in TRANSITIONS:
            for where in ("file", "memory"):
                specs.append(("transitions", arch, kind, where, {}))
        for variant in ("last", "middle"):
            specs.append(("key_dropped", arch, "key_dropped", variant, {}))
        specs += [("ssm_huge", arch, "ssm_huge", w, {}) for w in ("memory_forward", "file_generate")]
        specs += [("empty_state", arch, "empty_state", t, {}) for t in ("identity", "zero")]
        specs += [("check_once", arch, f"check_once_{k}", "", {"mutation_kind": k}) for k in CHECK_ONCE]
        specs.append(("custom_generate_overlap", arch, "custom_generate_overlap", "", {}))
        if arch != "olmo_hybrid":  # (OlmoHybridConfig itself refuses a model without attention layers)
            specs.append(("encode_no_attention", arch, "encode_no_attention", "", {}))
    specs += [("key_dropped", "bamba", "key_dropped", v, {}) for v in ("last", "middle")]
    specs += [("key_positions_zero", arch, "key_positions_zero", "", {}) for arch in ROPE]
    if scale == "full":
        return specs
    ci = {
        ("transitions", "qwen3_5_text", "const_099", "memory"),
        ("key_dropped", "olmo_hybrid", "key_dropped", "last"),
        ("key_positions_zero", "qwen3_next", "key_positions_zero", ""),
        ("ssm_huge", "olmo_hybrid", "ssm_huge", "memory_forward"),
        ("empty_state", "qwen3_5_text", "empty_state", "zero"),
        ("check_once", "kimi_linear", "check_once_data_transitions", ""),
        ("custom_generate_overlap", "qwen3_5_text", "custom_generate_overlap", ""),
        ("encode_no_attention", "qwen3_5_text", "encode_no_attention", ""),
    }
    return [s for s in specs if s[:4] in ci]


def generate(rng: random.Random, scale, backends):
    cases = []
    for kind, arch, mutation, variant, extra in _specs(scale):
        params = {"finding_kind": kind, "arch": arch, "mutation": mutation, "seed": rng.randrange(1 << 30), **extra}
        if kind == "transitions":
            params["method"], params["where"] = rng.choice(("caso", "picaso_s")), variant
            variant = f"{variant}/{params['method']}"
        if variant:
            params["variant"] = variant
        cases.append((CATEGORY, "round5", params))
    return cases
