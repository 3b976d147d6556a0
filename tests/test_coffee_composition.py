"""benchmarks/coffee_composition.py on the shipped IH checkpoint, small: the exact rows are exact, the
approximations are measurably approximations."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_script():
    spec = importlib.util.spec_from_file_location("coffee_composition", os.path.join(ROOT, "benchmarks", "coffee_composition.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_composition_measurement_on_the_trained_induction_head_model(tmp_path):
    out = tmp_path / "composition.json"
    _load_script().main(["--sequences", "200", "--noise", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["noise"], r["order"], r["method"]): r for r in result["rows"]}
    one = rows[(0, "A", "A (one state)")]
    assert one["logit_error_vs_full_sequence"] <= 1e-4 and one["accuracy"] >= 0.95  # the model's own task
    for order in ("A,B", "B,A"):
        concat = rows[(2, order, "concat")]  # re-encoding the concatenation: the truth itself
        assert concat["agreement_with_concat"] == 1.0 and concat["state_distance"] <= 1e-6
        assert concat["accuracy"] == rows[(2, order, "model on the concatenation (truth)")]["accuracy"]
        # CASO under state feedback is an approximation: measurably off the concatenation's state
        assert rows[(2, order, "caso")]["state_distance"] > 1e-3
    for method in ("soup", "picaso_s", "picaso_r", "piconcat_r"):
        row = rows[(2, "any", method)]
        assert 0.0 <= row["accuracy"] <= 1.0 and row["state_distance"] > 1e-3
    # PICASO-S and PICASO-R agree for two states (the two rotations are the two orders)
    assert abs(rows[(2, "any", "picaso_s")]["state_distance"] - rows[(2, "any", "picaso_r")]["state_distance"]) < 1e-5
