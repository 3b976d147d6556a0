"""Model cards for the demo checkpoints, filled from the figures the training run measured."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"mamba2": "Mamba-2", "mamba": "Mamba-1 (Mamba)"}


def render(summary: dict) -> str:
    arch = summary["arch"]
    s = summary
    return f"""---
license: cc-by-sa-4.0
library_name: transformers
pipeline_tag: text-generation
tags: [mamba, {arch}, state-space-model, hf_statecompose, demo]
---

# hf_statecompose demo {NAMES[arch]} ({s['parameters'] / 1e6:.2f}M parameters)

A tiny {NAMES[arch]} causal LM shipped inside `hf_statecompose` (`hsc.load_demo({'' if arch == 'mamba2' else 'arch="mamba"'})`)
so that the state database, composition and evaluation run offline on a CPU. It is a **demo model**:
it writes Wikipedia-flavoured English and recalls facts from its context; it knows little and should
not be used for anything but exercising and measuring the library.

## Training
- Recipe: `python recipes/train_demo.py --arch {arch} --minutes {s['train_seconds'] / 60:.0f}` ({s['steps']} steps of
  {s['batch_size']} × {s['seq_len']} tokens = {s['tokens_seen'] / 1e6:.2f}M tokens, {s['train_seconds'] / 60:.1f} min on
  {s['device']} with {s['threads']} threads; AdamW, lr {s['lr']}, warm-up + cosine; seed {s['seed']}).
- Data: 3/8 of each batch Wikipedia, 5/8 synthetic recall:
  - the training articles of the English Wikipedia excerpt shipped in the `gensim` wheel
    (`gensim/test/test_data/enwiki-latest-pages-articles1*.bz2`). Text © Wikipedia contributors,
    licensed [CC BY-SA 4.0](https://creativecommons.org/licenses/by-sa/4.0/); the held-out articles
    ({', '.join(s['held_out_articles'])}) were never trained on;
  - a synthetic multi-context fact-recall task (`hf_statecompose.corpora`): 2–8 fictional towns with
    one fact each (terse records, `Gasol river Iron.`, two towns per passage), shuffled, then every
    fact asked back (`Gasol river` → ` Iron.`), the loss taken on the answers only (the facts are
    random: predicting them is noise). A fresh random world per example, so facts can only come from
    the context.
- Tokenizer: 4096-token byte-level BPE trained on the same training text (shared by both demo models).

## Measured at the end of training
| metric | value |
|---|---|
| mean training loss, last 50 steps | {s['final_train_loss_mean_last_50']:.3f} |
| held-out Wikipedia loss (nats/token, {s['held_out_wikipedia_windows']} windows of {s['seq_len']} tokens, no context) | {s['held_out_wikipedia_loss']:.3f} |
| recall accuracy, answer's passage in context (exact greedy answer, {s['recall_questions']} questions) | {s['recall_accuracy_with_context']:.1%} |
| recall accuracy, no context (chance-level guessing) | {s['recall_accuracy_no_context']:.1%} |

The composition evaluation (losses for k = 0…10 retrieved contexts, every method) is in the
repository README and `benchmarks/results/`.

## Licence and attribution
Trained on, and evaluated with, Wikipedia text under CC BY-SA 4.0; the weights are released under the
same licence. Architecture: transformers' `{'Mamba2ForCausalLM' if arch == 'mamba2' else 'MambaForCausalLM'}`.
"""


def write_model_card(out: Path, summary: dict) -> None:
    text = render(summary)
    (Path(out) / "README.md").write_text(text)
    cards = ROOT / "model_cards"
    cards.mkdir(exist_ok=True)
    (cards / f"demo-{summary['arch']}.md").write_text(text)
