"""Every benchmark script starts (its imports and argument parsing), run as `python benchmarks/<name>.py`."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the scripts (a module whose name starts with "_", such as _plot.py, is their shared helper, not a script)
SCRIPTS = sorted(
    p for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")) if not os.path.basename(p).startswith("_")
)


# One Python process imports torch, transformers and the package once, then forks a child per script that runs it
# as `python benchmarks/<name>.py --help` would (runpy, __main__, its own argv, stdout and stderr captured): each
# script still starts in a process of its own, without paying ~5-15 s of imports on a 2-core machine each time.
_RUN_FORKED = r"""
import contextlib, io, json, os, runpy, sys
import torch, transformers, hf_statecompose  # the imports every script shares, paid once
results = {}
for script in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the script as __main__, with its folder first on sys.path as `python script` has it
        os.close(read)
        out, err, code = io.StringIO(), io.StringIO(), 0
        sys.argv, sys.path[0] = [script, "--help"], os.path.dirname(script)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException as error:
            code, err = 1, io.StringIO(err.getvalue() + repr(error))
        with os.fdopen(write, "w") as pipe:
            json.dump({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-3000:]}, pipe)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    results[script] = json.loads(text) if text else {"code": -1, "stdout": "", "stderr": "the child died"}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def script_help():
    if not hasattr(os, "fork"):
        pytest.skip("fork: the scripts' --help runs share one import of torch on POSIX")
    done = subprocess.run(
        [sys.executable, "-c", _RUN_FORKED, *SCRIPTS], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_benchmark_script_starts(script, script_help):
    done = script_help[script]
    assert done["code"] == 0, done["stderr"]
    assert "usage:" in done["stdout"]


def test_a_script_that_fails_to_start_is_caught(tmp_path):
    # the forked runner reports a failing script as such (the check above can fail)
    bad = tmp_path / "broken.py"
    bad.write_text("import argparse\nraise ImportError('no such module')\n")
    good = tmp_path / "good.py"
    good.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    done = subprocess.run(
        [sys.executable, "-c", _RUN_FORKED, str(bad), str(good)], capture_output=True, text=True, timeout=300
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results[str(bad)]["code"] != 0 and "no such module" in results[str(bad)]["stderr"]
    assert results[str(good)]["code"] == 0 and "usage:" in results[str(good)]["stdout"]


def run_script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``benchmarks/<name> args`` in a subprocess, one torch thread (plus ``env``); asserts that it exits 0."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_ttft_runs_at_tiny_size(tmp_path):
    """benchmarks/ttft.py end to end on a tiny Mamba-2 (seconds): its table, its JSON, the store path's answer."""
    import json

    out = tmp_path / "ttft.json"
    done = run_script("ttft.py", "--size", "tiny", "--repeats", "1", "--baseline-repeats", "1", "--out", str(out))
    assert "| tiny | 10 |" in done.stdout
    result = json.loads(out.read_text())
    (size,) = result["results"]
    assert [row["k"] for row in size["rows"]] == [1, 4, 10] and result["threads"] == 1
    for row in size["rows"]:
        assert row["baseline_tokens"] == row["k"] * 256 + 16 and row["speedup"] > 0
        assert set(row["seconds"]) >= {
            "ttft",
            "store_open",
            "retrieval",
            "read_verify",
            "compose",
            "prefill_first_token",
            "baseline_prefill",
            "fingerprint_check",
        }


def _load_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# tiny configs of the hybrids (hidden 32, 4 SSM heads of 16, state 8, 2 kv heads): jamba and falcon_h1 need their
# mixer paths, which are being made (they fail to encode until then)
_HYBRID_SMALL = dict(
    vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, pad_token_id=0
)
_HYBRID_CONFIGS = {
    "granitemoehybrid": dict(
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        num_local_experts=0,
        shared_intermediate_size=48,
        position_embedding_type="nope",
    ),
    "nemotron_h": dict(
        num_hidden_layers=4,
        hybrid_override_pattern="M*-M",
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        chunk_size=16,
    ),
    "bamba": dict(
        num_hidden_layers=3,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
    ),
    "falcon_h1": dict(
        num_hidden_layers=2,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        head_dim=8,
    ),
    "jamba": dict(
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    ),
}


@pytest.mark.parametrize("model_type", list(_HYBRID_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hybrid_state_size_is_what_a_state_holds(model_type, dtype):
    """benchmarks/hybrid_state_size.py's figures (fixed bytes + bytes per token, from the package's shape functions)
    equal the bytes of the tensors of a state that hsc.encode makes, for two context lengths and both model dtypes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_statecompose as hsc

    sizes = _load_script("hybrid_state_size")
    config = AutoConfig.for_model(model_type, **_HYBRID_SMALL, **_HYBRID_CONFIGS[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().to(dtype)
    figures = sizes.state_bytes(model_type, config, dtype)
    assert figures["attention_layers"] >= 1 and figures["ssm_layers"] >= 1
    for length in (5, 12):
        state = hsc.encode(model, torch.randint(3, 64, (1, length)))
        tensors = {}
        for layer in state.layers:
            for name in ("ssm_state", "conv_state", "delta_sum", "A", "keys", "values", "positions"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor):
                    tensors[tensor.data_ptr()] = tensor.numel() * tensor.element_size()  # shared positions counted once
        assert sum(tensors.values()) == figures["fixed_bytes"] + length * figures["bytes_per_token"]


def test_hybrid_state_size_table(tmp_path):
    """The script's table and JSON: every checkpoint in both dtypes; the pure Mamba-2 never crosses over, each hybrid does."""
    import json

    out = tmp_path / "sizes.json"
    done = run_script("hybrid_state_size.py", "--out", str(out))
    assert "| Granite-4.0-H-Tiny | bfloat16 |" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {row["model"] for row in rows} >= {"Granite-4.0-H-Tiny", "Nemotron-H-8B", "Falcon-H1-7B", "Jamba-1.5-Mini"}
    assert len(rows) == 2 * len({row["model"] for row in rows})
    for row in rows:
        hybrid = row["attention_layers"] > 0
        assert (row["crossover_tokens"] is not None) == hybrid and (row["bytes_per_token"] > 0) == hybrid
        # a transition per delta-rule layer and head, [k, k] float32: as many bytes as the state when k = v
        delta_rule = row["model_type"] in ("qwen3_next", "qwen3_5_text", "kimi_linear")
        assert (row["fixed_parts"]["transition"] == row["fixed_parts"]["ssm_state"]) == delta_rule, row["model"]
    qwen3_next = next(r for r in rows if r["model"] == "Qwen3-Next-80B-A3B" and r["dtype"] == "bfloat16")
    assert qwen3_next["fixed_parts"]["transition"] == 36 * 32 * 128 * 128 * 4
    kimi = next(r for r in rows if r["model"] == "Kimi-Linear-48B-A3B" and r["dtype"] == "bfloat16")
    # 6 MLA layers x (latent 512 + rotary part 64) x 2 bytes + a position; ΣΔ one per key channel: 21 x 32 x 128
    assert kimi["bytes_per_token"] == 6 * (512 + 64) * 2 + 8
    assert kimi["fixed_parts"]["delta_sum"] == 21 * 32 * 128 * 4
    granite = next(r for r in rows if r["model"] == "Granite-4.0-H-Tiny" and r["dtype"] == "bfloat16")
    # 4 attention layers x (K + V) x 4 kv heads x 128 x 2 bytes, + an int64 position; 36 Mamba-2 layers of 48 x 64 x 128 float32
    assert granite["bytes_per_token"] == 4 * 2 * 4 * 128 * 2 + 8
    assert granite["fixed_parts"]["ssm_state"] == 36 * 48 * 64 * 128 * 4


@pytest.mark.parametrize(
    "size,quick",
    [("granite-h-tiny-10l", "tiny"), ("qwen3.5-4l", "qwen3.5-tiny"), ("kimi-linear-4l", "kimi-linear-tiny")],
)
def test_hybrid_ttft_quick(tmp_path, size, quick):
    """benchmarks/hybrid_ttft.py --quick (a tiny GraniteMoeHybrid, or a tiny Qwen3.5 for the gated DeltaNet sizes,
    seconds): its table, its JSON, the composed keys of all k contexts, and one composed state giving the baseline's
    first token (one state composes to itself)."""
    import json

    out = tmp_path / "hybrid_ttft.json"
    done = run_script("hybrid_ttft.py", "--size", size, "--quick", "--out", str(out))
    assert "| 10 |" in done.stdout
    result = json.loads(out.read_text())
    rows = result["result"]["rows"]
    assert [row["k"] for row in rows] == [1, 4, 10] and result["threads"] == 1 and result["result"]["size"] == quick
    for row in rows:
        assert row["baseline_tokens"] == row["k"] * 256 + 16 and row["composed_keys"] == row["k"] * 256
        assert row["speedup"] > 0
        assert set(row["seconds"]) >= {
            "ttft",
            "ttft_states_seen",
            "fingerprint",
            "state_checks",
            "ssm_compose",
            "attention_compose",
            "query_prefill_first_token",
            "baseline_prefill",
        }
    assert rows[0]["first_token"] == rows[0]["baseline_first_token"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the whole protocol (minutes)")
def test_gpu_protocol_skips_without_cuda_and_its_checks_run_in_the_interpreter(tmp_path):
    """benchmarks/gpu.py exits 0 with a reason where there is no CUDA device, and its checks themselves run (two
    kernels' forward + every gradient against the float64 reference, tiny shapes, Triton's CPU interpreter)."""
    import json

    script = os.path.join(ROOT, "benchmarks", "gpu.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no CUDA device: skipped" in done.stdout
    out = tmp_path / "gpu.json"
    only = "correct/causal_conv1d,correct/linear_recurrence"
    done = subprocess.run(
        [sys.executable, script, "--smoke", "--sections", "correctness", "--only", only, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    assert set(checks) == {"correct/causal_conv1d/tiny/float32", "correct/linear_recurrence/tiny/float32"}
    for row in checks.values():
        assert row["ok"] and row["max_rel"] < 1e-5
        assert "d_initial_state" in row or "d_conv_state" in row  # the gradient of the initial state is compared


@pytest.mark.parametrize("size", ["qwen3.5-4l", "kimi-linear-4l"])
def test_delta_rule_encode_quick(tmp_path, size):
    """benchmarks/delta_rule_encode.py --quick (a tiny Qwen3.5 or Kimi Linear, seconds): the encode and decode times
    with and without the transitions, and bf16 transitions' errors, which are small but not zero (the rounding
    reaches the composition)."""
    import json

    out = tmp_path / "delta_rule_encode.json"
    run_script("delta_rule_encode.py", "--size", size, "--quick", "--out", str(out))
    result = json.loads(out.read_text())
    assert [row["tokens"] for row in result["encode"]] == [256, 1024] and len(result["rows"]) == 5
    assert all(row["seconds"]["with_transitions"] > 0 for row in result["encode"])
    assert result["decode"]["new_tokens"] == 4 and result["decode"]["transitions_cost"] > 0
    assert result["size"] == ("kimi-linear-tiny" if size.startswith("kimi") else "qwen3.5-tiny")
    for row in result["bf16"]:
        assert 0 < row["transition_rel_error"] < 1e-2 and 0 < row["state_rel_error"] < 1e-2, row
