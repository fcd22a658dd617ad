#!/usr/bin/env bash
# The GPU bench of issue 21, on the lent GPU machine. Not run yet: no session so far had one.
#
# 1. Here (the dev machine), in the checkout the session was started in (the device tool
#    sends that one), a few minutes:
#        PYTHONPATH=. OMP_NUM_THREADS=1 python bench/gpu_bundle.py
#    It writes bench/gpu_carry/ (git-ignored, ~14 MiB: wheels, two data dirs, manifest).
# 2. The device tool, one call (not timed yet; expected under its 10 min limit):
#        run  command:   bash bench/gpu_run.sh all
#             carry:     ["bench/gpu_carry"]
#             timeout_s: 600
#    or, if that does not fit, two calls: `bash bench/gpu_run.sh bert`, then
#    `bash bench/gpu_run.sh gpt` (each installs again: a fresh machine keeps nothing).
# 3. What comes back under the reply's files_at: env.txt, install.log, bert.json + bert.log,
#    gpt.json + gpt.log (tables at the end of each log). BENCHMARKS.md says what to report.
#
# Stages: install (always), then bert (bench/bench_train.py: bert-tiny, 4x256, bert-base at
# seq 128, batch 128, bf16, ours unpad / padded vs HF) and/or gpt (bench/bench_gpt.py:
# GPT-2 124M at seq 1024, batch 16, bf16, ours and ours compiled vs the baseline eager and
# compiled). Both run with --deny-import ray --deny-import mlflow, as the machine has
# neither.
#
# Install: python3 there is itself a venv (/opt/torch/.venv, CUDA torch 2.11). A venv made
# from it with --system-site-packages would see the base interpreter's site-packages, not
# that venv's (and lose CUDA torch), so the new venv also gets a .pth that adds the
# machine venv's site-packages. pip then resolves the carried roots against everything the
# machine has, installs only what is missing from bench/gpu_carry/wheels (--no-index), and
# fails if anything is missing. Override the interpreter with PY=..., the output with OUT=...
#
# REHEARSE=1: the same stages on a CPU machine at tiny sizes (fp32, bert-tiny and
# gpt2-tiny, a few rounds), with PY a stand-in for the GPU machine's venv: what
# bench/gpu_rehearsal.py does here before a device call, so that call cannot fail on an
# import, a path or a version.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
case $stage in all | bert | gpt | install) ;; *) echo "usage: $0 [all|bert|gpt|install]" >&2; exit 2 ;; esac
CARRY=bench/gpu_carry
OUT=${OUT:-/tmp/plm-gpu-out}
PY=${PY:-python3}
VENV=${VENV:-/tmp/plm-venv}
mkdir -p "$OUT"
[ -f $CARRY/manifest.json ] || { echo "no $CARRY: run bench/gpu_bundle.py here first and carry it" >&2; exit 2; }

{
  echo "# $(date -u +%FT%TZ) $(uname -srm)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
  "$PY" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The carried wheels are for one Python (gpu_bundle.py --python; 3.12, the GPU machine's)
want=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("wheels_for_python", "3.12"))' $CARRY/manifest.json)
have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$want" != "$have" ]; then
  echo "$CARRY holds wheels for Python $want, $PY is $have: rebuild it (bench/gpu_bundle.py --python $have)" >&2
  exit 2
fi
machine_site=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
rm -rf "$VENV"
"$PY" -m venv --system-site-packages --without-pip "$VENV"
venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$machine_site')" >"$venv_site/plm-machine-site.pth"
"$VENV/bin/python" -m pip install --no-index --find-links $CARRY/wheels --no-cache-dir \
  --no-compile --disable-pip-version-check -r $CARRY/wheels/requirements.txt 2>&1 | tee "$OUT/install.log"
VPY="$VENV/bin/python"
"$VPY" -c 'import deepspeed, pydantic, torch; print("deepspeed", deepspeed.__version__, "pydantic", pydantic.__version__, "torch", torch.__version__, torch.__file__)' 2>&1 | tee -a "$OUT/install.log"

export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
deny=(--deny-import ray --deny-import mlflow)
if [ "${REHEARSE:-0}" = 1 ]; then
  bert_args=(--device cpu --precision fp32 --preset bert-tiny --batch 8 --seq 64 --rounds 2 --warmup 1)
  gpt_args=(--device cpu --precision fp32 --preset gpt2-tiny --rounds 2 --warmup 1)
else
  bert_args=(--device cuda --precision bf16)
  gpt_args=(--device cuda --precision bf16)
fi
status=0
if [ "$stage" = all ] || [ "$stage" = bert ]; then
  "$VPY" bench/bench_train.py "${bert_args[@]}" --data-dir $CARRY/bert "${deny[@]}" \
    --json "$OUT/bert.json" >"$OUT/bert.log" 2>&1 || status=$?
  tail -n 12 "$OUT/bert.log"
fi
if [ "$stage" = all ] || [ "$stage" = gpt ]; then
  "$VPY" bench/bench_gpt.py "${gpt_args[@]}" --data-dir $CARRY/gpt "${deny[@]}" \
    --json "$OUT/gpt.json" >"$OUT/gpt.log" 2>&1 || status=$?
  tail -n 12 "$OUT/gpt.log"
fi
exit $status
