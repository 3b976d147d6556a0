"""What the transitions of a delta-rule state cost: encode and decode time, and the accuracy a bf16 store costs.

    python benchmarks/delta_rule_encode.py [--lengths 256,1024] [--repeats 3] [--plot]
    python benchmarks/delta_rule_encode.py --size kimi-linear-4l   # Kimi delta attention (delta_rule_encode_kda.json)
    python benchmarks/delta_rule_encode.py --quick      # the tiny model, seconds: what the test runs

On the Qwen3.5-shaped random model of ``hybrid_ttft.py`` (``qwen3.5-4l``: 3 gated DeltaNet layers of 32 value
heads over 16 key heads of 128 + 1 attention layer, hidden 2048; random weights, no download), or its Kimi-Linear-
shaped one (``kimi-linear-4l``: 3 KDA layers of 32 heads of 128 + 1 MLA layer, hidden 2304), one thread:

* **encode**: ``hsc.encode`` of one context of each length, with the transitions (what the package does: every
  GDN layer runs its chunked scan on ``[S | M]``, values ``[v | 0]``, width v + k) and without them (the same path
  with the transitions switched off, ``models.gated_deltanet._TRACK_TRANSITIONS``: what a state without transitions
  would cost), against transformers' own prefill of the context (``model(ids, use_cache=True)``, stock, no state),
  all in the same run; medians. The ratio with / without is the transitions' cost.
* **decode**: ``model.generate`` of 32 new tokens (greedy) from one state of 256 tokens and an 8-token query, with
  every layer's transition kept up to date at each step (what the package does, so that a continued state can still
  be composed: one more product ``[k, k] @ [k, k]`` per layer, head and token) and without (the switch off): the
  ratio is what keeping the transitions costs generation.
* **bf16 transitions**: four contexts of 64 tokens, their states with the transitions rounded to bf16 (what a
  ``storage_dtype="bf16"`` store keeps) against float32, composed by ``caso`` / ``picaso_r`` / ``picaso_s``: the
  relative error of the composed states and of the next-token logits of a query. The states themselves stay in
  float32 here, so the figure is the transitions' rounding alone.

Writes benchmarks/results/delta_rule_encode.json (``delta_rule_encode_kda.json`` for the Kimi-Linear sizes).
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, str(HERE))

from hybrid_ttft import KDA_SIZES, build_model

import hf_statecompose as hsc
from hf_statecompose.benchmarking import git_commit, write_result
from hf_statecompose.models import gated_deltanet
from hf_statecompose.state.architectures import architecture
from hf_statecompose.state.fingerprint import architecture_of


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ids(length: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def encode_costs(model, lengths, repeats: int) -> list[dict]:
    vocab = model.config.vocab_size
    rows = []
    for length in lengths:
        ids = _ids(length, length, vocab)
        with torch.no_grad():
            hsc.encode(model, ids)  # warm-up
            with_m = _median(lambda: hsc.encode(model, ids), repeats)
            gated_deltanet._TRACK_TRANSITIONS = False
            try:
                without_m = _median(lambda: hsc.encode(model, ids), repeats)
            finally:
                gated_deltanet._TRACK_TRANSITIONS = True
            # the enabled model's mixers run the stock forward on transformers' own cache: its prefill, untouched
            stock = _median(lambda: model(ids, use_cache=True), repeats)
        rows.append(
            {
                "tokens": length,
                "seconds": {"with_transitions": with_m, "without_transitions": without_m, "stock_prefill": stock},
                "transitions_cost": with_m / without_m,
                "encode_over_stock": with_m / stock,
            }
        )
    return rows


def decode_costs(model, new_tokens: int, repeats: int) -> dict:
    vocab = model.config.vocab_size
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        state = hsc.encode(model, _ids(256, 5, vocab))
        query = _ids(8, 6, vocab)

        def generate():
            return model.generate(query, past_states=[state], **gen)

        generate()  # warm-up
        with_m = _median(generate, repeats)
        gated_deltanet._TRACK_TRANSITIONS = False
        try:
            without_m = _median(generate, repeats)
        finally:
            gated_deltanet._TRACK_TRANSITIONS = True
    return {
        "new_tokens": new_tokens,
        "seconds": {"with_transitions": with_m, "without_transitions": without_m},
        "ms_per_token": {
            "with_transitions": with_m / new_tokens * 1e3,
            "without_transitions": without_m / new_tokens * 1e3,
        },
        "transitions_cost": with_m / without_m,
    }


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bf16_costs(model) -> list[dict]:
    vocab = model.config.vocab_size
    with torch.no_grad():
        states = [hsc.encode(model, _ids(64, 100 + i, vocab)) for i in range(4)]
        rounded = []
        for state in states:
            copy = state.clone()
            copy.transitions = [m.to(torch.bfloat16).float() for m in copy.transitions]
            rounded.append(copy)
        query = _ids(8, 7, vocab)
        rows = []
        for method in ("caso", "picaso_r", "picaso_s"):
            exact = hsc.StateComposer(method).compose(states)
            approx = hsc.StateComposer(method).compose(rounded)
            logits = model(query, past_states=[exact]).logits[0, -1]
            logits_bf16 = model(query, past_states=[approx]).logits[0, -1]
            rows.append(
                {
                    "method": method,
                    "state_rel_error": max(_relative(a, b) for a, b in zip(approx.ssm_states, exact.ssm_states)),
                    "transition_rel_error": max(_relative(a, b) for a, b in zip(approx.transitions, exact.transitions)),
                    "logits_rel_error": _relative(logits_bf16, logits),
                    "same_argmax": bool(logits.argmax() == logits_bf16.argmax()),
                    "transition_max": max(float(m.abs().max()) for s in states for m in s.transitions),
                }
            )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="qwen3.5-4l", help="a delta-rule size of hybrid_ttft.py")
    parser.add_argument("--quick", action="store_true", help="the tiny model, one repeat (seconds; the test runs it)")
    parser.add_argument("--lengths", default="256,1024", help="context lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated in the decode timing")
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/delta_rule_encode[_kda].json)"
    )
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kda = args.size in KDA_SIZES
    size, repeats = (("kimi-linear-tiny" if kda else "qwen3.5-tiny"), 1) if args.quick else (args.size, args.repeats)
    out = args.out or str(HERE / "results" / ("delta_rule_encode_kda.json" if kda else "delta_rule_encode.json"))
    new_tokens = 4 if args.quick else args.new_tokens
    lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    model = build_model(size)
    layout = architecture(architecture_of(model))
    with (
        torch.no_grad()
    ):  # slow decays, as trained delta-rule layers keep a context (the random init forgets within tokens)
        for v in range(layout.num_state_layers(model.config)):
            layout.A_log_of(model.model, v).uniform_(-4.0, -2.0)
    params = sum(p.numel() for p in model.parameters())
    encode_rows = encode_costs(model, lengths, repeats)
    decode = decode_costs(model, new_tokens, repeats)
    bf16_rows = bf16_costs(model)
    print(
        f"{'Kimi Linear' if kda else 'Qwen3.5'} {size} ({params / 1e6:.0f}M parameters, random weights, slow decays); threads={torch.get_num_threads()}; "
        f"medians of {repeats}; shared machine: read the ratios\n"
    )
    print("| tokens | encode with transitions | without | transitions' cost | stock prefill | encode / stock |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in encode_rows:
        s = row["seconds"]
        print(
            f"| {row['tokens']} | {s['with_transitions'] * 1e3:.0f} ms | {s['without_transitions'] * 1e3:.0f} ms | "
            f"{row['transitions_cost']:.2f}x | {s['stock_prefill'] * 1e3:.0f} ms | {row['encode_over_stock']:.2f}x |"
        )
    d = decode["ms_per_token"]
    print(
        f"\ndecode, {new_tokens} tokens from one 256-token state: {d['with_transitions']:.1f} ms/token with the "
        f"transitions kept, {d['without_transitions']:.1f} without: {decode['transitions_cost']:.2f}x"
    )
    print(
        "\n| method (4 states of 64 tokens) | composed state, rel. error | transition | next-token logits | same argmax |"
    )
    print("|---|---:|---:|---:|---|")
    for row in bf16_rows:
        print(
            f"| {row['method']} | {row['state_rel_error']:.1e} | {row['transition_rel_error']:.1e} | "
            f"{row['logits_rel_error']:.1e} | {row['same_argmax']} |"
        )
    write_result(
        {
            "size": size,
            "params": params,
            "encode": encode_rows,
            "decode": decode,
            # the figure's bars (benchmarks/_plot.py): per length, the transitions' cost and encode against the stock prefill
            "rows": [
                row
                for r in encode_rows
                for row in (
                    {
                        "what": f"{r['tokens']} tokens: encode with / without transitions",
                        "ratio": r["transitions_cost"],
                    },
                    {"what": f"{r['tokens']} tokens: encode / transformers' prefill", "ratio": r["encode_over_stock"]},
                )
            ]
            + [
                {
                    "what": f"decode ({new_tokens} tokens): with / without transitions",
                    "ratio": decode["transitions_cost"],
                }
            ],
            "bf16": bf16_rows,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
            "note": "random weights with slow decays (A_log in [-4, -2]); shared 2-core machine: read the ratios",
        },
        out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(out, Path(out).name)


if __name__ == "__main__":
    main()
