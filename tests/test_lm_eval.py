"""The lm-eval model ``statecompose`` and the bundled tasks (offline, CPU, demo Mamba-2, bag-of-words retriever)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance

import hf_statecompose as hsc
from hf_statecompose.demo.corpora import recall_world
from hf_statecompose.pipeline import context_order

from store_helpers import TEXTS, BagOfWords

ROOT = Path(__file__).resolve().parents[1]
WORLD = recall_world(2026, towns=60)


@pytest.fixture(scope="module")
def demo():
    return hsc.load_demo("mamba2")


@pytest.fixture(scope="module")
def store(demo, tmp_path_factory):
    model, tokenizer = demo
    s = hsc.StateStore(tmp_path_factory.mktemp("lmeval") / "store", model, tokenizer, retriever=BagOfWords())
    s.add(list(WORLD.passages[:12]) + TEXTS, show_progress=False)
    return s


def make_lm(demo, **kwargs):
    from hf_statecompose.lmeval.model import StateComposeLM

    model, tokenizer = demo
    kwargs.setdefault("batch_size", 4)
    return StateComposeLM(pretrained=model, tokenizer=tokenizer, **kwargs)


def ll_requests(pairs, docs=None):
    docs = docs or [{}] * len(pairs)
    return [Instance("loglikelihood", doc, pair, i) for i, (pair, doc) in enumerate(zip(pairs, docs))]


def question_pairs():
    pairs = []
    for q in WORLD.questions[:6]:  # facts held by the stored passages
        pairs += [(q.query, q.answer), (q.query, " Stone.")]
    return pairs + [("the red fox jumps", " over the fence"), ("bees make honey", " in the summer")]


@torch.no_grad()
def brute_force(lm, store, model, context, continuation, k, exclude=()):
    """Retrieve, order, compose, one forward, sum the continuation's log-probs (HFLM's token split)."""
    retrieved = store.retrieve(context, k, exclude=list(exclude))
    context_ids, continuation_ids = lm._encode_pair(context, continuation)
    ids = torch.tensor([context_ids + continuation_ids])
    logits = model(input_ids=ids, past_states=context_order(retrieved), composition="picaso_r").logits
    logprobs = torch.log_softmax(logits[0, len(context_ids) - 1 : -1].float(), -1)
    target = torch.tensor(continuation_ids)
    return float(logprobs.gather(1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())


def test_importing_registers_the_model():
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    from hf_statecompose.lmeval.model import StateComposeLM

    assert get_model("statecompose") is StateComposeLM
    assert get_model("hf") is HFLM  # our early registration must not hide lm-eval's own models
    hsc._register_lm_eval_model()  # idempotent
    assert get_model("statecompose") is StateComposeLM


def test_k0_is_plain_hflm(demo):
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = demo
    ours, plain = make_lm(demo, k=0), HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4)
    requests = ll_requests(question_pairs())
    assert ours.loglikelihood(requests) == plain.loglikelihood(requests)
    rolling = [
        Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(TEXTS[:3] + WORLD.passages[:2])
    ]
    assert ours.loglikelihood_rolling(rolling) == plain.loglikelihood_rolling(rolling)


def test_loglikelihood_matches_brute_force(demo, store):
    model, _ = demo
    lm = make_lm(demo, store=store, k=2)
    pairs = question_pairs()
    got = lm.loglikelihood(ll_requests(pairs))
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        expected_ll, expected_greedy = brute_force(lm, store, model, context, continuation, k=2)
        assert ll == pytest.approx(expected_ll, rel=1e-4, abs=1e-4)
        assert greedy == expected_greedy
    # the states matter: with its passage retrieved the model prefers the right answer clearly
    plain = make_lm(demo, k=0).loglikelihood(ll_requests(pairs))
    right = [i for i in range(0, 12, 2)]
    assert sum(got[i][0] for i in right) > sum(plain[i][0] for i in right) + 3.0


def test_exclude_passages(demo, store):
    model, _ = demo
    lm = make_lm(demo, store=store, k=1)
    q = WORLD.questions[0]
    own = WORLD.passages[q.passages[0]]
    own_id = next(e.id for e in store.entries() if e.text == own)
    assert store.retrieve(q.query, 1, load_states=False)[0].id == own_id
    with_own, without_own = lm.loglikelihood(ll_requests([(q.query, q.answer)] * 2, [{}, {"exclude_passages": [own]}]))
    assert without_own[0] == pytest.approx(
        brute_force(lm, store, model, q.query, q.answer, 1, exclude=[own_id])[0], rel=1e-4
    )
    assert with_own[0] > without_own[0] + 1.0


def test_generate_until_matches_generate(demo, store):
    model, tokenizer = demo
    lm = make_lm(demo, store=store, k=2)
    questions = WORLD.questions[:4]
    kwargs = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    got = lm.generate_until(
        [Instance("generate_until", {}, (q.query, dict(kwargs)), i) for i, q in enumerate(questions)]
    )
    for q, text in zip(questions, got):
        ids = torch.tensor([tokenizer(q.query)["input_ids"]])
        states = context_order(store.retrieve(q.query, 2))
        out = model.generate(
            ids, past_states=states, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
        for stop in ("\n", tokenizer.eos_token):
            expected = expected.split(stop)[0]
        assert text == expected
    assert (
        sum(text.strip() == q.answer.strip() for q, text in zip(questions, got)) >= 2
    )  # recalled from the states (chance: 1 in 20)


def test_simple_evaluate_runs_each_bundled_task(demo, store):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hf_statecompose.lmeval import TASKS, TASKS_DIR

    results = lm_eval.simple_evaluate(
        model=make_lm(demo, store=store, k=2),
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        limit=5,
    )["results"]
    expected = {
        "statecompose_wikipedia": "bits_per_byte,none",
        "statecompose_wikipedia_rolling": "bits_per_byte,none",
        "statecompose_recall_mc": "acc,none",
    }
    for task, metric in expected.items():
        assert results[task]["sample_len"] == 5
        assert math.isfinite(results[task][metric]) and results[task][metric] >= 0


def test_passages_build_a_cached_store_once(demo, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_STATECOMPOSE_CACHE", str(tmp_path / "cache"))
    passages = tmp_path / "p.jsonl"
    passages.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(TEXTS)))
    capsys.readouterr()
    first = make_lm(demo, passages=str(passages), retriever=BagOfWords(), k=2)
    assert len(first.store) == len(TEXTS) and first.store.path.parent == tmp_path / "cache"
    assert "encoding contexts: 100%|" in capsys.readouterr().err  # the build shows its progress (tqdm)
    stamp = (first.store.path / "store.json").stat().st_mtime_ns
    second = make_lm(demo, passages=str(passages), retriever=BagOfWords(), k=2)
    assert "encoding contexts" not in capsys.readouterr().err  # a reused store encodes nothing
    assert second.store.path == first.store.path and len(second.store) == len(TEXTS)
    assert (second.store.path / "store.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert len(list((tmp_path / "cache").iterdir())) == 1  # no leftover build folder
    # an explicit empty path is filled; the same path with other passages is refused
    target = tmp_path / "mine"
    assert len(make_lm(demo, passages=str(passages), store=str(target), retriever=BagOfWords(), k=1).store) == len(
        TEXTS
    )
    other = tmp_path / "q.jsonl"
    other.write_text(json.dumps({"text": "something else entirely"}) + "\n")
    with pytest.raises(ValueError, match="other passages"):
        make_lm(demo, passages=str(other), store=str(target), retriever=BagOfWords(), k=1)


def test_clear_errors(demo, tmp_path):
    with pytest.raises(ValueError, match="k must be >= 0"):
        make_lm(demo, k=-1)
    with pytest.raises(ValueError, match="unknown composition"):
        make_lm(demo, k=1, composition="nope", passages="bundled")
    with pytest.raises(ValueError, match=r"store=.*passages="):
        make_lm(demo, k=3)
    with pytest.raises(ValueError, match="no StateStore"):
        make_lm(demo, k=1, store=str(tmp_path / "nothing"), retriever=BagOfWords())
    other_model, tokenizer = hsc.load_demo("mamba")
    foreign = hsc.StateStore(tmp_path / "foreign", other_model, tokenizer, retriever=BagOfWords())
    foreign.add(TEXTS[:2], show_progress=False)
    with pytest.raises(ValueError, match="passages="):
        make_lm(demo, k=1, store=str(tmp_path / "foreign"), retriever=BagOfWords())


def test_peft_adapter(demo, store, tmp_path):
    peft = pytest.importorskip("peft")
    model, _tokenizer = hsc.load_demo("mamba2")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["in_proj"], init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "adapter")
    passages = tmp_path / "p.jsonl"
    passages.write_text("".join(json.dumps({"text": t}) + "\n" for t in WORLD.passages[:6]))
    from hf_statecompose.lmeval.model import StateComposeLM

    lm = StateComposeLM(
        pretrained="demo",
        peft=str(tmp_path / "adapter"),
        passages=str(passages),
        store=str(tmp_path / "s"),
        retriever=BagOfWords(),
        k=2,
        batch_size=4,
    )
    assert type(lm.model).__name__.startswith("Peft")
    pairs = question_pairs()[:4]
    got = lm.loglikelihood(ll_requests(pairs))
    base = make_lm(demo, store=store, k=2).loglikelihood(ll_requests(pairs))
    for (context, continuation), (ll, _) in zip(pairs, got):
        assert ll == pytest.approx(brute_force(lm, lm.store, lm.model, context, continuation, k=2)[0], rel=1e-4)
    assert all(abs(a[0] - b[0]) > 1e-3 for a, b in zip(got, base))  # the adapter is in effect


def test_cli_wrapper_runs_a_task(tmp_path):
    passages = tmp_path / "p.jsonl"
    passages.write_text("".join(json.dumps({"text": t}) + "\n" for t in WORLD.passages[:4]))
    env = dict(
        os.environ,
        HF_STATECOMPOSE_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_statecompose",
            "lm-eval",
            "run",
            "--model",
            "statecompose",
            "--model_args",
            f"pretrained=demo,passages={passages},k=2",
            "--tasks",
            "statecompose_recall_mc",
            "--limit",
            "5",
            "--output_path",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "statecompose_recall_mc" in done.stdout and "acc" in done.stdout
    # quiet (tests/test_quiet.py): no "Loading weights" bar, and no git error although tmp_path is not a repository
    assert "Loading weights" not in done.stderr and "fatal: not a git repository" not in done.stderr, done.stderr[
        -3000:
    ]
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert results and json.loads(results[0].read_text())["results"]["statecompose_recall_mc"]["acc,none"] >= 0


@pytest.mark.parametrize(
    "model_args, message",
    [
        ("pretrained=demo,k=-1", "k must be >= 0"),
        ("pretrained=demo,k=1,passages=/no/such/passages.jsonl", "passages='/no/such/passages.jsonl': no such file"),
        ("pretrained=demo,k=1,composition=nope,passages=bundled", "unknown composition 'nope'"),
        ("pretrained=demo,k=0,bogus=1", "unexpected keyword argument 'bogus'"),
    ],
)
def test_bad_model_args_are_a_model_argument_error(model_args, message):
    from hf_statecompose.lmeval import ModelArgumentError
    from hf_statecompose.lmeval.model import StateComposeLM

    with pytest.raises(ModelArgumentError, match="^--model_args: .*" + message.replace("(", r"\(")):
        StateComposeLM.create_from_arg_string(model_args, {"batch_size": 1})
    with pytest.raises(ModelArgumentError, match=message.replace("(", r"\(")):
        StateComposeLM.create_from_arg_obj(dict(item.split("=") for item in model_args.split(",")))


def test_cli_wrapper_reports_them_in_one_line(monkeypatch, capsys):
    import lm_eval.__main__

    from hf_statecompose.lmeval import ModelArgumentError, run_cli

    def refuses():
        raise ModelArgumentError("--model_args: k must be >= 0 (0 = no retrieval,\nplain HFLM), got -1")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", refuses)
    assert run_cli(["run", "--model", "statecompose", "--model_args", "k=-1", "--tasks", "x"]) == 2
    assert (
        capsys.readouterr().err
        == "hf-statecompose lm-eval: error: --model_args: k must be >= 0 (0 = no retrieval, plain HFLM), got -1\n"
    )


@pytest.mark.parametrize("arch", ["qwen3_5_text", "kimi_linear"])
def test_delta_rule_hybrids_loglikelihood_and_generation(arch, demo, tmp_path):
    """The lm-eval model on a delta-rule hybrid (a tiny random Qwen3.5: gated DeltaNet; Kimi Linear: Kimi delta
    attention + MLA) with the demo tokenizer: its log-likelihoods are the brute force's (retrieve, compose with
    picaso_r, one forward), the retrieved states change them, and generate_until is model.generate from those states."""
    from architectures import hybrid_model

    _, tokenizer = demo
    model = hybrid_model(arch, dtype=torch.float32, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    store = hsc.StateStore(tmp_path / "store", model, tokenizer, retriever=BagOfWords())
    store.add(list(WORLD.passages[:6]) + TEXTS[:3], show_progress=False)
    lm = make_lm((model, tokenizer), store=store, k=2)
    pairs = question_pairs()[:6]
    got = lm.loglikelihood(ll_requests(pairs))
    plain = make_lm((model, tokenizer), k=0).loglikelihood(ll_requests(pairs))
    for (context, continuation), (ll, greedy), (ll0, _) in zip(pairs, got, plain):
        expected_ll, expected_greedy = brute_force(lm, store, model, context, continuation, k=2)
        assert ll == pytest.approx(expected_ll, rel=1e-4, abs=1e-4) and greedy == expected_greedy
        assert abs(ll - ll0) > 1e-3  # the states are in effect
    question = WORLD.questions[0]
    (text,) = lm.generate_until(
        [Instance("generate_until", {}, (question.query, {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}), 0)]
    )
    ids = torch.tensor([tokenizer(question.query)["input_ids"]])
    out = model.generate(
        ids,
        past_states=context_order(store.retrieve(question.query, 2)),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
    for stop in ("\n", tokenizer.eos_token):
        expected = expected.split(stop)[0]
    assert text == expected
