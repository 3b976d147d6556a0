"""Train the embedded demo models: a small Mamba-2, a small Mamba-1, a small hybrid and a small gated-DeltaNet
hybrid causal LM.

    python recipes/train_demo.py --arch mamba2 --minutes 12
    python recipes/train_demo.py --arch mamba  --minutes 18
    OMP_NUM_THREADS=1 python recipes/train_demo.py --arch hybrid --minutes 20 --threads 1 --lr 1e-3
    OMP_NUM_THREADS=1 python recipes/train_demo.py --arch gdn --steps 1000 --lr 3e-3 --threads 1 \
        --init-from hf_statecompose/demo/models/mamba2 --gdn-layers 'GG*G' \
        --recall-only-steps 400 --recall-max-towns-start 3 --probe-every 25

Data (offline, see :mod:`hf_statecompose.demo.corpora`): the training articles of the Wikipedia excerpt in
the gensim wheel (CC BY-SA 4.0; held-out articles are never seen) and the synthetic multi-context
fact-recall task (a fresh random world per example: passages, then every fact asked back, the loss on
the answers only): 3/8 and 5/8 of every batch. The tokenizer is a 4096-token byte-level BPE trained on the same
training text (deterministic), shared by all the models (the hybrid and the GDN model reuse the Mamba-2 demo's).

The hybrid is a transformers ``NemotronHForCausalLM`` (``HYBRID_PATTERN``: the Mamba-2 demo's six Mamba-2
layers ``M``, same settings, and two small attention layers ``*`` without positional encoding, no MLP).
Its lm_head is not tied to the embeddings (NemotronH does not tie), so its attention layers are small
(4 query heads × 32, 2 key/value heads) to stay under 20 MB in float32. It starts from the trained Mamba-2
demo (``--init-from``: embeddings, lm_head = the embeddings, the six Mamba-2 layers in order, final norm;
the attention layers' output projections zero, so that the hybrid starts as exactly that model): a run
from scratch on this CPU (``MM*MM*``, attention 4 × 64, lr 2e-3) had not begun to recall by step 400
(answer loss 1.50 with the passage, 1.51 without), where the Mamba-2 demo had by step 200.
The shipped hybrid's attention layers carry no recall (zeroing their output projections changes nothing:
``eval_hybrid_demo.py --zero-attention``). Flags to make them matter (issue 22), none of which did within
~20 minutes of this CPU (the 16-town probe printed every 50 steps, ``attention_probe``, is the test):
``--max-towns`` (harder recall for a fixed-size state), ``--attn-init-std`` / ``--qk-init-std`` (attention
that gets gradients from step 0), ``--attn-lr-mult``, ``--freeze-ssm-steps`` (attention alone first) and
``--induction-init`` (a least-squares recall lookup for the first attention layer: it lowers the probe's
loss before training, 0.69 vs 0.75 with attention zeroed, but training, even of attention alone, undoes it).

The GDN model (``--arch gdn``) is a transformers ``Qwen3_5ForCausalLM`` (the Qwen3.5 text model, model_type
``qwen3_5_text``): gated DeltaNet layers (``linear_attention``: 2 key heads × 64, 4 value heads × 64, conv 4) and one
gated attention layer (``full_attention``: 4 query heads × 64, 2 key/value heads, partial RoPE as Qwen3.5), each
followed by a SwiGLU MLP (``--intermediate-size``, 256), hidden 256, lm_head tied to the embeddings; the layers are
``--gdn-layers`` (default ``GGG*GGG``, the shipped model ``GG*G``). From scratch by default; ``--init-from`` a Mamba-2
checkpoint copies its token embeddings only (nothing else maps onto a GDN layer). The GDN layers' decays start as the
gated DeltaNet reference's (``gdn_decay_init``, ``--gdn-init fla``), not transformers' (which starts every head
forgetting within a few tokens). Its loss is the stock forward's, with the logits computed only where a label is (in
recall rows, the answers: most of a step's lm_head saved). The shipped one is the command above: ``GG*G`` (2.90M
parameters), lr 3e-3, 1000 steps (30 minutes on one shared thread), the first 400 on recall rows only (no Wikipedia,
at most 3 towns per example rising to 8), then the usual mixture. It recalled from step ~75 (the 5-town probe's
answer loss 0.07 with the passage, 2.08 without; 0.002 vs 1.51 at the end; 100% of the 50 end-of-training questions
right with the passage, 0% without), through its GDN layers (the 16-town probe's loss is as low with the attention
layer's output projection zeroed). Its held-out Wikipedia loss, 5.50, is between the other demos' (5.22–5.96) and worse
than the previous GDN checkpoint's 5.10 (it saw Wikipedia for 600 steps only). What did not recall, all with the 3/8 Wikipedia, 5/8 recall
mixture from the first step and ``GGG*GGG``: from scratch (20 minutes, stopped at step 200 of 320: 1.540 with the
passage, 1.537 without); the embeddings warm start for 35 minutes (410 steps: 14% vs 8% of 50 questions) and for 50
minutes (883 steps, 6% vs 2%, the previous checkpoint).

The Mamba models train through hf_statecompose's state-aware path (the same kernels ``encode`` uses; its
Mamba-1 scan has a hand-written backward); the hybrid and the GDN model through transformers' stock forward (no cache).
AdamW with warm-up and cosine decay over a step count fixed from the
measured speed of the first steps so that the run takes about ``--minutes``. Output: an HF checkpoint
(safetensors) with tokenizer, ``training_log.json`` and a model card (README.md, also written to
``model_cards/``) whose figures are the ones this run measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 256
# NemotronH's layer pattern: "M" a Mamba-2 layer, "*" an attention layer (NemotronH's attention has no
# positional encoding: the Mamba layers before it carry the order)
HYBRID_PATTERN = "MM*MM*MM"
# the GDN model's layers (Qwen3.5's layer_types): gated DeltaNet layers around one attention layer
GDN_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3


def build_tokenizer(train_articles, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_statecompose.demo.corpora import recall_training_text

    rng = random.Random(seed)
    texts = [text for _, text in train_articles] + [recall_training_text(rng) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        padding_side="left",
        model_max_length=1 << 20,
    )


def parse_gdn_layers(pattern: str) -> list[str]:
    """``--gdn-layers``: ``G`` a gated DeltaNet layer (``linear_attention``), ``*`` the attention layer
    (``full_attention``), e.g. ``GG*G``; exactly one ``*``."""
    if set(pattern) - {"G", "*"} or pattern.count("*") != 1 or len(pattern) < 2:
        raise ValueError(f"--gdn-layers {pattern!r}: G (gated DeltaNet) and exactly one * (attention)")
    return ["full_attention" if c == "*" else "linear_attention" for c in pattern]


def build_model(
    arch: str, vocab_size: int, eos: int, gdn_layers: list[str] | None = None, intermediate_size: int = 256
):
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=6,
        expand=2,
        conv_kernel=4,
        tie_word_embeddings=True,
        pad_token_id=eos,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    if arch == "hybrid":  # the Mamba-2 demo's SSM settings; attention 4 query heads x 32, 2 key/value heads, NoPE;
        # NemotronH clamps dt from below at time_step_min (Mamba-2 at 0): 1e-6 computes what the Mamba-2 demo computes
        from transformers import NemotronHConfig, NemotronHForCausalLM

        del common["num_hidden_layers"]
        common["tie_word_embeddings"] = False  # NemotronH never ties (no _tied_weights_keys): say so in the config
        return NemotronHForCausalLM(
            NemotronHConfig(
                **common,
                hybrid_override_pattern=HYBRID_PATTERN,
                ssm_state_size=64,
                mamba_num_heads=8,
                mamba_head_dim=64,
                n_groups=1,
                chunk_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                residual_in_fp32=True,
                time_step_min=1e-6,
            )
        )
    if arch == "gdn":  # Qwen3.5's text model, small: GDN layers (2 key heads x 64, 4 value heads x 64), 1 attention
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        del common["expand"], common["conv_kernel"]
        layer_types = gdn_layers or GDN_LAYER_TYPES
        common["num_hidden_layers"] = len(layer_types)
        return Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                **common,
                layer_types=layer_types,
                intermediate_size=intermediate_size,
                linear_num_key_heads=2,
                linear_key_head_dim=64,
                linear_num_value_heads=4,
                linear_value_head_dim=64,
                linear_conv_kernel_dim=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                max_position_embeddings=4096,
            )
        )
    if arch == "mamba2":
        return Mamba2ForCausalLM(
            Mamba2Config(**common, state_size=64, num_heads=8, head_dim=64, n_groups=1, chunk_size=64)
        )
    return MambaForCausalLM(MambaConfig(**common, state_size=16))


@torch.no_grad()
def warm_start(hybrid, folder, attn_init_std: float = 0.0, qk_init_std: float | None = None) -> None:
    """Load a trained Mamba-2 checkpoint (``folder``) into the hybrid: embeddings (and the untied lm_head,
    from the tied embeddings), the Mamba-2 layers in order onto the ``M`` layers, the final norm; the
    attention layers' output projections zero (``attn_init_std`` 0), so that the hybrid computes exactly
    the Mamba-2 model, or drawn from N(0, attn_init_std²) (then the attention layers' query / key weights
    get gradients from the first step: with a zero output projection they get none until it moves).
    ``qk_init_std``: the query / key projections drawn from N(0, qk_init_std²) instead of the config's
    init (std 0.02 gives near-uniform attention scores, ~0.1, whose query and key gradients are each
    proportional to the other weight: a slow start; 0.1 gives scores of about ±2.5)."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    mamba = [layer for layer in hybrid.model.layers if layer.block_type == "linear_attention"]
    if len(mamba) != len(source.backbone.layers) or source.config.hidden_size != hybrid.config.hidden_size:
        raise ValueError(
            f"{folder} has {len(source.backbone.layers)} Mamba-2 layers of width {source.config.hidden_size}; "
            f"the hybrid {len(mamba)} of width {hybrid.config.hidden_size}: they must match for --init-from"
        )
    hybrid.model.embeddings.load_state_dict(source.backbone.embeddings.state_dict())
    hybrid.lm_head.weight.copy_(source.get_output_embeddings().weight)
    hybrid.model.norm_f.load_state_dict(source.backbone.norm_f.state_dict())
    for target, layer in zip(mamba, source.backbone.layers):
        target.norm.load_state_dict(layer.norm.state_dict())
        target.mixer.load_state_dict(layer.mixer.state_dict())
    for layer in hybrid.model.layers:
        if layer.block_type == "full_attention":
            layer.mixer.o_proj.weight.normal_(
                0.0, attn_init_std
            ) if attn_init_std else layer.mixer.o_proj.weight.zero_()
            if qk_init_std:
                layer.mixer.q_proj.weight.normal_(0.0, qk_init_std)
                layer.mixer.k_proj.weight.normal_(0.0, qk_init_std)


