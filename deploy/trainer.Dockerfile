# The demo trainer image: the agent (attnchecker) on the CPU build of torch, running `attnchecker demo` against
# the compose collector. Build context: the repository root.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CPU index: otherwise the agent's dependency resolution pulls a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /opt/attnchecker
COPY agent/ ./agent/
RUN pip install ./agent

RUN useradd --system --uid 10002 --home-dir /opt/attnchecker trainer \
    && mkdir -p /var/spool/attnchecker \
    && chown trainer /var/spool/attnchecker
USER trainer

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import attnchecker"
CMD ["attnchecker", "demo"]
