"""Model cards for the demo checkpoints, filled from the figures the training run measured."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAMES = {
    "mamba2": "Mamba-2",
    "mamba": "Mamba-1 (Mamba)",
    "hybrid": "hybrid Mamba-2 + attention (NemotronH)",
    "gdn": "gated DeltaNet + attention hybrid (Qwen3.5)",
}
CLASSES = {
    "mamba2": "Mamba2ForCausalLM",
    "mamba": "MambaForCausalLM",
    "hybrid": "NemotronHForCausalLM",
    "gdn": "Qwen3_5ForCausalLM",
}
LOAD_ARGS = {"mamba2": "", "mamba": 'arch="mamba"', "hybrid": '"hybrid"', "gdn": '"gdn"'}
TAGS = {"hybrid": "mamba, hybrid, state-space-model", "gdn": "gated-deltanet, linear-attention, qwen3_5_text"}


def render(summary: dict) -> str:
    arch = summary["arch"]
    s = summary
    return f"""---
license: cc-by-sa-4.0
library_name: transformers
pipeline_tag: text-generation
tags: [{TAGS.get(arch, f"mamba, {arch}, state-space-model")}, hf_statecompose, demo{", nemotron_h" if arch == "hybrid" else ""}]
---

# hf_statecompose demo {NAMES[arch]} ({s["parameters"] / 1e6:.2f}M parameters)

A tiny {NAMES[arch]} causal LM shipped inside `hf_statecompose` (`hsc.load_demo({LOAD_ARGS[arch]})`)
so that the state database, composition and evaluation run offline on a CPU. It is a **demo model**:
{_abilities(s)}
{_architecture(s)}
## Training
- Recipe: `python recipes/train_demo.py --arch {arch} {_budget(s)}{_hybrid_flags(s)}` ({s["steps"]} steps of
  {s["batch_size"]} × {s["seq_len"]} tokens = {s["tokens_seen"] / 1e6:.2f}M tokens, {s["train_seconds"] / 60:.1f} min on
  {s["device"]} with {s["threads"]} threads; AdamW, lr {s["lr"]}, warm-up + cosine; seed {s["seed"]}).