@torch.no_grad()
def gdn_decay_init(model, dt_min: float = 1e-3, dt_max: float = 0.1, seed: int = 0) -> None:
    """The GDN layers' decay parameters as the gated DeltaNet reference (flash-linear-attention, NVlabs) initialises
    them for training from scratch: ``A ~ U(0, 16)`` and ``dt_bias = softplus⁻¹(dt)``, ``dt`` log-uniform in
    [``dt_min``, ``dt_max``]. transformers' Qwen3.5 init (``dt_bias = 1``, ``A ~ U(0.01, 16)``, meant for loading
    trained weights) starts every head at a decay of exp(-A·softplus(1)) per token, i.e. hardly any memory beyond
    a few tokens, so recall has to be learnt against it; with this init the decays start between ~0.2 and ~1."""
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is None:
            continue
        heads = mixer.dt_bias.numel()
        dt = torch.exp(
            torch.rand(heads, generator=generator) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        )
        dt = dt.clamp(min=1e-4)
        mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        mixer.A_log.copy_(torch.empty(heads).uniform_(0, 16, generator=generator).clamp(min=1e-4).log())


@torch.no_grad()
def warm_start_embeddings(model, folder) -> None:
    """The GDN model's token embeddings (tied to its lm_head) from a trained checkpoint with the same tokenizer
    and width (``folder``, the Mamba-2 demo's); every other weight keeps its init."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).get_input_embeddings().weight
    target = model.get_input_embeddings().weight
    if source.shape != target.shape:
        raise ValueError(
            f"{folder}'s embeddings are {tuple(source.shape)}, the model's {tuple(target.shape)}: they must match"
        )
    target.copy_(source)


@torch.no_grad()
def induction_init(model, tokenizer, scale: float = 16.0, gain: float = 4.0, worlds: int = 60, rank: int = 64) -> None:
    """Give the hybrid's first attention layer a recall lookup before training (NoPE attention trained by
    gradient from a random init did not learn one here within hundreds of steps). Fitted by ridge least
    squares on that layer's input hidden states ``h`` over ``worlds`` fixed 16-town recall worlds: with
    ``h_q`` at a question's last token and ``h_a`` at its answer's first token in the passage, ``A`` maps
    ``h_a`` to ``h_q`` and ``M`` maps ``h_a`` to the answer's output embedding. Queries ``P h`` and keys
    ``P Aᵀ h`` (``P`` a random orthonormal 32-row projection times ``scale``) make a question attend to
    its answer's position; values and output projection are ``M``'s best rank-``rank`` factors (times
    ``gain``), so the attended answer token is written into the residual stream. The layer's other
    weights are left as they are; training goes on from there."""
    from hf_statecompose.demo.corpora import recall_world

    layer = attention_layers(model)[0]
    mixer, config = layer.mixer, model.config
    if (config.num_attention_heads, config.num_key_value_heads, config.head_dim) != (4, 2, 32):
        raise ValueError(
            "--induction-init is written for the demo hybrid's attention (4 query heads, 2 key/value heads of 32)"
        )
    captured = {}
    hook = mixer.register_forward_pre_hook(
        lambda module, args, kwargs: captured.__setitem__("h", (args[0] if args else kwargs["hidden_states"]).detach()),
        with_kwargs=True,
    )
    h_q, h_a, answers = [], [], []
    was_training = model.training
    model.eval()
    for seed in range(worlds):
        world = recall_world(10_000 + seed, towns=16)
        ids, answer_at = [], {}
        for passage in world.passages:  # the passages' tokens, line by line as in training
            for line in passage.strip("\n").split("\n"):
                head, value = line.rsplit(" ", 1)
                ids += tokenizer(head)["input_ids"]
                answer_at[head] = len(ids)
                ids += tokenizer(" " + value)["input_ids"] + tokenizer("\n")["input_ids"]
        pairs = []
        for q in world.questions:
            ids += tokenizer(q.query)["input_ids"]
            pairs.append((len(ids) - 1, answer_at[q.query], tokenizer(q.answer)["input_ids"][0]))
            ids += tokenizer(q.answer)["input_ids"] + tokenizer("\n")["input_ids"]
        model(input_ids=torch.tensor([ids], device=model.device))
        h = captured["h"][0].float().cpu()
        for at_query, at_answer, answer in pairs:
            h_q.append(h[at_query]), h_a.append(h[at_answer]), answers.append(answer)
    hook.remove()
    model.train(was_training)
    h_q, h_a = torch.stack(h_q), torch.stack(h_a)
    width = h_a.shape[1]
    gram = h_a.T @ h_a + 1e-2 * torch.eye(width)
    A = torch.linalg.solve(gram, h_a.T @ h_q)  # h_a @ A ≈ h_q
    M = torch.linalg.solve(
        gram, h_a.T @ model.lm_head.weight[answers].detach().float().cpu()
    )  # h_a @ M ≈ answer embedding
    U, S, Vh = torch.linalg.svd(M.T)
    P = torch.linalg.qr(torch.randn(width, 32))[0].T * scale
    dtype, device = mixer.q_proj.weight.dtype, mixer.q_proj.weight.device
    mixer.q_proj.weight.copy_(torch.cat([P] * 4).to(device, dtype))
    mixer.k_proj.weight.copy_(torch.cat([P @ A.T] * 2).to(device, dtype))
    mixer.v_proj.weight.copy_(
        (Vh[:rank].T * S[:rank].sqrt()).T.to(device, dtype)
    )  # key/value head 0: factors 0..31, head 1: 32..63
    out = torch.zeros(width, 128)
    factors = U[:, :rank] * S[:rank].sqrt() * gain
    out[:, 0:32], out[:, 64:96] = (
        factors[:, :32],
        factors[:, 32:64],
    )  # query head 0 reads key/value head 0, query head 2 head 1
    mixer.o_proj.weight.copy_(out.to(device, dtype))


class Batches:
    """3/8 random windows of the Wikipedia training stream, 5/8 packed synthetic recall examples."""

    def __init__(self, tokenizer, train_articles, batch_size: int, seed: int, max_towns: int = 8):
        self.tokenizer, self.batch_size, self.max_towns = tokenizer, batch_size, max_towns
        self.rng = random.Random(seed)
        eos = tokenizer.eos_token_id
        stream = []
        for _, text in train_articles:
            stream += tokenizer(text)["input_ids"] + [eos]
        self.wiki = torch.tensor(stream)
        self.recall_buffer: list[int] = []
        self.recall_only = False  # every row a recall row (the hybrid's attention-only phase: the Wikipedia rows teach attention no recall)

    def recall_row(self):
        """A row of packed recall examples; labels only on the answers (everything else is -100).

        The facts themselves are random, so predicting them is irreducible noise that drowns the recall
        signal in a model this small; the answers are the only learnable part."""
        from hf_statecompose.demo.corpora import recall_training_text

        while len(self.recall_buffer) < SEQ_LEN:
            text = recall_training_text(self.rng, max_towns=self.max_towns)
            ids, labels = [], []
            for line_number, line in enumerate(text.split("\n")):
                piece = self.tokenizer(("\n" if line_number else "") + line)["input_ids"]
                ids += piece
                is_question = line_number >= text.count("\n") // 2 + 1
                if is_question:  # "Town relation value." -> learn " value." only
                    prefix = len(self.tokenizer("\n" + line.rsplit(" ", 1)[0])["input_ids"])
                    labels += [-100] * prefix + piece[prefix:]
                else:
                    labels += [-100] * len(piece)
            ids.append(self.tokenizer.eos_token_id)
            labels.append(-100)
            self.recall_buffer += list(zip(ids, labels))
        row, self.recall_buffer = self.recall_buffer[:SEQ_LEN], self.recall_buffer[SEQ_LEN:]
        return torch.tensor([i for i, _ in row]), torch.tensor([label for _, label in row])

    def __next__(self):
        rows, labels = [], []
        for i in range(self.batch_size):
            if i % 8 < 3 and not self.recall_only:  # 3/8 Wikipedia, 5/8 recall
                start = self.rng.randrange(len(self.wiki) - SEQ_LEN)
                rows.append(self.wiki[start : start + SEQ_LEN])
                labels.append(rows[-1])
            else:
                row, label = self.recall_row()
                rows.append(row)
                labels.append(label)
        return torch.stack(rows), torch.stack(labels)


@torch.no_grad()
def recall_probe(model, tokenizer, seed: int = 4242):
    """Mean answer loss of 20 recall questions (a fixed unseen world) with the answer's passage as a
    prefix, and without: the gap is how much the model uses its context."""
    from hf_statecompose.demo.corpora import recall_world

    world = recall_world(seed, towns=5)
    device = next(model.parameters()).device
    out = {True: [], False: []}
    for q in world.questions:
        answer = tokenizer(q.answer)["input_ids"]
        for with_context in out:
            prefix = world.passages[q.passages[0]] + "\n" if with_context else ""
            ids = tokenizer(prefix + q.query)["input_ids"] + answer
            ids = torch.tensor([ids], device=device)
            labels = ids.clone()
            labels[:, : -len(answer)] = -100
            out[with_context].append(float(model(input_ids=ids, labels=labels).loss))
    return sum(out[True]) / len(out[True]), sum(out[False]) / len(out[False])


def attention_layers(model) -> list:
    """The attention layers (NemotronH's and Qwen3.5's ``full_attention`` blocks); [] for the Mamba models."""
    return [
        layer for layer in getattr(getattr(model, "model", None), "layers", []) if layer.block_type == "full_attention"
    ]


def output_projection(layer):
    """An attention layer's output projection (NemotronH: ``mixer.o_proj``; Qwen3.5: ``self_attn.o_proj``)."""
    return (layer.mixer if hasattr(layer, "mixer") else layer.self_attn).o_proj


