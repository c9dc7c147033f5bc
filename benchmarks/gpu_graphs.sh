#!/usr/bin/env bash
# Issue 31 on a GPU machine (the H200 runs of docs/benchmarks.md, "CUDA graphs restored"): the cuda tests of the
# graph restore and the benchmark, logs under $OUT (or /tmp/out). Runs from a checkout; weightcache from the tree.
#   gpu_graphs.sh test        pytest -m cuda of tests/test_graphs.py and tests/test_torch_graphs.py
#   gpu_graphs.sh bench ARGS  benchmarks/graph_restore.py bench ARGS
#   gpu_graphs.sh env         what the machine has (driver, torch, CUPTI)
#   gpu_graphs.sh regress     the GPU tests of attach and memory (tests/test_cuda.py, tests/test_cuda_memory.py)
#   gpu_graphs.sh node-costs ARGS  benchmarks/graph_node_costs.py ARGS (what each way of making nodes costs)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
cmd=${1:?usage: gpu_graphs.sh test|bench|env|regress|node-costs}
shift
case "$cmd" in
env)
    { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
      python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
      python3 -c 'import weightcache.graphs.cubins as c; print("cupti", c.load_cupti())'
      echo "address hint honoured, by reservation size:"; python3 benchmarks/graph_restore.py probe-va
    } 2>&1 | tee "$out/env.txt" ;;
test)
    timeout 500 python3 -m pytest -p no:cacheprovider -m cuda -q -rA "$@" tests/test_graphs.py tests/test_torch_graphs.py \
        2>&1 | tee "$out/graphs-cuda-tests.log" ;;
regress)
    timeout 450 python3 -m pytest -p no:cacheprovider -m cuda -q "$@" tests/test_cuda.py tests/test_cuda_memory.py \
        2>&1 | tee "$out/cuda-tests.log" ;;
bench)
    timeout 550 python3 benchmarks/graph_restore.py bench "$@" 2>&1 | tee -a "$out/graphs-bench.log" ;;
node-costs)
    timeout 300 python3 benchmarks/graph_node_costs.py --json "$out/graph-node-costs.json" "$@" 2>&1 \
        | tee "$out/graph-node-costs.log" ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
