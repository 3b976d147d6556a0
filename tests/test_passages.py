"""Passages files (.jsonl): parsed once for the CLI and the lm-eval model, bad lines named."""

import pytest

from hf_statecompose.cli import CommandLineError, read_passages
from hf_statecompose.store.passages import parse_passages_jsonl


def test_objects_and_strings_with_metadata():
    texts, metadata = parse_passages_jsonl('{"text": "a b", "source": 1}\n\n"plain"\n', "f.jsonl")
    assert texts == ["a b", "plain"] and metadata == [{"source": 1}, {}]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{broken\n', "f.jsonl:2: not JSON"),
        ('{"body": "no text field"}\n', "f.jsonl:1: expected an object with a non-empty string field 'text'"),
        ('{"text": ""}\n', "f.jsonl:1: expected"),
        ("[1, 2]\n", "f.jsonl:1: expected"),
        ("\n\n", "f.jsonl holds no passages"),
    ],
)
def test_bad_files_are_refused_naming_the_line(content, message):
    with pytest.raises(ValueError, match=message.replace("'", ".").replace("(", r"\(")):
        parse_passages_jsonl(content, "f.jsonl")


def test_the_cli_reports_them_as_a_user_error(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(CommandLineError, match=r"p.jsonl:2: not JSON"):  # main() prints it as one line, exit 2
        read_passages(str(path))
    path.write_text('{"text": "one", "k": 2}\n')
    assert read_passages(str(path)) == (["one"], [{"k": 2}])


def test_the_lm_eval_model_reads_the_same_format(tmp_path):
    pytest.importorskip("lm_eval")
    from hf_statecompose.lmeval.model import _read_passages

    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "one"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected"):
        _read_passages(str(path))
    texts, _metadata, sha = _read_passages("bundled")
    assert len(texts) == 172 and len(sha) == 64
