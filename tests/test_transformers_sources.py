"""HSC_TRANSFORMERS_TESTS (exported by noxfile.py) points at a transformers source tree's tests folder
holding the model test mixin (test_modeling_common.py) that tests/test_transformers_common.py imports."""

import os
from pathlib import Path

import pytest

# the files noxfile.py checks for before exporting the variable (TRANSFORMERS_TEST_FILES there)
NEEDED = ("test_modeling_common.py",)


def test_transformers_tests_folder_holds_the_mixins():
    folder = os.environ.get("HSC_TRANSFORMERS_TESTS")
    if not folder:
        pytest.skip(
            "HSC_TRANSFORMERS_TESTS is unset: `bash scripts/test.sh` (noxfile.py) exports it when the "
            "installed transformers' sdist holds " + ", ".join("tests/" + n for n in NEEDED)
        )
    missing = [name for name in NEEDED if not (Path(folder) / name).is_file()]
    assert missing == [], f"HSC_TRANSFORMERS_TESTS={folder} lacks {missing}"
