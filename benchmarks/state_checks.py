"""Cost of checking in-memory states (issue 21): ``compose`` / ``generate(past_states=)`` check every state as a
state file is checked, once per state object.

    python benchmarks/state_checks.py [--repeats 15] [--threads 1]

Rows (median wall time; the candidates of a group run interleaved, so load swings of a shared machine hit
them alike): ``generate`` of 8 tokens from k = 10 tiny states (Mamba, Mamba-2; hidden 32, 2 layers), the
states reused across calls or never seen before (fresh clones; the clones alone are timed too); ``compose``
(picaso_r) of 10 states of Mamba-2 130M shapes (24 layers, 24 heads x 64 x 128, random weights, nothing
downloaded), reused or never seen; ``check_state`` of one such state, and the remembered check of ten
already-checked ones (what a reused state costs per call). Runs on older commits too (rows that need the
remembered check are skipped there), so before / after compare with the same script.
Writes benchmarks/results/state_checks.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import statistics

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer
from hf_statecompose.benchmarking import git_commit, median_time, write_result
from hf_statecompose.state import validation


def interleaved(fns, repeats: int) -> list[float]:
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            bucket.append(fn())
    return [statistics.median(bucket) for bucket in times]


def timed(fn):
    return lambda: median_time(fn, 1)


def tiny(arch):
    torch.manual_seed(0)
    if arch == "mamba":
        model = MambaForCausalLM(
            MambaConfig(vocab_size=99, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2)
        )
    else:
        model = Mamba2ForCausalLM(
            Mamba2Config(
                vocab_size=99,
                hidden_size=32,
                state_size=8,
                num_hidden_layers=2,
                expand=2,
                num_heads=8,
                head_dim=8,
                n_groups=2,
                chunk_size=16,
            )
        )
    return hsc.enable(model.eval())


def delta_rule_rows(repeats: int, g) -> list[dict]:
    """Issue 41: the delta-rule transitions' bound (a Cholesky test per head) against what loading the state costs,
    on a Qwen3.5-shaped state (3 gated-DeltaNet layers of 32 value heads of 128 x 128, random weights, 8 tokens)."""
    import tempfile

    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        from hf_statecompose.state.architectures import _check_transition_values
    except ImportError:  # an older commit: no delta-rule states
        return []
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=32,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    model = hsc.enable(AutoModelForCausalLM.from_config(config).eval())
    with torch.no_grad():
        state = hsc.encode(model, torch.randint(3, 1000, (1, 8), generator=g))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/s.safetensors"
        state.save(path)
        load = type(state).load
        rows.append(
            {
                "case": "load a Qwen3.5-shaped state file (3 GDN layers of 32 x 128 x 128), checks included",
                "ms": median_time(lambda: load(path), repeats, warmup=1) * 1e3,
            }
        )
    layers = [(state.transitions[v], (state.delta_sums[v], state.A[v])) for v in range(state.num_layers)]

    import inspect

    # an older commit's check takes no decay (it only bounded the entries by 1): time what it does
    takes_decay = "decay" in inspect.signature(_check_transition_values).parameters

    def bound_only():
        for transition, decay in layers:
            extra = {"decay": decay} if takes_decay else {}
            _check_transition_values({"transitions": transition}, 0, None, config=None, encoded=True, **extra)

    rows.append(
        {
            "case": "  of which the transitions' value check (3 layers)",
            "ms": median_time(bound_only, repeats, warmup=1) * 1e3,
        }
    )
    once = validation.check_state_once
    once(state)
    rows.append(
        {
            "case": "remembered check of that state (its contents' digest, per use)",
            "ms": median_time(lambda: once(state), repeats, warmup=1) * 1e3,
        }
    )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: on a shared machine more threads mostly measure contention)",
    )
    parser.add_argument("--out", default=str(HERE / "results" / "state_checks.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    once = getattr(validation, "check_state_once", None)

    for arch in ("mamba", "mamba2"):
        model = tiny(arch)
        with torch.no_grad():
            states = [ComposableMambaCache.encode(model, torch.randint(3, 99, (1, 16), generator=g)) for _ in range(10)]
        query = torch.randint(3, 99, (1, 4), generator=g)

        def generate(past):
            return model.generate(query, past_states=past, max_new_tokens=8, do_sample=False)

        generate(states)
        reused, fresh, clones = interleaved(
            [
                timed(lambda: generate(states)),
                timed(lambda: generate([s.clone() for s in states])),
                timed(lambda: [s.clone() for s in states]),
            ],
            args.repeats,
        )
        rows += [
            {"case": f"generate tiny {arch}, k=10 states reused", "ms": reused * 1e3},
            {"case": f"generate tiny {arch}, k=10 never-seen states (incl. cloning)", "ms": fresh * 1e3},
            {"case": f"  cloning 10 tiny {arch} states alone", "ms": clones * 1e3},
        ]

    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=50288,
        hidden_size=768,
        num_hidden_layers=24,
        state_size=128,
        expand=2,
        head_dim=64,
        num_heads=24,
        n_groups=1,
        conv_kernel=4,
        chunk_size=256,
    )
    model = hsc.enable(Mamba2ForCausalLM(config).eval())
    with torch.no_grad():
        states = [ComposableMambaCache.encode(model, torch.randint(3, 50000, (1, 8), generator=g)) for _ in range(10)]
    composer = StateComposer("picaso_r")
    composer.compose(states)
    spare = []

    def never_seen():
        batch = spare.pop()
        return median_time(lambda: composer.compose(batch), 1)

    def refill():
        spare[:] = [[s.clone() for s in states] for _ in range(args.repeats)]

    refill()
    reused, fresh = interleaved([timed(lambda: composer.compose(states)), never_seen], args.repeats)
    rows += [
        {"case": "compose picaso_r, 10 Mamba-2 130M-shaped states reused", "ms": reused * 1e3},
        {"case": "compose picaso_r, 10 Mamba-2 130M-shaped states never seen", "ms": fresh * 1e3},
    ]
    one = states[0].clone()
    rows.append(
        {
            "case": "check_state of one Mamba-2 130M-shaped state",
            "ms": median_time(lambda: validation.check_state(one), args.repeats, warmup=1) * 1e3,
        }
    )
    if once is not None:
        rows.append(
            {
                "case": "remembered check of 10 checked Mamba-2 130M-shaped states (per call)",
                "ms": median_time(lambda: [once(s) for s in states], args.repeats, warmup=1) * 1e3,
            }
        )
    rows += delta_rule_rows(args.repeats, g)
    for row in rows:
        print(f"{row['case']:<75} {row['ms']:9.2f} ms")
    write_result({"commit": git_commit(), "threads": args.threads, "repeats": args.repeats, "rows": rows}, args.out)
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "state_checks.json")


if __name__ == "__main__":
    main()
