#!/bin/bash
# Runs bench/GPU-PENDING.md's items on a lent GPU machine (the device tool), in stages named on the
# command line: `bash bench/gpu_pending_run.sh setup tests timing offload`; a
# second call reruns what did not finish. Everything lands in /tmp/gpu_res and is packed into $OUT/gpu_results.tar.gz after every step,
# so a call stopped at its limit still returns what finished (the tool returns at most 8 files).
# Peers travel as wheels in the ignored .whl/ folder (carry it): see ../shared/GPU.md.
set -u
R=/tmp/gpu_res
mkdir -p "$R"
export PYTHONUNBUFFERED=1 MEMSCHED_BENCH_OUT=$R
pack() {  # under a lock: parallel steps pack too
    flock /tmp/gpu_pack.lock sh -c "tar czf \"$OUT/r.tmp\" -C \"$R\" . 2>/dev/null; mv \"$OUT/r.tmp\" \"$OUT/gpu_results.tar.gz\""
}
step() {  # step NAME SECONDS COMMAND...: one item, its log, its exit status and wall time
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" >"$R/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc wall_s=$((SECONDS - t0))" | tee -a "$R/steps.txt"
    tail -2 "$R/$name.log"
    pack
}

for stage in "$@"; do
case $stage in
setup)
    if ! python3 -c "import deepspeed, torchao" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps .whl/*.whl
        DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation .whl/deepspeed-*.tar.gz
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
    { nvidia-smi; python3 -c "import torch, sys; print(torch.__version__, sys.version)"; } >"$R/machine.txt" 2>&1
    (timeout 200 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
        >"$R/ds_cpu_adam_build.log" 2>&1 &)
    ;;
tests)  # correctness and memory, in parallel (items 2, 6, 11, 12, 17; the CUDA tests, new cases among them)
    step gpu_pytest_cuda 200 python3 -m pytest -q -m cuda -p no:cacheprovider -rs &
    step gpu_pytest_sim_backend 200 python3 -m pytest -q -p no:cacheprovider tests/sim_backend_cases.py \
        tests/test_training_code.py &
    step demo_cuda_capped 150 memsched demo --steps 30 --out "$R/demo" &
    step param_alignment 120 python3 bench/param_alignment.py &  # item 17
    step gpu_pytest_full 300 python3 -m pytest -q -m "not cuda" -p no:cacheprovider -n 6 &
    # item 6: its bit-identity does not depend on what runs beside it; its step ratio does (say so)
    { step compile_step_small_cuda 240 python3 bench/compile_step.py --device cuda --size small \
          --name compile_step_small_cuda
      step compile_step_small_cuda_deterministic 240 python3 bench/compile_step.py --device cuda --size small \
          --inductor-deterministic --name compile_step_small_cuda_deterministic
      step compile_step_unfamiliar_cuda 240 python3 bench/compile_step.py --device cuda --model unfamiliar \
          --size small --own-process-steps 6 --name compile_step_unfamiliar_cuda; } &
    wait
    ;;
timing)  # alone on the machine (items 4 and 13)
    step gpu_step_time 300 python3 bench/gpu_step_time.py --mem-cap 13GiB --steps 6 --warmup 2 --timeout 75 \
        --policies cpu cpu+overlap cpu+backward auto auto+overlap auto+backward \
        --peers torch_adamw torchao_cpu_offload deepspeed_zero_offload
    ;;
streamed)  # item 23, alone
    step gpu_step_time_2_7b_streamed 600 python3 bench/gpu_step_time.py --size 2.7b --batch 1 --seq 1024 \
        --mem-cap 13GiB --steps 4 --warmup 2 --timeout 900 --policies auto+overlap auto+overlap+auto-update \
        auto+overlap+device-update --peers torch_adamw --name gpu_step_time_2_7b_streamed
    ;;
offload)  # item 9, alone
    step plan_760m_b1 60 memsched plan --model 760m --batch-size 1 --seq-len 1024 --capacity 13GiB --json
    step gpu_step_time_param_offload 240 python3 bench/gpu_step_time.py --size 760m --batch 1 --mem-cap 13GiB \
        --steps 4 --warmup 2 --timeout 110 --policies auto:warmup_non_model_share=1.0 \
        auto:warmup_non_model_share=1.0+overlap --peers deepspeed_zero3_offload --name gpu_step_time_param_offload
    ;;
cuda)  # the CUDA-side correctness items alone (1 and 8, 3, 12, 11), in parallel (a C++ backtrace of a crash:
       # cuda-gdb -q -batch -ex run -ex bt --args python3 ..., which runs programs without GPU code too)
    step gpu_pytest_cuda 150 python3 -m pytest -q -m cuda -p no:cacheprovider -rs --tb=long &
    step gpu_numerics 170 python3 bench/gpu_numerics.py --overlap all &
    # the demo through a wrapper that prints the traceback of an out-of-memory error (the CLI prints one line)
    step demo_cuda_capped 120 python3 -c "
import sys, traceback
import memsched.cli.demo as demo
from memsched.cli.main import main
train = demo._train
def traced(*a, **k):
    try:
        return train(*a, **k)
    except BaseException:
        traceback.print_exc()
        raise
demo._train = traced
sys.exit(main(['demo', '--steps', '30', '--out', '$R/demo']))" &
    step gpu_pytest_sim_backend 150 python3 -m pytest -q -p no:cacheprovider tests/sim_backend_cases.py \
        tests/test_training_code.py &
    wait
    ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
done
