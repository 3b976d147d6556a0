# Sourced by scripts/demo.sh and scripts/test.sh: make (or reuse) the project's virtual environment and put its
# python first on PATH. HSC_VENV (default: .venv in the repository root) names it; the line printed says which.
HSC_VENV="${HSC_VENV:-$PWD/.venv}"
if [ ! -x "$HSC_VENV/bin/python" ]; then
    echo "making the project's virtual environment: $HSC_VENV (python3 -m venv)"
    python3 -m venv "$HSC_VENV"
else
    echo "using the project's virtual environment: $HSC_VENV"
fi
export VIRTUAL_ENV="$HSC_VENV" HSC_VENV
export PATH="$HSC_VENV/bin:$PATH"
hash -r