- Data: {_mix(s)}:
  - the training articles of the English Wikipedia excerpt shipped in the `gensim` wheel
    (`gensim/test/test_data/enwiki-latest-pages-articles1*.bz2`). Text © Wikipedia contributors,
    licensed [CC BY-SA 4.0](https://creativecommons.org/licenses/by-sa/4.0/); the held-out articles
    ({", ".join(s["held_out_articles"])}) were never trained on;
  - a synthetic multi-context fact-recall task (`hf_statecompose.demo.corpora`): 2–{s.get("max_towns", 8)} fictional towns with
    one fact each (terse records, `Gasol river Iron.`, two towns per passage), shuffled, then every
    fact asked back (`Gasol river` → ` Iron.`), the loss taken on the answers only (the facts are
    random: predicting them is noise). A fresh random world per example, so facts can only come from
    the context.
- Tokenizer: 4096-token byte-level BPE trained on the same training text (shared by the demo models).

## Measured at the end of training
| metric | value |
|---|---|
| mean training loss, last 50 steps | {s["final_train_loss_mean_last_50"]:.3f} |
| held-out Wikipedia loss (nats/token, {s["held_out_wikipedia_windows"]} windows of {s["seq_len"]} tokens, no context) | {s["held_out_wikipedia_loss"]:.3f} |
| recall accuracy, answer's passage in context (exact greedy answer, {s["recall_questions"]} questions) | {s["recall_accuracy_with_context"]:.1%} |
| recall accuracy, no context (chance-level guessing) | {s["recall_accuracy_no_context"]:.1%} |

{_evaluation(arch)}

## Licence and attribution
Trained on, and evaluated with, Wikipedia text under CC BY-SA 4.0; the weights are released under the
same licence. Architecture: transformers' `{CLASSES[arch]}`.
"""


def _budget(s: dict) -> str:
    """The run's length as its command gave it: ``--steps N`` (fixed) or ``--minutes M`` (steps from the speed)."""
    return f"--steps {s['steps_arg']}" if s.get("steps_arg") else f"--minutes {s['train_seconds'] / 60:.0f}"


def _mix(s: dict) -> str:
    """The data mixture, with the recall-only first phase where the run had one."""
    mix = "3/8 of each batch Wikipedia, 5/8 synthetic recall"
    if s.get("recall_only_steps"):
        start = s.get("recall_max_towns_start")
        towns = f" (at most {start} towns rising to {s.get('max_towns', 8)})" if start else ""
        mix = f"the first {s['recall_only_steps']} steps synthetic recall only{towns}, then " + mix
    return mix


def _abilities(s: dict) -> str:
    """What the model does with its context, from the run's recall figures (a model that did not learn recall says so)."""
    if s["recall_accuracy_with_context"] - s["recall_accuracy_no_context"] >= 0.25:
        return (
            "it writes Wikipedia-flavoured English and recalls facts from its context; it knows little and should\n"
            "not be used for anything but exercising and measuring the library."
        )
    return (
        "it writes Wikipedia-flavoured English but **has not learnt to recall facts from its context** (see below:\n"
        "its answers are no better with the passage than without), so it exercises the library's state path and\n"
        "composition on its architecture, not the quality of a composition; it knows little and should not be used\n"
        "for anything else."
    )


def _hybrid_flags(s: dict) -> str:
    if s["arch"] not in ("hybrid", "gdn"):
        return ""
    flags = f" --lr {s['lr']} --threads {s['threads']}"
    if s["arch"] == "gdn" and s.get("init_from"):
        flags += f" --init-from {s['init_from']}"
    if s["arch"] == "gdn" and s.get("gdn_init", "fla") != "fla":
        flags += f" --gdn-init {s['gdn_init']}"
    if s["arch"] == "gdn" and s.get("layer_types"):
        kinds = "".join("*" if t == "full_attention" else "G" for t in s["layer_types"])
        if kinds != "GGG*GGG":
            flags += f" --gdn-layers '{kinds}'"
    for key, default in (
        ("max_towns", 8),
        ("attn_init_std", 0.0),
        ("qk_init_std", None),
        ("attn_lr_mult", 1.0),
        ("freeze_ssm_steps", 0),
        ("intermediate_size", 256),
        ("recall_only_steps", 0),
        ("recall_max_towns_start", None),
        ("warmup", 30),
    ):
        if s.get(key, default) != default:
            flags += f" --{key.replace('_', '-')} {s[key]}"
    if s.get("induction_init"):
        flags += " --induction-init"
    return flags


def _evaluation(arch: str) -> str:
    """The composition figures measured on this checkpoint (from ``benchmarks/results/``), where they exist."""
    if arch == "gdn":
        return _gdn_evaluation()
    if arch == "hybrid":
        path = RESULTS / "eval_hybrid_demo_hybrid.json"
        if not path.exists():
            return (
                "Its evaluation with contexts (none / concatenated / composed states / SSM states only, on the demo\n"
                "questions) is `python recipes/eval_hybrid_demo.py`: `docs/experiments/hybrid-demo.md`."
            )
        d = json.loads(path.read_text())
        rows = [
            f"| {k} | "
            + " | ".join(
                f"{d['k'][k][c]['accuracy']:.1%} / {d['k'][k][c]['answer_loss']:.3f}"
                for c in ("none", "concat", "composed", "ssm_only")
            )
            + " |"
            for k in sorted(d["k"], key=int)
        ]
        return (
            "## Composition (`python recipes/eval_hybrid_demo.py`)\n"
            f"The {d['k'][next(iter(d['k']))]['none']['questions']} demo questions, each with k passages (the answer's and k − 1 others); "
            "exact greedy answers / answer loss (nats/token):\n\n"
            "| k | no context | concatenated text | composed states (PICASO-S) | SSM states only |\n|---|---:|---:|---:|---:|\n"
            + "\n".join(rows)
            + "\n\nThe attention layers add nothing here (composed = SSM states only; zeroing them changes "
            "nothing): see `docs/experiments/hybrid-demo.md` in the repository."
        )
    paths = [RESULTS / "eval" / f"picaso_eval_{arch}_{dataset}.json" for dataset in ("recall", "wikipedia")]
    if not all(path.exists() for path in paths):
        return (
            "The composition evaluation (losses for k = 0…10 retrieved contexts, every method) is in\n"
            "`docs/experiments/picaso.md` and `benchmarks/results/`."
        )
    methods = ("concat", "soup", "caso", "picaso_s", "picaso_r", "piconcat_r")
    rows = []
    for path in paths:
        d = json.loads(path.read_text())
        base = d["loss"]["baseline"][0]
        rows.append(
            f"| {d['dataset']} | {base:.3f} | "
            + " | ".join(f"{(d['loss'][m][-1] - base) / base:+.1%}" for m in methods)
            + " |"
        )
    return (
        "## Composition (`python -m hf_statecompose.demo.eval --all --queries 40`)\n"
        "The PICASO protocol: the top k = 10 retrieved contexts composed, most relevant last; the change of the\n"
        "continuation loss against no context (negative = better), 40 samples per dataset:\n\n"
        "| dataset | loss, no context | "
        + " | ".join(methods)
        + " |\n|---|---:|"
        + "---:|" * len(methods)
        + "\n"
        + "\n".join(rows)
        + "\n\nEvery k, the timings and what they mean: `docs/experiments/picaso.md` in the repository."
    )


def _adapter_composition(arch: str, name: str) -> str:
    """This adapter's continuation loss vs k against the base model (``recipes/compare_finetuned.py``), where measured."""
    path = RESULTS / "finetune" / f"finetune_{arch}.json"
    d = json.loads(path.read_text()) if path.exists() else {}
    if name not in d.get("variants", {}):
        return ""
    rows = []
    for dataset in d["variants"][name]:
        for variant in ("zero-shot", name):
            loss = d["variants"][variant][dataset]["loss"]
            rows.append(
                f"| {dataset} | {'base model' if variant == 'zero-shot' else 'with this adapter'} | {loss['baseline'][0]:.3f} | "
                + " / ".join(f"{loss['picaso_r'][k]:.3f}" for k in (1, 2, 5, 10))
                + " | "
                + " / ".join(f"{loss['concat'][k]:.3f}" for k in (2, 5, 10))
                + " |"
            )
    return (
        f"\n## Composition (`python recipes/compare_finetuned.py --arch {arch} --adapters adapters/{name}`)\n"
        f"Continuation loss (nats/token), {d['queries']} samples per dataset, retrieved contexts composed most relevant last:\n\n"
        "| dataset | model | no context | PICASO-R k=1 / 2 / 5 / 10 | Concat k=2 / 5 / 10 |\n|---|---|---:|---:|---:|\n"
        + "\n".join(rows)
        + "\n\nBoth objectives side by side and what this shows: `docs/experiments/bptc.md` in the repository.\n"
    )


def _gdn_evaluation() -> str:
    """The GDN demo's composition table (``recipes/eval_gdn_demo.py``'s JSON), where measured."""
    path = RESULTS / "eval_gdn_demo.json"
    if not path.exists():
        return (
            "Its evaluation with contexts (none / concatenated / soup / CASO / PICASO-S / PICASO-R, on the demo\n"
            "questions) is `python recipes/eval_gdn_demo.py`."
        )
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_gdn_demo", ROOT / "recipes" / "eval_gdn_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    d = json.loads(path.read_text())
    questions = d["k"][next(iter(d["k"]))]["none"]["questions"]
    return (
        "## Composition (`python recipes/eval_gdn_demo.py`)\n"
        f"The {questions} demo questions, each with k passages (the answer's and k − 1 others, each encoded alone "
        "and composed, or their texts concatenated before the query); exact greedy answers / answer loss "
        "(nats/token):\n\n" + module.wide_table(d) + "\n\n" + d.get("summary", "") + _gdn_reading(d)
    ).rstrip()


def _gdn_reading(d: dict) -> str:
    """What the table says, when the concatenated text brings no recall (accuracy within 25 points of none)."""
    per_k = d["k"].values()
    if max(r["concat"]["accuracy"] - r["none"]["accuracy"] for r in per_k) >= 0.25:
        return ""
    gap = min(r["none"]["answer_loss"] - r["concat"]["answer_loss"] for r in per_k)
    spread = max(abs(r[m]["answer_loss"] - r["concat"]["answer_loss"]) for r in per_k for m in d["methods"])
    return (
        "\n\n**This checkpoint has not learnt recall**: even the concatenated text leaves its answers at chance "
        f"(the context lowers the answer loss by {gap:.3f} nats or a little more, whether or not the answer's "
        f"passage is alone), so the table measures no composition quality; every method lands within {spread:.3f} "
        "nats of the concatenation. Recall did not emerge in three CPU runs of 20–50 minutes "
        "(`recipes/train_demo.py`'s docstring)."
    )


def _architecture(s: dict) -> str:
    """The hybrids' layer pattern (the Mamba models' architecture is their class name)."""
    if s["arch"] == "gdn":
        return _gdn_architecture(s)
    if s["arch"] != "hybrid":
        return ""
    if s.get("attn_init_std"):
        o_proj = (
            f"with the attention layers' output projections drawn from N(0, {s['attn_init_std']}²) (so that their "
            "queries and keys learn from the first step)"
        )
    else:
        o_proj = "with the attention layers' output projections at zero, i.e. as exactly that model,"
    if not s.get("init_from"):
        start = "Trained from scratch."
    else:
        start = (
            f"It started from `{s['init_from']}` (the Mamba-2 demo: embeddings, lm_head = those embeddings, "
            f"its six Mamba-2 layers in order, final norm) {o_proj.rstrip(',')}."
        )
        if s.get("qk_init_std"):
            start += f" The attention layers' query / key projections were drawn from N(0, {s['qk_init_std']}²) (scores of order 1, not ~0.1)."
        if s.get("induction_init"):
            start += (
                " Then the first attention layer was given a recall lookup by least squares (`induction_init` in the recipe: "
                "on its input hidden states over 60 fixed 16-town recall worlds, keys map an answer's position onto its "
                "question's query, values and output projection write the answer token's embedding), because NoPE attention "
                "trained from a random init learnt no lookup within a few hundred steps here."
            )
        start += " It was then trained as below."
    if s.get("attn_lr_mult", 1.0) != 1.0:
        start += f" The attention layers' learning rate is {s['attn_lr_mult']} × the rest's."
    if s.get("freeze_ssm_steps"):
        start += (
            f" For the first {s['freeze_ssm_steps']} steps only the attention layers trained (everything else frozen, "
            "every row a recall row, so that the recall loss could only fall through attention), then every layer on the mix below."
        )
    return f"""
## Architecture
transformers' `NemotronHForCausalLM` (model_type `nemotron_h`), hidden size 256, layer pattern
`{s["pattern"]}` (`M`: a Mamba-2 layer with the Mamba-2 demo's settings, 8 heads × 64, state 64, one group;
`*`: an attention layer, 4 query heads × 32 and 2 key/value heads, **no positional encoding** (NemotronH's
attention has none; the Mamba-2 layers before it carry the order); no MLP layers, like the Mamba-2 demo.
NemotronH does not tie its lm_head to the embeddings, hence the small attention layers (the file stays
under 20 MB). `time_step_min` is 1e-6: NemotronH clamps the SSM step from below at it (Mamba-2 does not).
Same tokenizer as the Mamba-2 demo. {start} Trained with transformers' stock forward (no cache).
"""


def _gdn_architecture(s: dict) -> str:
    kinds = "".join("*" if t == "full_attention" else "G" for t in s["layer_types"])
    if s.get("init_from"):
        start = (
            f"Its token embeddings (= its lm_head) started from `{s['init_from']}`'s (the Mamba-2 demo's, same "
            "tokenizer and width); every other weight from the config's init."
        )
    else:
        start = "Trained from scratch."
    if s.get("gdn_init", "fla") == "fla":
        start += (
            " The GDN layers' decay parameters were initialised as the gated DeltaNet reference does for training from "
            "scratch (`A ~ U(0, 16)`, `dt_bias = softplus⁻¹(dt)` with `dt` log-uniform in [0.001, 0.1]), not as "
            "transformers' Qwen3.5 init (`dt_bias = 1`: every head starts forgetting within a few tokens)."
        )
    return f"""
## Architecture
transformers' `Qwen3_5ForCausalLM` (the Qwen3.5 text model, model_type `qwen3_5_text`), hidden size 256,
{len(s["layer_types"])} layers `{kinds}` (`G`: a gated DeltaNet layer, `linear_attention`: 2 key heads × 64, 4 value
heads × 64, short conv 4, gated RMSNorm output; `*`: Qwen3.5's gated attention layer, `full_attention`: 4 query heads
× 64, 2 key/value heads, partial RoPE on a quarter of each head); every layer followed by a SwiGLU MLP of {s.get("intermediate_size", 256)};
lm_head tied to the embeddings. Same tokenizer as the Mamba-2 demo. {start} Trained with transformers' stock forward
(no cache; the PyTorch reference of the chunked gated delta rule, no `flash-linear-attention` on this CPU).
"""


# the repository's own checkpoints and adapters: their cards are also kept in model_cards/
SHIPPED = (ROOT / "adapters", ROOT / "checkpoints", ROOT / "hf_statecompose" / "demo" / "models")


def _write(out: Path, card: str, text: str) -> None:
    """The card as the checkpoint's README.md (what the Hub shows) and, for a folder the repository ships
    (:data:`SHIPPED`), as ``model_cards/<card>.md``."""
    (Path(out) / "README.md").write_text(text)
    if any(Path(out).resolve().is_relative_to(folder) for folder in SHIPPED):
        cards = ROOT / "model_cards"
        cards.mkdir(exist_ok=True)
        (cards / f"{card}.md").write_text(text)


def write_model_card(out: Path, summary: dict) -> None:
    _write(out, f"demo-{summary['arch']}", render(summary))


def shown(folder) -> str:
    """How a card names ``folder``: relative to the working directory when under it (``adapters/bptc-mamba2``
    from the repository's root), else its absolute path."""
    folder = Path(folder).resolve()
    return (
        folder.relative_to(Path.cwd().resolve()) if folder.is_relative_to(Path.cwd().resolve()) else folder
    ).as_posix()


def render_adapter(results: dict, folder: str) -> str:
    """The card of a LoRA adapter trained by ``recipes/finetune.py``, from its ``results.json``, naming the
    ``folder`` it is written to (where ``PeftModel.from_pretrained`` and lm-eval find the adapter)."""
    cfg, tr = results["config"], results["training"]
    name, arch = cfg["name"], cfg["arch"]
    objective = {
        "bptc": "BPTC (backpropagation through the composition and the context encodings)",
        "bp2c": "BP2C (gradient stopped at the composed state)",
    }[cfg["objective"]]
    rows = []
    for task in sorted(set(results.get("before", {})) | set(results.get("after", {}))):
        before, after = results.get("before", {}).get(task, {}), results.get("after", {}).get(task, {})
        for metric in sorted(set(before) | set(after)):
            if metric in ("k", "alias", "sample_len"):
                continue
            b, a = before.get(metric), after.get(metric)
            fmt = lambda v: "–" if v is None else f"{v:.4f}"
            docs = after.get("sample_len", before.get("sample_len"))
            rows.append(
                f"| {task} (k={after.get('k', before.get('k'))}, {docs} docs) | {metric.removesuffix(',none')} | {fmt(b)} | {fmt(a)} |"
            )
    table = (
        "\n".join(["| task | metric | base model | with this adapter |", "|---|---|---:|---:|", *rows])
        if rows
        else "(not evaluated)"
    )
    base = "hsc.load_demo()" if arch == "mamba2" else 'hsc.load_demo("mamba")'
    return f"""---
license: cc-by-sa-4.0
library_name: peft
base_model: hf_statecompose/demo-{arch}
tags: [mamba, {arch}, lora, hf_statecompose, composition, {cfg["objective"]}]
---

# {name}: LoRA adapter for composed states ({cfg["objective"].upper()})

A LoRA adapter (r = {cfg["lora"]["r"]}, alpha = {cfg["lora"]["alpha"]}, on `{", ".join(cfg["lora"]["target_modules"][arch] if isinstance(cfg["lora"]["target_modules"], dict) else cfg["lora"]["target_modules"])}`;
{tr["trainable_parameters"]:,} trainable parameters) for the embedded demo {NAMES[arch]} of `hf_statecompose`, fine-tuned
to read a **composition of context states** ({cfg["composition"]}): {objective}. A demo adapter: what it
changes (little, see below and `docs/experiments/bptc.md` in the repository) was measured, not tuned for.

## Use
```python
import hf_statecompose as hsc
from peft import PeftModel

base, tok = {base}
model = PeftModel.from_pretrained(base, "{folder}")       # this folder
# states must be encoded by the adapted model (its fingerprint includes the adapter)
states = [hsc.ComposableMambaCache.encode(model, tok(c, return_tensors="pt").input_ids) for c in contexts]
out = model.generate(tok(query, return_tensors="pt").input_ids, past_states=states, composition="{cfg["composition"]}", max_new_tokens=8)
```
With lm-eval: `hf-statecompose lm-eval run --model statecompose --model_args pretrained=demo{"" if arch == "mamba2" else "-mamba"},peft={folder},passages=bundled,k=5 --tasks statecompose_recall_mc`.

## Training
`accelerate launch recipes/finetune.py --experiment {name}` (config: `recipes/configs/finetune.json`):
{tr["steps"]} steps of {cfg["batch_size"]} rows, k ∈ [{cfg["k_min"]}, {cfg["k_max"]}] contexts sampled per batch,
{1 - cfg["recall_fraction"]:.0%} Wikipedia rows (training articles; query 64 tokens, target 64 tokens, contexts retrieved
from training segments) and {cfg["recall_fraction"]:.0%} synthetic recall rows; AdamW lr {cfg["lr"]}, warm-up + cosine, seed {cfg["seed"]};
{tr["train_seconds"] / 60:.1f} min on {results["device"]} ({tr["seconds_per_step_mean"]:.2f} s/step);
training loss {tr["loss_first_10"]:.3f} (first 10 steps) → {tr["loss_last_10"]:.3f} (last 10).

## Evaluation (lm-eval, bundled tasks; `python recipes/finetune.py --evaluate {folder}`)
{table}
{_adapter_composition(arch, name)}
Licence: the demo models' (CC BY-SA 4.0, trained on Wikipedia text).
"""


def write_adapter_card(out: Path, results: dict) -> None:
    _write(out, results["config"]["name"], render_adapter(results, shown(out)))
