"""Cost of the state-safety checks on a 130M-shaped Mamba (random init, CPU unless --device).

    python benchmarks/fingerprint_speed.py [--repeats 7] [--device cpu]

* fingerprint: the full hash (every weight's bytes; ``model_fingerprint(model, cache=False)``) against
  the cached path (what every ``generate``/``encode`` pays: the cache key, i.e. config + tensor
  identities + a content checksum, one sum and a 64-element strided sample per tensor), in fp32 and bf16;
* a state's checks: ``check_against_model`` (shapes, fingerprint comparison, ``A`` against the model's
  ``-exp(A_log)``) and ``check_state`` (full schema and values), against ``load`` of the same state file,
  which runs both.

Ratios are against the baseline measured in the same run (full hash; load). The machine may be shared:
absolute times are noisy, ratios less so. Writes benchmarks/results/fingerprint_speed.json.
"""
from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import tempfile

import torch
from transformers import MambaConfig, MambaForCausalLM

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache
from hf_statecompose.benchmarking import git_commit, median_time, write_result
from hf_statecompose.state.fingerprint import model_fingerprint
from hf_statecompose.state.validation import check_against_model, check_state


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(HERE / "results" / "fingerprint_speed.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=768, num_hidden_layers=24, vocab_size=50280)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = hsc.enable(MambaForCausalLM(config).to(args.device, dtype).eval())
        params = sum(p.numel() for p in model.parameters())
        full = median_time(lambda: model_fingerprint(model, cache=False), args.repeats, args.device)
        model_fingerprint(model)
        cached = median_time(lambda: model_fingerprint(model), args.repeats * 3, args.device, warmup=1)
        rows.append({"what": f"fingerprint, {str(dtype)[6:]}", "baseline": "full hash", "baseline_s": full,
                     "s": cached, "ratio": cached / full, "params": params})
        if dtype != torch.float32:
            continue
        with torch.no_grad():
            state = ComposableMambaCache.encode(model, torch.randint(3, 50000, (1, 32), device=args.device))
        fingerprint = model_fingerprint(model)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "state.safetensors"
            state.save(path)
            load = median_time(lambda: ComposableMambaCache.load(path, model=model), args.repeats, args.device, warmup=1)
        against = median_time(lambda: check_against_model(state, model, fingerprint), args.repeats * 3, args.device, warmup=1)
        schema = median_time(lambda: check_state(state), args.repeats * 3, args.device, warmup=1)
        for what, seconds in (("check_against_model (incl. A)", against), ("check_state (schema, values)", schema)):
            rows.append({"what": what, "baseline": "load(path, model)", "baseline_s": load, "s": seconds, "ratio": seconds / load})
    print(f"130M-shaped Mamba ({rows[0]['params'] / 1e6:.0f}M parameters), {args.device}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}+ runs (shared machine: noisy)")
    print("| what | time | baseline | baseline time | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['s'] * 1e3:.1f} ms | {r['baseline']} | {r['baseline_s'] * 1e3:.1f} ms | {r['ratio']:.3f} |")
    write_result({"rows": rows, "device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "commit": git_commit(), "note": "shared machine: absolute times are noisy"}, args.out)


if __name__ == "__main__":
    main()
