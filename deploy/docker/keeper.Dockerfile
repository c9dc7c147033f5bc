# The keeper's image, registry.example.com/weightcache:0.1.0 in deploy/kubernetes/keeper-daemonset.yaml
# (docs/deployment.md). Build from the repository root:
#   docker build -f deploy/docker/keeper.Dockerfile -t registry.example.com/weightcache:0.1.0 .
# The keeper and the keeper commands (serve, ls, inspect, evict, stop) never import torch, so the image has none:
# weightcache without its dependencies, then only those the keeper imports (attrs, filelock, typing-extensions;
# packaging for `weightcache doctor`). Checked by tests/test_deploy.py; not built in CI (no Docker there).
FROM python:3.11-slim

COPY pyproject.toml README.md /src/
COPY weightcache /src/weightcache
RUN pip install --no-cache-dir --no-deps /src \
    && pip install --no-cache-dir "attrs>=23.1" "filelock>=3.12" "typing-extensions>=4.7" "packaging>=21" \
    && rm -rf /src

# The uid the DaemonSet runs the keeper as (runAsUser); engines must run as the same uid (SO_PEERCRED).
USER 1000:1000
ENTRYPOINT ["weightcache"]
CMD ["serve", "--socket-dir", "/run/weightcache/keeper"]
