#!/usr/bin/env bash
# The GPU checks and figures in one go (a lent CUDA machine whose python3 has torch): fla's kernels tested
# against the PyTorch ops, then the speed rows of BENCHMARKS.md's GPU sections, each step with its own time
# limit so one slow step leaves the others' results. Logs go to the folder given (default bench/results/gpu).
#
#     bash bench/gpu_run.sh OUT_DIR            # dofla's src on PYTHONPATH; fla-core installed beforehand
set -u -o pipefail
out=${1:-bench/results/gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=${DEADLINE:-480}  # seconds for all steps together: a step gets at most what is left
only=${STEPS:-}               # e.g. STEPS="fla_op_tests gen_linear_b1": run only the steps named
step() {  # step NAME SECONDS COMMAND...: run, log to OUT/NAME.log, say how it ended
    local name=$1 seconds=$2
    shift 2
    if [[ -n $only && " $only " != *" $name "* ]]; then
        return
    fi
    local start=$SECONDS left=$((deadline - SECONDS))
    if ((left < 20)); then
        echo "$name: not run (time used up)"
        return
    fi
    ((seconds > left)) && seconds=$left
    timeout "$seconds" "$@" >"$out/$name.log" 2>&1
    echo "$name: rc $? in $((SECONDS - start)) s"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)"
} >"$out/machine.log" 2>&1
cat "$out/machine.log"
# -x --tb=short: a failure's cause is printed when it happens, not in a report a time limit may cut off
# (Triton compiles each new shape of fla's kernels: the GPU tests take minutes on a fresh machine)
pytest="python3 -m pytest -p no:cacheprovider -x --tb=short"
tests="$pytest -q tests/test_fla_backend.py"
gen="python3 bench/bench_generation.py --shape smollm2-135m --device cuda --new-tokens 32"
# graph decoding: the captured step against the eager one (decoding never runs fla: its kernels are left out)
step graph_tests 90 env DOFLA_FLA=0 $pytest -v tests/test_graph_decode.py -k on_gpu
step gen_linear_b16_graph 150 $gen --recipe gated-delta-linear --contexts 32768 --batch-size 16 --new-tokens 16 --graph
step gen_linear_b1_graph 90 $gen --recipe gated-delta-linear --contexts 4096,65536 --graph
step gen_hybrid_b16_graph 150 $gen --recipe gated-delta --contexts 32768 --batch-size 16 --new-tokens 16 --graph
# the retrieval recipe's 4 kept softmax layers (their keys in place at a count on the device) under the graph
step gen_retrieval_b16_graph 150 $gen --recipe gated-delta-retrieval --softmax-layers 7,8,18,23 --contexts 32768 --batch-size 16 --new-tokens 16 --graph
# the same with the teacher also decoding from generate's static cache (compiled by transformers: CUDA graphs)
step gen_linear_b16_static 240 $gen --recipe gated-delta-linear --contexts 32768 --batch-size 16 --new-tokens 16 --graph --teacher-static
# the prefill ceiling: the teacher with its attention replaced by zeros beside the teacher and the student
step gen_ceiling 120 $gen --recipe gated-delta-linear --contexts 4096,16384,65536 --ceiling
# -v: each test's result as it ends (the first of them compiles fla's kernels for minutes on a fresh machine)
step fla_op_tests 240 $pytest -v tests/test_fla_backend.py -k "ops_on_fla_kernels_match"
step fla_tests 150 $tests -k "stand_ins_follow or dispatch_to_fla or converted_model_on_gpu"
step gen_linear_b1 120 $gen --recipe gated-delta-linear --contexts 4096,16384,65536 --profile
step distill_linear 100 python3 bench/bench_distill.py --device cuda --random-weights --recipe gated-delta-linear --batch-size 4 --seq-len 1024
# the same with each layer's loss and backward replayed from CUDA graphs, and the graphed training's GPU tests
step distill_graphs 120 python3 bench/bench_distill.py --device cuda --random-weights --recipe gated-delta-linear --batch-size 4 --seq-len 1024 --cuda-graphs
step distill_graphs_hybrid 120 python3 bench/bench_distill.py --device cuda --random-weights --recipe gated-delta --batch-size 4 --seq-len 1024 --cuda-graphs
step graphed_training_tests 150 $pytest -v tests/test_graphed_training.py -k on_gpu
step gen_linear_b16 120 $gen --recipe gated-delta-linear --contexts 32768 --batch-size 16 --new-tokens 16
step gen_hybrid_b1 100 $gen --recipe gated-delta --contexts 4096,16384,65536
step gen_linear_b1_pytorch 100 env DOFLA_FLA=0 $gen --recipe gated-delta-linear --contexts 4096,16384  # no fla
tail -n 4 "$out"/*.log