@torch.no_grad()
def attention_probe(model, tokenizer, seed: int = 4343, towns: int = 16):
    """Does the hybrid's recall go through its attention layers? Mean answer loss of every question of a
    fixed unseen ``towns``-town world with all its passages as the prefix, as trained and with the
    attention layers' output projections zeroed (the attention layers then add nothing)."""
    from hf_statecompose.demo.corpora import recall_world

    world = recall_world(seed, towns=towns)
    device = next(model.parameters()).device
    prefix = tokenizer("".join(world.passages))["input_ids"]

    def mean_loss():
        losses = []
        for q in world.questions:
            answer = tokenizer(q.answer)["input_ids"]
            ids = torch.tensor([prefix + tokenizer(q.query)["input_ids"] + answer], device=device)
            labels = ids.clone()
            labels[:, : -len(answer)] = -100
            losses.append(float(model(input_ids=ids, labels=labels).loss))
        return sum(losses) / len(losses)

    with_attention = mean_loss()
    saved = [output_projection(layer).weight.clone() for layer in attention_layers(model)]
    for layer in attention_layers(model):
        output_projection(layer).weight.zero_()
    ablated = mean_loss()
    for layer, weight in zip(attention_layers(model), saved):
        output_projection(layer).weight.copy_(weight)
    return with_attention, ablated


