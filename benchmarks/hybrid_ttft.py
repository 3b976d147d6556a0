"""Time to first token from k composed hybrid states against transformers' prefill of the contexts + query.

    python benchmarks/hybrid_ttft.py [--size granite-h-tiny-10l] [--ks 1,4,10] [--repeats 3] [--baseline-repeats 1]
    python benchmarks/hybrid_ttft.py --quick        # tiny model, seconds: what the test runs

    python benchmarks/hybrid_ttft.py --size qwen3.5-4l --composition picaso_r   # gated DeltaNet (delta_rule_ttft.json)
    python benchmarks/hybrid_ttft.py --size kimi-linear-4l --composition picaso_r   # Kimi delta attention (kda_ttft.json)

A Granite-4.0-H-shaped random model (transformers ``GraniteMoeHybridForCausalLM``, no download), or a Qwen3.5-shaped
one (``Qwen3_5ForCausalLM``: gated DeltaNet layers + attention, ``DELTA_RULE_SIZES``), or a Kimi-Linear-shaped one
(``KimiLinearForCausalLM``: Kimi delta attention layers + MLA, ``KDA_SIZES``), ``k`` contexts of 256 tokens
each encoded beforehand (``hsc.encode``, one state per context) and a 16-token query:

* TTFT: ``model.generate(query, past_states=states, composition=..., max_new_tokens=1)`` with states never seen
  before (fresh copies each time, as states just read from a store are): model fingerprint, the states' checks,
  composition of the SSM layers and of the attention layers (``"concat"``: keys one after the other), query
  prefill and the first token. "states seen before": the same with the same state objects each time (their
  checks are remembered).
* Where the time goes, each part timed alone in the same run: the fingerprint (``hsc.model_fingerprint``); the
  state checks (``check_against_model`` of the k fresh states: shapes, fingerprint, contents, ``A``); the SSM
  compose (``StateComposer(method, attention="none")`` of the checked states); the attention compose
  (``compose_attention(..., "concat")``: keys and values of all contexts, positions moved, RoPE keys re-rotated);
  the query prefill + first token from the one composed state.
* The baseline: stock ``model.generate(contexts + query, max_new_tokens=1)`` (transformers' prefill of the
  ``k·256 + 16`` tokens, no state), measured in the same run (no warm-up: it is slow).

Sizes: ``granite-h-tiny`` is Granite-4.0-H-Tiny's config (hidden 1536, 40 layers with attention at 5, 15, 25,
35: 12 query / 4 kv heads of 128, NoPE; Mamba-2 48 heads x 64, state 128; MoE 64 experts of 512, 6 active,
shared MLP 1024; vocab 100352): about 7B parameters, 28 GB in float32, more than this 2-core CPU machine can
hold or run in minutes. ``granite-h-tiny-10l`` keeps every width of it and its first 10 layers (9 Mamba-2,
1 attention: the same 1:9 ratio) with 8 experts instead of 64 (6 active, as in the model: the same compute per
token); ``tiny`` is a toy for the test. Medians; one thread by default (a shared machine: read the ratios).
Writes benchmarks/results/hybrid_ttft.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import statistics
import tempfile
import time

import torch

import hf_statecompose as hsc
from hf_statecompose.benchmarking import git_commit, median_time, write_result
from hf_statecompose.composition.attention import compose_attention
from hf_statecompose.state.validation import check_against_model

GRANITE_H_TINY_LAYERS = (
    ["mamba"] * 5
    + ["attention"]
    + ["mamba"] * 9
    + ["attention"]
    + ["mamba"] * 9
    + ["attention"]
    + ["mamba"] * 9
    + ["attention"]
    + ["mamba"] * 4
)
_GRANITE_H_TINY = dict(
    vocab_size=100352,
    hidden_size=1536,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=512,
    shared_intermediate_size=1024,
    num_experts_per_tok=6,
    mamba_n_heads=48,
    mamba_d_head=64,
    mamba_d_state=128,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    position_embedding_type="nope",
    tie_word_embeddings=True,
)
SIZES = {
    "tiny": dict(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        shared_intermediate_size=64,
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        position_embedding_type="nope",
    ),
    "granite-h-tiny-10l": dict(
        _GRANITE_H_TINY, num_hidden_layers=10, layer_types=GRANITE_H_TINY_LAYERS[:10], num_local_experts=8
    ),
    "granite-h-tiny": dict(
        _GRANITE_H_TINY, num_hidden_layers=40, layer_types=GRANITE_H_TINY_LAYERS, num_local_experts=64
    ),
}
# Qwen3.5-shaped (transformers' Qwen3_5ForCausalLM: gated DeltaNet layers + attention, issue 31): the GDN widths of
# Qwen3-Next / Qwen3.5 (32 value heads over 16 key heads of 128, conv 4; attention 16 query / 2 kv heads of 256,
# partial RoPE 0.25) at hidden 2048, one block of 3 GDN layers + 1 attention layer, a dense MLP of 6144 and a
# 32k vocabulary: 0.3B parameters, what this CPU runs a 2,576-token prefill of in about a minute
_QWEN3_5 = dict(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_value_heads=32,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
)
DELTA_RULE_SIZES = {
    "qwen3.5-4l": dict(_QWEN3_5, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "qwen3.5-tiny": dict(
        _QWEN3_5,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    ),
}
# Kimi-Linear-shaped (transformers' KimiLinearForCausalLM: Kimi delta attention layers + MLA): Kimi-Linear-48B-A3B's
# widths (hidden 2304; KDA 32 heads of 128, conv 4; MLA 32 heads, latent 512, rotary part 64, no positional
# encoding), one block of 3 KDA layers + 1 MLA layer, its MoE replaced by a dense MLP of 9216 and a 32k vocabulary
_KIMI_LINEAR = dict(
    vocab_size=32768,
    hidden_size=2304,
    intermediate_size=9216,
    num_attention_heads=32,
    num_key_value_heads=32,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    q_lora_rank=None,
    linear_num_heads=32,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
)
KDA_SIZES = {
    "kimi-linear-4l": dict(
        _KIMI_LINEAR,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] * 4,
    ),
    "kimi-linear-tiny": dict(
        _KIMI_LINEAR,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense"] * 3,
    ),
}
DELTA_RULE_SIZES.update(KDA_SIZES)
SIZES.update(DELTA_RULE_SIZES)
CONTEXT_TOKENS, QUERY_TOKENS = 256, 16


def context_ids(i: int) -> torch.Tensor:
    """Context ``i``: 256 token ids in 3..63 (a toy text, one id per character), distinct per context."""
    words = f"passage{i} about topic{i} and the shared word with filler text number {i} "
    text = (words * (CONTEXT_TOKENS // len(words) + 1))[:CONTEXT_TOKENS]
    return torch.tensor([[3 + ord(c) % 61 for c in text]])


def build_model(size: str):
    from transformers import (
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        KimiLinearConfig,
        KimiLinearForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
    )

    config_class, model_class = (
        (KimiLinearConfig, KimiLinearForCausalLM)
        if size in KDA_SIZES
        else (Qwen3_5TextConfig, Qwen3_5ForCausalLM)
        if size in DELTA_RULE_SIZES
        else (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM)
    )
    config = config_class(**SIZES[size], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    return hsc.enable(model_class(config).eval())


def run(size: str, ks: list[int], repeats: int, baseline_repeats: int, method: str) -> dict:
    started = time.perf_counter()
    model = build_model(size)
    params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - started
    contexts = [context_ids(i) for i in range(max(ks))]
    query = torch.tensor([[3 + ord(c) % 61 for c in "the shared word?"[:QUERY_TOKENS].ljust(QUERY_TOKENS, "?")]])
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    started = time.perf_counter()
    with torch.no_grad():
        encoded = [hsc.encode(model, ids) for ids in contexts]
    encode_s = time.perf_counter() - started
    ssm_composer = hsc.StateComposer(method, attention="none")

    rows = []
    for k in ks:
        states = encoded[:k]
        fresh = []  # one list of never-seen state copies per timed call (copied outside the timing)

        def fresh_states():
            return fresh.pop() if fresh else [s.clone() for s in states]

        def refill(n):
            fresh[:] = [[s.clone() for s in states] for _ in range(n)]

        with torch.no_grad():
            first = model.generate(query, past_states=fresh_states(), composition=method, **gen)
            composed = hsc.compose_states(states, method, model=model)
            fingerprint = hsc.model_fingerprint(model)
            check_against_model(composed, model, fingerprint, contents=False)
            ssm_only = ssm_composer.compose(states, model=model)

            def ttft():
                return model.generate(query, past_states=fresh_states(), composition=method, **gen)

            def checks():
                for state in fresh_states():
                    check_against_model(state, model, fingerprint)

            parts = {}
            refill(repeats + 1)
            parts["ttft"] = median_time(ttft, repeats, warmup=1)
            parts["ttft_states_seen"] = median_time(
                lambda: model.generate(query, past_states=states, composition=method, **gen), repeats, warmup=1
            )
            parts["fingerprint"] = median_time(lambda: hsc.model_fingerprint(model), repeats)
            refill(repeats)
            parts["state_checks"] = median_time(checks, repeats)
            parts["ssm_compose"] = median_time(lambda: ssm_composer.compose(states, model=model), repeats)
            parts["attention_compose"] = median_time(
                lambda: compose_attention(ssm_only, states, "concat", model), repeats
            )
            parts["query_prefill_first_token"] = median_time(
                lambda: model.generate(query, past_states=[composed], composition=method, **gen), repeats
            )
            concat = torch.cat(contexts[:k] + [query], 1)
            times, baseline_first = [], None
            for _ in range(baseline_repeats):
                start = time.perf_counter()
                baseline_first = model.generate(concat, **gen)
                times.append(time.perf_counter() - start)
        parts["baseline_prefill"] = statistics.median(times) if times else None
        accounted = sum(
            parts[p]
            for p in ("fingerprint", "state_checks", "ssm_compose", "attention_compose", "query_prefill_first_token")
        )
        rows.append(
            {
                "k": k,
                "context_tokens": k * CONTEXT_TOKENS,
                "query_tokens": QUERY_TOKENS,
                "baseline_tokens": concat.shape[1],
                "composed_keys": composed.context_length,
                "seconds": parts,
                "parts_sum": accounted,
                "baseline_runs": len(times),
                "speedup": parts["baseline_prefill"] / parts["ttft"] if times else None,
                "speedup_states_seen": parts["baseline_prefill"] / parts["ttft_states_seen"] if times else None,
                "first_token": int(first[0, -1]),
                "baseline_first_token": int(baseline_first[0, -1]) if baseline_first is not None else None,
            }
        )
    for row in rows:
        row["ttft_over_k1"] = row["seconds"]["ttft"] / rows[0]["seconds"]["ttft"]
    return {
        "size": size,
        "params": params,
        "config": SIZES[size],
        "build_s": build_s,
        "encode_s": encode_s,
        "rows": rows,
    }


def _result_name(size: str) -> str:
    return (
        "kda_ttft.json"
        if size in KDA_SIZES
        else "delta_rule_ttft.json"
        if size in DELTA_RULE_SIZES
        else "hybrid_ttft.json"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="granite-h-tiny-10l", choices=list(SIZES))
    parser.add_argument("--quick", action="store_true", help="the tiny model, one repeat (seconds; the test runs it)")
    parser.add_argument("--ks", default="1,4,10", help="numbers of contexts, comma-separated, ascending")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each timing of the state path (median)")
    parser.add_argument(
        "--baseline-repeats", type=int, default=1, help="repeats of transformers' prefill (slow; no warm-up)"
    )
    parser.add_argument("--composition", default="picaso_r", help="the SSM layers' composition method")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1: a shared machine)")
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/hybrid_ttft.json; --quick: a temp file)"
    )
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    delta_rule = args.size in DELTA_RULE_SIZES
    quick_size = "kimi-linear-tiny" if args.size in KDA_SIZES else "qwen3.5-tiny" if delta_rule else "tiny"
    size, repeats, baseline_repeats = (
        (quick_size, 1, 1) if args.quick else (args.size, args.repeats, args.baseline_repeats)
    )
    ks = sorted(int(k) for k in args.ks.split(",") if k.strip())
    torch.set_num_threads(args.threads)
    result = run(size, ks, repeats, baseline_repeats, args.composition)
    family = (
        "Kimi Linear (Kimi delta attention)"
        if size in KDA_SIZES
        else "Qwen3.5 (gated DeltaNet)"
        if size in DELTA_RULE_SIZES
        else "GraniteMoeHybrid"
    )
    print(
        f"{family} {size} ({result['params'] / 1e6:.0f}M parameters, random weights); k contexts of "
        f"{CONTEXT_TOKENS} tokens + a {QUERY_TOKENS}-token query; SSM layers {args.composition}, attention layers "
        f"concat; threads={torch.get_num_threads()}; medians of {repeats} (baseline {baseline_repeats}); shared machine: "
        "read the ratios"
    )
    print(
        "| k | TTFT | TTFT (states seen) | baseline prefill | speedup | speedup (seen) | TTFT/TTFT(k=1) | fingerprint "
        "| state checks | SSM compose | attention compose | query prefill + 1st token |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["rows"]:
        s = row["seconds"]
        ms = lambda key: f"{s[key] * 1e3:.1f} ms"
        base = "not run" if s["baseline_prefill"] is None else f"{s['baseline_prefill']:.2f} s"
        speed = lambda v: "-" if v is None else f"{v:.1f}x"
        print(
            f"| {row['k']} | {ms('ttft')} | {ms('ttft_states_seen')} | {base} | {speed(row['speedup'])} | "
            f"{speed(row['speedup_states_seen'])} | {row['ttft_over_k1']:.2f} | {ms('fingerprint')} | {ms('state_checks')} | "
            f"{ms('ssm_compose')} | {ms('attention_compose')} | {ms('query_prefill_first_token')} |"
        )
    out = args.out or (
        str(Path(tempfile.gettempdir()) / "hybrid-ttft-quick.json")
        if args.quick
        else str(HERE / "results" / _result_name(args.size))
    )
    write_result(
        {
            "result": result,
            "ks": ks,
            "composition": args.composition,
            "attention": "concat",
            "repeats": repeats,
            "baseline_repeats": baseline_repeats,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
            "note": "shared 2-core machine (other processes running): the ratios within one run are the figure to read",
        },
        out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(out, _result_name(args.size))


if __name__ == "__main__":
    main()
