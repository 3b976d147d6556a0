#!/usr/bin/env bash
# Fresh machine -> installed package -> the whole test suite, offline (CPU; ~5 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -c constraints.txt -e ".[dev]"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the layers contract (.importlinter): each module imports only the layers below it
lint-imports
python -m pytest -q tests "$@"
