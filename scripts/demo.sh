#!/usr/bin/env bash
# Fresh machine -> installed package -> the main job: encode contexts, compose, generate.
# Installs into the project's virtual environment, .venv/ next to this repository's pyproject.toml (made here with
# `python3 -m venv` if it does not exist, reused if it does; HSC_VENV=/some/path picks another), never into the
# Python on PATH; scripts/test.sh uses the same one for its test runner. Arguments go to the demo, e.g.
#   bash scripts/demo.sh --arch hybrid -k 3
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/project_venv.sh
python -m pip install -qq torch==2.13.0  # -qq: pip's errors, not its warnings (e.g. about a machine's pip configuration)
python -m pip install -qq -c constraints.txt -e ".[retrieval]"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m hf_statecompose.demo "$@"
echo "(the package is installed in $HSC_VENV: 'source $HSC_VENV/bin/activate' to use it, e.g. the README's Quickstart)"
