# Molt on CUDA machines: vLLM, NVIDIA AutoModel and torch pinned together (vLLM 0.32 wants transformers < 5.20;
# nemo-automodel 0.7 pins 5.18).
#   docker build -t molt . && docker run --gpus all --shm-size 32g -it molt python molt.py --agent agents/copy.py
FROM nvcr.io/nvidia/pytorch:25.10-py3

ENV PIP_NO_CACHE_DIR=1
# bubblewrap and libseccomp isolate model-written code (rewards/sandbox.py); run the container with user namespaces
# allowed (e.g. docker run --security-opt seccomp=unconfined, or a profile that permits unshare)
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap=0.* libseccomp2=2.* \
    && rm -rf /var/lib/apt/lists/* && useradd --create-home --uid 10001 --shell /bin/bash molt
WORKDIR /opt/molt
COPY pyproject.toml README.md LICENSE molt.py molt_view.py ./
RUN python -m pip install --no-cache-dir "vllm==0.32.0" "nemo-automodel==0.7.0" "transformers==5.18.0" \
        "ray==2.60.0" -e ".[test]"
COPY agents ./agents
COPY rewards ./rewards
COPY examples ./examples
COPY scripts ./scripts
ENV PYTHONPATH=/opt/molt
# Molt runs as an unprivileged user: model-written code then never starts from root (as root, the sandbox drops to
# its own uid first)
RUN chown 10001 /opt/molt
USER 10001
CMD ["python", "molt.py", "--help"]