@torch.no_grad()
def evaluate(model, tokenizer, held_out, seed: int = 1234):
    """Held-out Wikipedia loss (first 4096 tokens of each held-out article, in 256-token windows, no
    context carried) and recall accuracy with the right passages in context / without context."""
    from hf_statecompose.demo.corpora import recall_world

    model.eval()
    losses = []
    for _, text in held_out:
        ids = torch.tensor(tokenizer(text)["input_ids"][:4096])
        for start in range(0, len(ids) - SEQ_LEN + 1, SEQ_LEN):
            window = ids[start : start + SEQ_LEN][None]
            losses.append(float(model(input_ids=window, labels=window).loss))
    world = recall_world(seed, towns=50)
    hits = {"with_context": 0, "no_context": 0}
    for q in world.questions:
        for mode in hits:
            prompt = (
                "\n".join(world.passages[i] for i in q.passages) + "\n" if mode == "with_context" else ""
            ) + q.query
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            answer = tokenizer(q.answer)["input_ids"]
            out = model.generate(ids, max_new_tokens=len(answer), do_sample=False, pad_token_id=tokenizer.eos_token_id)
            hits[mode] += tokenizer.decode(out[0, ids.shape[1] :]) == q.answer
    model.train()
    return {
        "held_out_wikipedia_loss": sum(losses) / len(losses),
        "held_out_wikipedia_windows": len(losses),
        "recall_accuracy_with_context": hits["with_context"] / len(world.questions),
        "recall_accuracy_no_context": hits["no_context"] / len(world.questions),
        "recall_questions": len(world.questions),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mamba2", choices=["mamba2", "mamba", "hybrid", "gdn"])
    parser.add_argument(
        "--minutes", type=float, default=12.0, help="training time budget (excluding data prep and evaluation)"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="default: hf_statecompose/demo/models/<arch>")
    parser.add_argument(
        "--tokenizer-from",
        default=None,
        help="a folder with the tokenizer to reuse (default: another demo model's, if trained; else train one)",
    )
    parser.add_argument(
        "--init-from",
        default=None,
        help="hybrid: a Mamba-2 checkpoint to start from (default: the Mamba-2 demo's; 'none': from scratch); "
        "gdn: a checkpoint whose token embeddings to start from (default: none, from scratch)",
    )
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--max-towns", type=int, default=8, help="recall examples have 2 to this many towns (facts) in context"
    )
    parser.add_argument(
        "--attn-init-std",
        type=float,
        default=0.0,
        help="hybrid warm start: std of the attention output projections' normal init (0: zero, the hybrid starts as the Mamba-2 model)",
    )
    parser.add_argument(
        "--qk-init-std",
        type=float,
        default=None,
        help="hybrid warm start: std of the attention query / key projections' init (default: the config's, 0.02)",
    )
    parser.add_argument(
        "--induction-init",
        action="store_true",
        help="hybrid warm start: fit the first attention layer as a recall lookup (induction_init) before training",
    )
    parser.add_argument(
        "--gdn-init",
        default="fla",
        choices=["fla", "transformers"],
        help="gdn: the GDN layers' decay init: 'fla' (A ~ U(0, 16), dt log-uniform in [1e-3, 0.1], as the gated "
        "DeltaNet reference) or 'transformers' (Qwen3.5's: dt_bias 1, A ~ U(0.01, 16))",
    )
    parser.add_argument(
        "--gdn-layers",
        default="GGG*GGG",
        help="gdn: the layer pattern, G a gated DeltaNet layer, * the one attention layer (e.g. GG*G)",
    )
    parser.add_argument("--intermediate-size", type=int, default=256, help="gdn: the SwiGLU MLPs' width")
    parser.add_argument(
        "--recall-only-steps",
        type=int,
        default=0,
        help="the first N steps on recall rows only (no Wikipedia rows): a recall-first phase",
    )
    parser.add_argument(
        "--recall-max-towns-start",
        type=int,
        default=None,
        help="curriculum: recall examples start with at most this many towns, rising linearly to --max-towns "
        "over the recall-only phase",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="train this many steps (default: as many as fit in --minutes)"
    )
    parser.add_argument("--warmup", type=int, default=30, help="warm-up steps")
    parser.add_argument("--probe-every", type=int, default=100, help="print the recall probe every N steps")
    parser.add_argument(
        "--attn-lr-mult", type=float, default=1.0, help="hybrid: the attention layers' learning rate is --lr times this"
    )
    parser.add_argument(
        "--freeze-ssm-steps",
        type=int,
        default=0,
        help="hybrid: for the first N steps train the attention layers only (everything else frozen), on recall rows only, so the recall loss can only fall through attention",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sys.path.insert(0, str(ROOT))
    import hf_statecompose as hsc
    from hf_statecompose.demo.corpora import wikipedia_split

    out = Path(args.out or ROOT / "hf_statecompose" / "demo" / "models" / args.arch)
    t0 = time.time()
    train_articles, held_out = wikipedia_split()
    # BPE training breaks ties in no fixed order: train the tokenizer once, reuse it for the other models
    # (the hybrid: always the Mamba-2 demo's)
    demos = ROOT / "hf_statecompose" / "demo" / "models"
    shared = (
        args.tokenizer_from
        or (str(demos / "mamba2") if args.arch in ("hybrid", "gdn") else None)
        or next(
            (
                str(p.parent)
                for p in sorted((ROOT / "hf_statecompose" / "demo" / "models").glob("*/tokenizer.json"))
                if p.parent != out
            ),
            None,
        )
    )
    if shared:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(shared, local_files_only=True)
        print(f"tokenizer: reused from {shared}", flush=True)
    else:
        tokenizer = build_tokenizer(train_articles)
    batches = Batches(tokenizer, train_articles, args.batch_size, args.seed, args.max_towns)
    print(
        f"data: {len(train_articles)} training articles ({len(batches.wiki)} tokens), {len(held_out)} held out "
        f"({', '.join(t for t, _ in held_out)}); prep {time.time() - t0:.0f}s",
        flush=True,
    )
    model = build_model(
        args.arch,
        len(tokenizer),
        tokenizer.eos_token_id,
        parse_gdn_layers(args.gdn_layers) if args.arch == "gdn" else None,
        args.intermediate_size,
    )
    stock = args.arch in ("hybrid", "gdn")  # trained with transformers' own forward, not hf_statecompose's state path
    init_from = None
    if args.arch == "gdn":
        if args.induction_init or args.attn_init_std or args.qk_init_std:
            parser.error("--induction-init, --attn-init-std and --qk-init-std are for the hybrid's warm start")
        if args.gdn_init == "fla":
            gdn_decay_init(model, seed=args.seed)
        if args.init_from not in (None, "none"):
            init_from = args.init_from
            warm_start_embeddings(model, init_from)
            print(f"gdn: token embeddings from {init_from}", flush=True)
    elif stock and args.init_from != "none":
        init_from = args.init_from or str(demos / "mamba2")
        warm_start(model, init_from, args.attn_init_std, args.qk_init_std)
        if args.induction_init:
            induction_init(model, tokenizer)
            print(
                f"induction init: 16-town recall answer loss {attention_probe(model, tokenizer)[0]:.3f}, "
                f"attention o_proj zeroed {attention_probe(model, tokenizer)[1]:.3f}",
                flush=True,
            )
        print(f"hybrid: started from {init_from}", flush=True)
    if not stock:
        model = hsc.enable(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.arch}, {params / 1e6:.2f}M parameters, device {device}", flush=True)
    attention = {id(p) for layer in attention_layers(model) for p in layer.parameters()}
    groups = []  # (weight decay, lr multiplier): matrices but the embeddings decay; the attention layers' lr x --attn-lr-mult
    for is_attention in (False, True):
        named = [(n, p) for n, p in model.named_parameters() if (id(p) in attention) == is_attention]
        mult = args.attn_lr_mult if is_attention else 1.0
        groups += [
            {
                "params": [p for n, p in named if p.dim() >= 2 and "embed" not in n],
                "weight_decay": 0.1,
                "lr_mult": mult,
            },
            {
                "params": [p for n, p in named if not (p.dim() >= 2 and "embed" not in n)],
                "weight_decay": 0.0,
                "lr_mult": mult,
            },
        ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, betas=(0.9, 0.95))
    frozen = [p for p in model.parameters() if id(p) not in attention] if args.freeze_ssm_steps and attention else []
    for p in frozen:
        p.requires_grad_(False)
    if frozen:
        batches.recall_only = True
        print(f"attention layers only, recall rows only, for the first {args.freeze_ssm_steps} steps", flush=True)

    def step_fn(batch):
        batch, labels = batch[0].to(device), batch[1].to(device)
        if args.arch == "gdn":  # the same loss as the stock forward's, logits only where a label is (cheaper)
            hidden = model.model(input_ids=batch, use_cache=False).last_hidden_state[:, :-1]
            targets = labels[:, 1:]
            keep = targets != -100
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]).float(), targets[keep])
        elif stock:
            loss = model(input_ids=batch, labels=labels, use_cache=False).loss
        else:
            cache = hsc.ComposableMambaCache.empty_for(model)
            loss = model(input_ids=batch, labels=labels, use_cache=True, **hsc.compat.cache_kwargs(cache)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    warmup, probe = args.warmup, 10
    if args.recall_only_steps:
        batches.recall_only = True
        print(f"recall rows only for the first {args.recall_only_steps} steps", flush=True)
    log, total_steps, step = [], args.steps, 0
    start = time.time()
    while total_steps is None or step < total_steps:
        progress = 0.0 if total_steps is None else step / total_steps
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]
        if frozen and step == args.freeze_ssm_steps:
            for p in frozen:
                p.requires_grad_(True)
            batches.recall_only = False
            print(f"step {step}: every layer trains from here", flush=True)
        if args.recall_only_steps and step == args.recall_only_steps:
            batches.recall_only = False
            batches.max_towns = args.max_towns
            print(f"step {step}: Wikipedia rows from here", flush=True)
        elif args.recall_only_steps and args.recall_max_towns_start and step < args.recall_only_steps:
            start_towns = args.recall_max_towns_start
            batches.max_towns = start_towns + (args.max_towns - start_towns) * step // args.recall_only_steps
        loss = step_fn(next(batches))
        step += 1
        if step == probe:
            per_step = (time.time() - start) / probe
            if args.steps is None:
                total_steps = max(probe + 1, int(args.minutes * 60 / per_step))
            print(f"{per_step:.2f}s/step -> {total_steps} steps", flush=True)
        log.append({"step": step, "loss": loss, "lr": lr, "seconds": time.time() - start})
        if step % 50 == 0:
            print(f"step {step}/{total_steps} loss {loss:.3f} lr {lr:.2e} {time.time() - start:.0f}s", flush=True)
        if step % args.probe_every == 0:
            model.eval()
            with_context, without = recall_probe(model, tokenizer)
            model.train()
            log[-1].update(recall_answer_loss_with_context=with_context, recall_answer_loss_without=without)
            print(f"  recall answer loss: with its passage {with_context:.3f}, without {without:.3f}", flush=True)
        if step % (100 if args.arch == "gdn" else 50) == 0 and attention:
            model.eval()
            with_attention, ablated = attention_probe(model, tokenizer)
            model.train()
            log[-1].update(recall16_answer_loss=with_attention, recall16_answer_loss_attention_zeroed=ablated)
            print(
                f"  16-town recall answer loss: {with_attention:.3f}, attention o_proj zeroed {ablated:.3f}", flush=True
            )
    train_seconds = time.time() - start
    model.eval()
    metrics = evaluate(model, tokenizer, held_out)
    print(json.dumps(metrics, indent=1), flush=True)

    out.mkdir(parents=True, exist_ok=True)
    if not stock:
        hsc.disable(model)
    model.to("cpu").save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {
        "arch": args.arch,
        "parameters": params,
        "steps": step,
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "tokens_seen": step * args.batch_size * SEQ_LEN,
        "train_seconds": round(train_seconds, 1),
        "device": device,
        "threads": args.threads,
        "lr": args.lr,
        "seed": args.seed,
        "max_towns": args.max_towns,
        "final_train_loss_mean_last_50": sum(r["loss"] for r in log[-50:]) / len(log[-50:]),
        "held_out_articles": [t for t, _ in held_out],
        **metrics,
    }
    if args.arch == "gdn":
        summary.update(
            layer_types=list(model.config.layer_types),
            gdn_init=args.gdn_init,
            init_from=None if init_from is None else os.path.relpath(init_from, ROOT),
            attn_lr_mult=args.attn_lr_mult,
            freeze_ssm_steps=args.freeze_ssm_steps,
            intermediate_size=args.intermediate_size,
            recall_only_steps=args.recall_only_steps,
            steps_arg=args.steps,
            recall_max_towns_start=args.recall_max_towns_start,
            warmup=args.warmup,
        )
    elif stock:
        summary.update(
            pattern=HYBRID_PATTERN,
            init_from=None if init_from is None else os.path.relpath(init_from, ROOT),
            attn_init_std=args.attn_init_std,
            qk_init_std=args.qk_init_std,
            induction_init=args.induction_init,
            attn_lr_mult=args.attn_lr_mult,
            freeze_ssm_steps=args.freeze_ssm_steps,
        )
    (out / "training_log.json").write_text(
        json.dumps({"summary": summary, "log": log[:: max(1, len(log) // 400)]}, indent=1)
    )
    from model_card import write_model_card

    write_model_card(out, summary)
    print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
