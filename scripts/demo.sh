#!/usr/bin/env bash
# Fresh machine -> installed package -> the main job: encode contexts, compose, generate.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -c constraints.txt -e ".[retrieval]"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m hf_statecompose.demo "$@"
