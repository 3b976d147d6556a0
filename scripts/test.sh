#!/usr/bin/env bash
# Fresh machine -> the whole test suite, offline on CPU, twice (and a targeted third run), each in a virtual environment built
# afresh (noxfile.py): tests-lowest on the lowest versions pyproject.toml allows (transformers 5.23.x),
# tests-newest on the newest (transformers 5.25.x), then tests-transformers-5.24 (a targeted run of the files that touch
# what 5.24 does differently from both). Before pytest, the first two sessions run ruff (lint + format check),
# mypy, lint-imports, and builds the sdist and the wheel for twine check. Arguments go to pytest in every session, e.g.
#   bash scripts/test.sh -k compose -x
# and NOXSESSION=tests-lowest (or tests-newest) runs one session only.
# The test runner (nox, uv) goes into the project's virtual environment, the one scripts/demo.sh uses (.venv/, or
# HSC_VENV); the sessions' environments (.nox/, about 7 GB) are removed when the run ends, pass or fail
# (HSC_KEEP_NOX=1 keeps them, e.g. to re-run a test by hand with .nox/tests-newest/bin/python -m pytest ...).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/project_venv.sh
if [ "${HSC_KEEP_NOX:-0}" != "1" ]; then
    trap 'rm -rf .nox' EXIT
fi
python -c "import nox, uv" 2>/dev/null || python -m pip install -q nox uv
python -m nox -- "$@"
