"""Training speed on CPU: the Mamba-1 scan's hand-written backward, and a demo-sized training step.

    python benchmarks/training_scan.py [--repeats 3]

1. Forward + backward of the selective scan (batch 8, 256 tokens, D 512, N 16, fp32): ours
   (``selective_scan`` under autograd: sequential scan + adjoint backward) against autograd through the
   plain reference loop (``selective_scan_ref``), same inputs, same run; gradients compared too.
2. One AdamW training step of the demo-sized models (hidden 256, 6 layers, batch 8 × 256 tokens):
   through hf_statecompose's path (``cache=ComposableMambaCache.empty_for(model)``, what
   ``recipes/train_demo.py`` does) against stock transformers' forward, same run.
Medians of ``--repeats`` after one warm-up. Writes benchmarks/results/training_scan.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse

import torch

import hf_statecompose as hsc
from hf_statecompose.benchmarking import median_time, write_result
from hf_statecompose.ops.selective_scan import selective_scan, selective_scan_ref


def timed(fn, repeats):
    return median_time(fn, repeats, warmup=1)


def scan_case(repeats):
    g = torch.Generator().manual_seed(0)
    batch, channels, state, length = 8, 512, 16, 256
    leaves = [
        torch.randn(batch, channels, length, generator=g),
        torch.randn(batch, channels, length, generator=g) - 2,
        -torch.rand(channels, state, generator=g) * 4,
        torch.randn(batch, state, length, generator=g),
        torch.randn(batch, state, length, generator=g),
    ]
    leaves = [t.requires_grad_(True) for t in leaves]

    def run(fn):
        def step():
            y = fn(*leaves, delta_softplus=True)[0]
            return torch.autograd.grad(y.square().mean(), leaves)

        return step

    ours, ref = timed(run(selective_scan), repeats), timed(run(selective_scan_ref), repeats)
    error = max(
        float((a - b).abs().max() / b.abs().max()) for a, b in zip(run(selective_scan)(), run(selective_scan_ref)())
    )
    return {"ours_s": ours, "reference_autograd_s": ref, "speedup": ref / ours, "max_relative_grad_difference": error}


def step_case(arch, repeats):
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=6, expand=2, tie_word_embeddings=True)
    model = (
        Mamba2ForCausalLM(Mamba2Config(**common, state_size=64, num_heads=8, head_dim=64, n_groups=1, chunk_size=64))
        if arch == "mamba2"
        else MambaForCausalLM(MambaConfig(**common, state_size=16))
    )
    hsc.enable(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), 1e-4)
    ids = torch.randint(0, 4096, (8, 256), generator=torch.Generator().manual_seed(1))

    def step(ours):
        def run():
            extra = (
                dict(use_cache=True, **hsc.compat.cache_kwargs(hsc.ComposableMambaCache.empty_for(model)))
                if ours
                else {}
            )
            model(input_ids=ids, labels=ids, **extra).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return run

    ours = timed(step(True), repeats)
    stock = timed(step(False), max(1, repeats // 3) if arch == "mamba" else repeats)
    return {"ours_s": ours, "transformers_s": stock, "speedup": stock / ours, "tokens_per_s_ours": ids.numel() / ours}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "training_scan.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    result = {
        "scan": scan_case(args.repeats),
        "step": {a: step_case(a, args.repeats) for a in ("mamba2", "mamba")},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    s = result["scan"]
    print(
        f"selective scan fwd+bwd (8x512x16, 256 tokens): ours {s['ours_s']:.3f} s, autograd through the reference loop "
        f"{s['reference_autograd_s']:.3f} s, speed-up {s['speedup']:.1f}x, max rel. grad difference {s['max_relative_grad_difference']:.1e}"
    )
    print("| arch | ours (s/step) | transformers (s/step) | speed-up | tokens/s (ours) |\n|---|---:|---:|---:|---:|")
    for arch, r in result["step"].items():
        print(
            f"| {arch} | {r['ours_s']:.2f} | {r['transformers_s']:.2f} | {r['speedup']:.1f}x | {r['tokens_per_s_ours']:.0f} |"
        )
    write_result(result, args.out)
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "training_scan.json")


if __name__ == "__main__":
    main()
