# An engine image with the weightcache plugin, registry.example.com/vllm-weightcache:0.1.0 in
# deploy/kubernetes/engine-deployment.yaml (docs/deployment.md). Build from the repository root:
#   docker build -f deploy/docker/vllm.Dockerfile -t registry.example.com/vllm-weightcache:0.1.0 .
# vLLM's own image, plus weightcache installed with --no-deps: it must not replace the torch that vLLM pins.
# Installing it registers the vllm.general_plugins entry point that adds `--load-format weightcache`; the
# cuda extra (NVIDIA's cuda-bindings) gives it CUDA VMM segments. Pick the vLLM release with
# --build-arg VLLM_VERSION=... (docs/backends.md says which releases the adapter supports). Checked by
# tests/test_deploy.py; not built in CI (no Docker there).
ARG VLLM_VERSION=v0.32.0
FROM vllm/vllm-openai:${VLLM_VERSION}

COPY pyproject.toml README.md /src/
COPY weightcache /src/weightcache
RUN pip install --no-cache-dir --no-deps /src \
    && pip install --no-cache-dir "attrs>=23.1" "filelock>=3.12" "cuda-bindings>=12.8" \
    && rm -rf /src \
    && python3 -c "from importlib.metadata import entry_points; assert any(e.name == 'weightcache' for e in entry_points(group='vllm.general_plugins'))"

# The entrypoint stays vLLM's; the Deployment's command runs `vllm serve ... --load-format weightcache`, as the
# uid of its securityContext (the keeper's).
