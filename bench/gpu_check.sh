#!/usr/bin/env bash
# The project's GPU check: what a session lent a GPU runs first, in one call of about 8 minutes,
# and the table it writes goes into docs/results/speed.md. On the GPU machine, in the repository's
# root, with the wheels the machine lacks carried in .whl/ (made here, 21 MiB: python
# bench/gpu_wheels.py --have bench/gpu_image_packages.txt):
#
#     bash bench/gpu_check.sh                 # results under $OUT (or ./gpu-check)
#     DEVICE=cpu MODELS=embedded-tiny CLIENT_MODELS=embedded bash bench/gpu_check.sh   # the same on a CPU
#
# 1. one prompt step, CoOp's naive one against ours, with and without DP-SGD, on each of $MODELS
#    (random weights: nothing is downloaded);
# 2. clients trained per second, in-process (the machine has no Ray: its wheel cannot travel), on
#    each of $CLIENT_MODELS, 20 clients, three rounds, with the GPU memory held;
# 3. gpu_check.json and gpu_check.md: every figure of both, one table each, with the machine.
# Each step has its own time limit and the next runs even if one fails; what each printed is in
# $OUT/*.log.
set -uo pipefail
OUT=${OUT:-gpu-check}
DEVICE=${DEVICE:-cuda}
MODELS=${MODELS:-ViT-B-16 ViT-L-14 embedded-tiny}
CLIENT_MODELS=${CLIENT_MODELS:-embedded vit-b-16}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FEDVLM_CACHE=${FEDVLM_CACHE:-/tmp/fedvlm-cache} FLWR_TELEMETRY_ENABLED=0
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; } >"$OUT/gpu.txt"

step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
# shellcheck disable=SC2086 # MODELS is a list of model names
step prompt_step 200 python3 bench/prompt_step.py --models $MODELS --device "$DEVICE" --steps 5 \
    --json "$OUT/prompt_step.json"
for model in $CLIENT_MODELS; do
    step "clients_$model" 150 python3 bench/clients_per_second.py --families prompt --engines inprocess \
        --device "$DEVICE" --model "$model" --clients 20 --rounds 3 --out "$OUT/clients_$model.json"
done
python3 - "$OUT" <<'EOF'
import json, platform, sys
from pathlib import Path

out = Path(sys.argv[1])
steps = json.loads((out / "prompt_step.json").read_text()) if (out / "prompt_step.json").exists() else []
clients = [r for f in sorted(out.glob("clients_*.json")) for r in json.loads(f.read_text())["rows"]]
machine = {"gpu": (out / "gpu.txt").read_text().strip(), "python": platform.python_version()}
(out / "gpu_check.json").write_text(json.dumps({"machine": machine, "prompt_step": steps, "clients": clients}, indent=2))
lines = [f"Machine: {machine['gpu']}", ""]
if steps:
    keys = list(steps[0])
    lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in steps] + [""]
if clients:
    keys = ["model", "device", "clients_per_s", "train_s_per_client", "round_s", "peak_gpu_mib"]
    lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in clients]
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
