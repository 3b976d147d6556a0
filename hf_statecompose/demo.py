"""The main job on an embedded tiny model: encode contexts once, store them, compose, generate.

    python -m hf_statecompose.demo [--arch mamba2|mamba] [--method picaso_r] [--max-new-tokens 24]

The embedded model is a tiny *random-weight* byte-level Mamba / Mamba-2 built from a fixed seed (no
download): its text is meaningless, so the demo shows the mechanics and checks the exactness the
library promises (one state + query == the concatenation), and times composition against re-reading
the contexts. Retrieval over a real corpus and a trained default model come with the database issue.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

import hf_statecompose as hsc

CONTEXTS = [
    "State space models carry a fixed-size state from token to token.",
    "PICASO composes the states of several contexts without reading them again.",
    "A conv window holds the last few inputs of the short causal convolution.",
]
QUERY = "Question: what do the contexts say?\nAnswer:"


class ByteTokenizer:
    """UTF-8 bytes as token ids 3..258 (0 pad, 1 eos, 2 bos): enough for a demo, no download."""

    pad_token_id, eos_token_id, bos_token_id, vocab_size = 0, 1, 2, 259

    def encode(self, text: str) -> torch.LongTensor:
        return torch.tensor([[b + 3 for b in text.encode("utf-8")]], dtype=torch.long)

    def decode(self, ids, **kwargs) -> str:
        data = bytes(int(i) - 3 for i in (ids.tolist() if torch.is_tensor(ids) else ids) if 3 <= int(i) < 259)
        return data.decode("utf-8", errors="replace")


def embedded_model(arch: str = "mamba2", seed: int = 0):
    """A deterministic tiny random model (4 layers, hidden 64) for the byte tokenizer."""
    torch.manual_seed(seed)
    common = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, num_hidden_layers=4, state_size=16,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if arch == "mamba":
        model = MambaForCausalLM(MambaConfig(**common))
    elif arch == "mamba2":
        model = Mamba2ForCausalLM(Mamba2Config(**common, num_heads=8, head_dim=16, n_groups=1, chunk_size=64))
    else:
        raise ValueError(f"unknown arch {arch!r}; choose 'mamba' or 'mamba2'")
    return hsc.enable(model.eval())


def composer_for(method: str, n: int) -> "hsc.StateComposer":
    """``weighted`` needs weights: the demo gives every context the same one."""
    return hsc.StateComposer(method, weights=[1 / n] * n if method == "weighted" else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mamba2", choices=["mamba", "mamba2"])
    parser.add_argument("--method", default="picaso_r", choices=list(hsc.METHODS))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    tok = ByteTokenizer()
    model = embedded_model(args.arch)
    print(f"model: tiny random {args.arch} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters), byte tokenizer")

    with torch.no_grad(), tempfile.TemporaryDirectory() as store:
        # 1. encode each context once and store it (safetensors + JSON metadata)
        for i, text in enumerate(CONTEXTS):
            state = hsc.ComposableMambaCache.encode(model, tok.encode(text))
            hsc.ComposableMambaCache.save(state, Path(store) / f"ctx{i}.safetensors")
        # 2. later: load the states (checked against the model), no token of the contexts is read again
        states = [hsc.ComposableMambaCache.load(Path(store) / f"ctx{i}.safetensors", model=model) for i in range(len(CONTEXTS))]
        print(f"stored {len(states)} states: " + ", ".join(f"{int(s.num_tokens[0])} tokens" for s in states))

        query = tok.encode(QUERY)
        # 3. exactness: one state + query generates exactly what context + query generates
        alone = model.generate(query, past_states=states[:1], max_new_tokens=args.max_new_tokens, do_sample=False)
        full = model.generate(torch.cat([tok.encode(CONTEXTS[0]), query], 1), max_new_tokens=args.max_new_tokens, do_sample=False)
        same = torch.equal(alone, full[:, -alone.shape[1]:])
        print(f"one state + query == generate(context + query): {same}")

        # 4. compose all contexts and generate; compare the cost with re-reading the concatenation
        composer = composer_for(args.method, len(states))
        composer.compose(states, model=model)  # warm-up (first-call allocations)
        t0 = time.perf_counter()
        composed = composer.compose(states, model=model)
        compose_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        model(torch.cat([tok.encode(c) for c in CONTEXTS], 1), use_cache=True, logits_to_keep=1)
        concat_s = time.perf_counter() - t0
        out = model.generate(query, past_states=[composed], max_new_tokens=args.max_new_tokens, do_sample=False)
        print(f"composed with {args.method}: {compose_s * 1e3:.2f} ms (prefill of the concatenation: {concat_s * 1e3:.2f} ms)")
        print("query:     ", QUERY.replace("\n", "\\n"))
        print("generated: ", repr(tok.decode(out[0, query.shape[1]:])), "(random weights: meaningless text)")
        for method in hsc.METHODS:
            out = model.generate(query, past_states=states, composition=composer_for(method, len(states)), max_new_tokens=8, do_sample=False)
            print(f"  {method:<10} -> first new token ids {out[0, query.shape[1]:].tolist()}")
    if not same:
        raise SystemExit("exactness check failed")


if __name__ == "__main__":
    main()
