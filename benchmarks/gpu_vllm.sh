#!/usr/bin/env bash
# vLLM on a GPU machine that has PyTorch but no vLLM and no network (how the H200 runs of docs/benchmarks.md were
# made). The vLLM release and the dependencies that machine lacks travel as parts of one tar, each part in its own
# call: either shared/tools/carry-wheels' (wheels/: vLLM's wheel and its missing dependencies; see WHEELS below) or
# an xz-compressed one (site/: vLLM's unpacked wheel; wheels/: its missing dependencies).
# WHEELS: what vLLM 0.26.0 needs at import and to serve offline beside the H200 image's packages (found by importing
# its engine, worker, Llama model, FlashAttention backend and API server in a venv of those packages):
#   gpu_vllm.sh receive DIR       copy the parts found in DIR to /tmp/carry-vllm (once per part, any order)
#   gpu_vllm.sh install           join and unpack them; install the wheels, and weightcache as a distribution (vLLM
#                                 finds its plugin through the entry point), into /tmp/site-vllm
#   gpu_vllm.sh test [ARGS]       the GPU tests of the vLLM adapter (tests/backends/test_vllm_cuda.py)
#   gpu_vllm.sh bench [ARGS]      benchmarks/restart_vllm.py
#   gpu_vllm.sh graph-probe [ARGS] benchmarks/vllm_graph_probe.py (issue 31: vLLM's CUDA graphs over fresh processes)
#   gpu_vllm.sh mp-probe          vLLM's multiprocessing engine with load format auto and weightcache NOT on the
#                                 path, 120 s at most, then every thread's stack (faulthandler)
# Logs go to $OUT (or /tmp/out).
WHEELS="vllm==0.26.0 cbor2==6.3.0 pyzmq==27.3.0 openai-harmony==0.0.8 openai==2.30.0 jiter==0.19.0 distro apache-tvm-ffi==0.1.10
sniffio==1.3.1 msgspec==0.23.0 pybase64==1.5.1 cachetools==8.0.2 llguidance==1.7.6 xgrammar==0.2.7 fastapi==0.136.3
starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
partial-json-parser==0.2.1.1.post7 uvicorn==0.54.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16
jmespath supervisor python-json-logger==4.2.0 prometheus-fastapi-instrumentator==8.1.0 setproctitle==1.3.8
blake3==1.0.11 compressed-tensors==0.17.0 depyf==0.20.0 astor==0.8.1 dill==0.4.1 lark==1.2.2 outlines-core==0.2.14
interegular==0.3.3 lm-format-enforcer==0.11.3 gguf ijson==3.6.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
referencing==0.37.0 rpds-py==2026.9.1 mistral-common==1.13.1 pycountry==26.2.16 pydantic-extra-types==2.11.1 diskcache"
#   here: CARRY_PART_MB=55 shared/tools/carry-wheels .carry $WHEELS   (six parts of 55 MiB)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
# its own carry and site folders, so that a lease can hold SGLang's (benchmarks/gpu_sglang.sh) beside them
carry=/tmp/carry-vllm
mkdir -p "$out" "$carry"
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1
# FlashInfer is not carried (its kernels come from the network at run time): vLLM samples with PyTorch instead
export VLLM_USE_FLASHINFER_SAMPLER=0
site=/tmp/site-vllm
# weightcache as a distribution (vLLM finds its plugin through the entry point), replacing any earlier copy
wc_install() {
    python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-compile --target "$site" . 2>&1 |
        grep -v "already exists" || true
}
cmd=${1:?usage: gpu_vllm.sh receive DIR|install|test|bench|graph-probe|mp-probe}
shift
case "$cmd" in
receive)
    cp "$1"/part.* "$carry"/ && ls -l "$carry"
    ;;
install)
    set -e
    mkdir -p "$site"
    if [ "$(head -c 6 "$carry"/part.00 | od -An -tx1 | tr -d ' ')" = "fd377a585a00" ]; then  # xz: site/ + wheels/
        if command -v xz >/dev/null; then unxz=(xz -d -T0); else unxz=(python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)"); fi
        cat "$carry"/part.* | "${unxz[@]}" | tar -C "$carry" -xf -
        cp -r "$carry"/site/. "$site"/
    else  # carry-wheels: wheels/ only, vLLM's among them
        cat "$carry"/part.* | tar -C "$carry" -xf -
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$carry"/wheels/*.whl
    PYTHONPATH=$site python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    ;;
test)
    wc_install
    PYTHONPATH=$site WEIGHTCACHE_ENGINE_TESTS=vllm python3 -m pytest -p no:cacheprovider -v -x -s \
        tests/backends/test_vllm_cuda.py "$@" 2>&1 | tee "$out/gpu-tests.log"
    ;;
bench)
    wc_install
    PYTHONPATH=$site python3 benchmarks/restart_vllm.py --workdir /tmp/llama8b --json "$out/restart-vllm.json" "$@" \
        2>&1 | tee "$out/restart-vllm.log"
    ;;
graph-probe)
    wc_install
    PYTHONPATH=$site python3 benchmarks/vllm_graph_probe.py --workdir /tmp/vllm-graph-probe \
        --json "$out/vllm-graph-probe.json" "$@" 2>&1 | tee "$out/vllm-graph-probe.out" | tail -150
    cp /tmp/vllm-graph-probe/*.log "$out"/ 2>/dev/null || true
    ;;
mp-probe)
    # weightcache is left out of the path on purpose: does vLLM's engine process start here without any plugin?
    rm -rf /tmp/site-nowc && mkdir -p /tmp/site-nowc && cp -r "$site"/. /tmp/site-nowc/ && rm -rf /tmp/site-nowc/weightcache*
    model=/tmp/mp-probe-model
    [ -e $model/config.json ] || PYTHONPATH=$site python3 -c "import sys; sys.path.insert(0, 'tests/backends'); from engine_models import make_tiny_llama; make_tiny_llama('$model')"
    PYTHONPATH=/tmp/site-nowc PYTHONFAULTHANDLER=1 timeout -s ABRT 120 python3 -X faulthandler -c "
import sys
from vllm import LLM
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, gpu_memory_utilization=0.2, max_model_len=256, dtype='bfloat16')
print('MP ENGINE STARTED', flush=True)
" "$model" >"$out/mp-probe.log" 2>&1 &
    probe=$!
    sleep 110
    for pid in $(pgrep -f EngineCore); do echo "== EngineCore $pid"; cat /proc/$pid/wchan; echo; done >>"$out/mp-probe.log" 2>&1
    pkill -ABRT -f EngineCore
    wait $probe
    echo "probe exit: $?" >>"$out/mp-probe.log"
    grep -E "MP ENGINE STARTED|Error|error|File \"|EngineCore|Thread|probe exit" "$out/mp-probe.log" | tail -80
    ;;
esac
