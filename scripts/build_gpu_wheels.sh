#!/usr/bin/env bash
# Build .whl/: the wheels the GPU machine lacks (it has torch, transformers, peft, triton, rich,
# tensorboard, matplotlib, numpy, accelerate, pyarrow; not pydantic, tomli-w, math-verify, trl,
# datasets). Run here, in the repo root; the GPU command then starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "$(git rev-parse --git-dir)/info"; ex="$(git rev-parse --git-dir)/info/exclude"
grep -qx "/.whl/" "$ex" 2>/dev/null || echo "/.whl/" >> "$ex"
rm -rf .whl && mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$@"
}
# pydantic's own version pins pydantic-core exactly: take the pair this machine has.
fetch "pydantic==$(python3 -c 'import pydantic; print(pydantic.VERSION)')" \
      "pydantic-core==$(python3 -c 'import pydantic_core; print(pydantic_core.__version__)')" \
      annotated-types typing-inspection tomli-w
# Optional parts: math-verify (rewards) with its parser; the environments' bs4 and bm25s.
fetch math-verify "latex2sympy2_extended" "antlr4-python3-runtime==4.13.2" || echo "math-verify wheels skipped"
fetch beautifulsoup4 soupsieve bm25s || echo "environment wheels skipped"
# The G1/G2 peer (bench/peers/trl_grpo.py): trl and datasets with its pure-Python needs, at the
# versions this machine runs (the GPU image has accelerate, pyarrow, pandas, xxhash, fsspec).
fetch "trl==$(python3 -c 'import trl; print(trl.__version__)')" \
      "datasets==$(python3 -c 'import datasets; print(datasets.__version__)')" \
      "dill==$(python3 -c 'import dill; print(dill.__version__)')" \
      "multiprocess==$(python3 -c 'import multiprocess; print(multiprocess.__version__)')" \
  || echo "trl peer wheels skipped"
ls -la .whl
du -sh .whl
