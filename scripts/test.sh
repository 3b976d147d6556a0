#!/usr/bin/env bash
# Fresh machine -> the whole test suite, offline on CPU, twice, each time in a virtual environment built
# afresh (noxfile.py): tests-lowest on the lowest versions pyproject.toml allows (transformers 5.23.x),
# tests-newest on the newest (transformers 5.24.x). Before pytest, each session runs ruff (lint + format check),
# mypy, lint-imports, and builds the sdist and the wheel for twine check. Arguments go to pytest in both sessions, e.g.
#   bash scripts/test.sh -k compose -x
# and NOXSESSION=tests-lowest (or tests-newest) runs one session only.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import nox, uv" 2>/dev/null || python -m pip install -q nox uv
exec python -m nox -- "$@"
