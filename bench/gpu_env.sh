# Sourced by run_gpu.sh and lanes.sh on the GPU machine: from the repo root, $OUT made, the
# carried wheels (.whl/, scripts/build_gpu_wheels.sh) installed into /tmp/site and on the path,
# and the versions and GPUs printed.
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OUT
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'x', \
torch.cuda.get_device_name(0))"
