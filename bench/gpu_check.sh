#!/usr/bin/env bash
# The project's GPU check: what a session lent a GPU runs first, in one call of about 8 minutes
# (docs/results/speed.md records its figures). On the GPU machine, in the repository's root, with
# the wheels the machine lacks carried in .whl/ (made here: python bench/gpu_wheels.py --have
# bench/gpu_image_packages.txt):
#
#     bash bench/gpu_check.sh            # results under $OUT (or ./gpu-check)
#
# 1. one prompt step, CoOp's naive one against ours, with and without DP-SGD, on ViT-B/16 and the
#    embedded tiny CLIP (random weights: nothing is downloaded);
# 2. clients trained per second on the GPU, in-process (the machine has no Ray: its wheel cannot
#    travel): the embedded default and ViT-B/16, 20 clients, three rounds, with the GPU memory held.
# Each step has its own time limit and the next runs even if one fails; what each printed is in
# $OUT/*.log and its figures in $OUT/*.json.
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FEDVLM_CACHE=${FEDVLM_CACHE:-/tmp/fedvlm-cache} FLWR_TELEMETRY_ENABLED=0
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"

step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
step prompt_step 150 python3 bench/prompt_step.py --models ViT-B-16 embedded-tiny --device cuda --steps 5 \
    --json "$OUT/prompt_step.json"
step clients_embedded 120 python3 bench/clients_per_second.py --families prompt --engines inprocess --device cuda \
    --clients 20 --rounds 3 --out "$OUT/clients_embedded.json"
step clients_vit 180 python3 bench/clients_per_second.py --families prompt --engines inprocess --device cuda \
    --model vit-b-16 --clients 20 --rounds 3 --out "$OUT/clients_vit.json"
