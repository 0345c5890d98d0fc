#!/usr/bin/env bash
# The GPU kit's one call on the lent GPU machine (docs/testing.md, "The GPU kit"): install the kit's wheels
# (built here by ./run.sh gpu-kit, carried as gpu-kit/) into the image's Python, check the imports (torch sees
# the GPU, Ray starts), then the GPU tier's steps in priority order, each figure saved to
# $OUT/gpu-figures.json the moment it exists.
#
#   bash tests/gpu_kit.sh [--part first|second|all] [--only STEP,STEP] [--budget SECONDS]
#   bash tests/gpu_kit.sh --dry-run       # here, on the CPU: the project's .venv, the steps at tiny sizes
#
# Arguments go to tests/gpu_tier.py (--part first: the 1.1B step, ResNet-50 fed from JPEGs, the 1.1B
# checkpoint's GPU stall; --part second: the GPU-marked tests, the pipeline's scaling, the demos).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ "${1:-}" = "--dry-run" ]; then
  PY=${BEHEMOTH_VENV:-.venv}/bin/python
  exec "$PY" tests/gpu_tier.py "$@"
fi
PY=python3
started=$SECONDS
# a short folder of its own: Ray's socket paths under it stay within the 107 bytes Unix sockets allow
SITE=/tmp/bk-site
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" gpu-kit/wheels/*.whl \
  || { echo "[gpu kit] the kit's wheels did not install: is gpu-kit/ carried (carry: [\"gpu-kit\"])?"; exit 4; }
export PYTHONPATH="$SITE:$PWD/platform${PYTHONPATH:+:$PYTHONPATH}"
echo "[gpu kit] installed $(ls gpu-kit/wheels | wc -l) wheels in $((SECONDS - started)) s"
# the machine first (a call cut short still says what it ran on): disk for the checkpoints, memory for the
# 13 GB host copies
echo "[gpu kit] $(nproc) CPUs; $(free -g | awk '/^Mem/ {print $2 " GiB memory, " $7 " GiB available"}')"
df -h /tmp /dev/shm 2>/dev/null | sed 's/^/[gpu kit] /'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/[gpu kit] /'
# Ray's memory monitor kills workers above 95 % of the host's memory; on a VM whose memory is granted as it is
# touched (13-20 GB pinned host copies at once) it reads the grant, not a shortage: off for the tier.
export RAY_memory_monitor_refresh_ms=0
# the import check: what the first part needs (datasets and jsonschema only the second part's tests import)
"$PY" - <<'EOF' || exit 4
import os, torch, ray, simplejpeg, pydantic, transformers
assert torch.cuda.is_available(), "torch sees no GPU"
ray.init(num_cpus=1, include_dashboard=False, logging_level="error")
assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
ray.shutdown()
print(f"[gpu kit] imports checked: torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
      f"{torch.cuda.get_device_name(0)}; Ray {ray.__version__} started; transformers {transformers.__version__}; "
      f"{os.cpu_count()} CPUs")
EOF
exec "$PY" tests/gpu_tier.py "$@"
