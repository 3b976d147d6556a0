"""COFFEE under state composition: does the trained induction-head model still recall the target when its
context state is composed with the state of more noise, instead of reading the concatenation?

    python benchmarks/coffee_composition.py [--model checkpoints/coffee/ih-coffee] [--sequences 2000]

With state feedback the state of a concatenation is not a weighted sum of the contexts' states (the gates
depend on the state), so CASO / PICASO are approximations here: they weight each context's state with the
decay Π_k (1 + λΔ(k)) recorded when that context was encoded alone, from a zero state. This measures how good
an approximation that is on the task the model was trained for.

For ``--sequences`` fresh IH sequences ``noise1 ‖ trigger ‖ target ‖ noise2 ‖ trigger`` (the model's task, from
``task.json`` beside the checkpoint, else the recipe's results file, else ``InductionHeadTask()`` defaults):

* context A = the sequence without its last trigger, query = the last trigger. One state of A + the query must
  reproduce the full sequence (exactness check, also the model's own accuracy, row ``A (one state)``);
* context B = ``m`` more noise symbols (uniform over V without the trigger; ``--noise`` lengths). The truth is
  the model reading ``A ‖ B ‖ trigger`` (``concat``: re-encoding the concatenation, exact by construction) or
  ``B ‖ A ‖ trigger`` (noise first: still a valid IH sequence, longer than in training); the compositions of
  the two stored states are ``soup``, ``caso``, ``picaso_s``, ``picaso_r`` and ``piconcat_r``.

Per method and noise length: the target recall accuracy (argmax at the query = the target), agreement with
the concatenation's prediction, and the relative distance of the composed state to the concatenation's
state (max |difference| / max |state|, all layers). Order-dependent methods (``caso``, ``concat``) are
reported for both orders (A, B) and (B, A). Writes benchmarks/results/coffee/composition.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

import argparse
import json

import torch

import hf_statecompose as hsc
from hf_statecompose.benchmarking import git_commit, write_result
from hf_statecompose.demo.induction_head import InductionHeadTask

METHODS = ("soup", "caso", "picaso_s", "picaso_r", "piconcat_r", "concat")


def load_task(model_dir: Path) -> InductionHeadTask:
    """The task the checkpoint was trained on: ``task.json`` beside it, else the ``task`` of the recipe's
    results file ``benchmarks/results/coffee/<name>.json``, else the generator's defaults."""
    for path in (model_dir / "task.json", HERE / "results" / "coffee" / f"{model_dir.name}.json"):
        if path.exists():
            spec = json.loads(path.read_text())
            spec = dict(spec.get("task", spec))
            spec.pop("pad", None)
            return InductionHeadTask(**spec)
    return InductionHeadTask()


def noise(task: InductionHeadTask, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    """Noise symbols uniform over V without the trigger's symbols."""
    allowed = torch.tensor([s for s in range(1, task.vocab + 1) if s not in task.trigger])
    return allowed[torch.randint(0, len(allowed), (batch, length), generator=g)]


def state_distance(a, b) -> float:
    diff = max(float((x - y).abs().max()) for x, y in zip(a.ssm_states, b.ssm_states))
    scale = max(float(y.abs().max()) for y in b.ssm_states)
    return diff / max(scale, 1e-30)


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "checkpoints" / "coffee" / "ih-coffee"))
    parser.add_argument("--sequences", type=int, default=2000)
    parser.add_argument("--noise", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "results" / "coffee" / "composition.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    model = hsc.CoffeeForCausalLM.from_pretrained(model_dir).eval()
    hsc.enable(model)
    task = load_task(model_dir)
    g = torch.Generator().manual_seed(args.seed)
    batch = task.sample(args.sequences, g)
    ids, target = batch["input_ids"], batch["target"][:, 0]
    if task.target_len != 1:
        raise SystemExit("this measurement is written for target_len = 1")
    context_a, query = ids[:, :-1], ids[:, -1:]
    state_a = hsc.ComposableMambaCache.encode(model, context_a)

    full = model(ids).logits[:, -1]
    one = model(query, past_states=[state_a]).logits[:, -1]
    exact_error = float((one - full).abs().max() / full.abs().max())
    rows = [
        {
            "noise": 0,
            "order": "A",
            "method": "A (one state)",
            "accuracy": float((one.argmax(-1) == target).float().mean()),
            "agreement_with_concat": float((one.argmax(-1) == full.argmax(-1)).float().mean()),
            "state_distance": 0.0,
            "logit_error_vs_full_sequence": exact_error,
        }
    ]
    for m in args.noise:
        context_b = noise(task, args.sequences, m, g)
        state_b = hsc.ComposableMambaCache.encode(model, context_b)
        for order, states, concat_ids in (
            ("A,B", [state_a, state_b], torch.cat([context_a, context_b], 1)),
            ("B,A", [state_b, state_a], torch.cat([context_b, context_a], 1)),
        ):
            truth_state = hsc.ComposableMambaCache.encode(model, concat_ids)
            truth = model(torch.cat([concat_ids, query], 1)).logits[:, -1].argmax(-1)
            for method in METHODS:
                if order == "B,A" and method in ("soup", "picaso_s", "picaso_r", "piconcat_r"):
                    continue  # order-invariant: the same as for (A, B)
                composed = hsc.compose_states(states, method, model)
                pred = model(query, past_states=states, composition=method).logits[:, -1].argmax(-1)
                rows.append(
                    {
                        "noise": m,
                        "order": order if method in ("caso", "concat") else "any",
                        "method": method,
                        "accuracy": float((pred == target).float().mean()),
                        "agreement_with_concat": float((pred == truth).float().mean()),
                        "state_distance": state_distance(composed, truth_state),
                    }
                )
            rows.append(
                {
                    "noise": m,
                    "order": order,
                    "method": "model on the concatenation (truth)",
                    "accuracy": float((truth == target).float().mean()),
                    "agreement_with_concat": 1.0,
                    "state_distance": 0.0,
                }
            )
            print(f"noise {m}, order {order}: done", flush=True)
    print(
        f"\nCOFFEE IH model {model_dir.name}: target recall from composed states, {args.sequences} fresh sequences "
        f"(task {task.to_dict()}); one state of A + query vs the full sequence: logits within {exact_error:.1e} "
        "relative"
    )
    print("| extra noise m | order | method | target recall | agrees with concat | state distance to concat |")
    print("|---:|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['noise']} | {r['order']} | {r['method']} | {r['accuracy']:.3f} | {r['agreement_with_concat']:.3f} "
            f"| {r['state_distance']:.2e} |"
        )
    write_result(
        {
            "rows": rows,
            "model": str(model_dir.relative_to(ROOT) if model_dir.is_relative_to(ROOT) else model_dir),
            "task": task.to_dict(),
            "sequences": args.sequences,
            "seed": args.seed,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "coffee/composition.json")


if __name__ == "__main__":
    main()
