# The collector image (attnchecker-server), used by the compose services `migrate` and `collector`.
# Build context: the repository root (`docker-compose build`, or `docker build -f deploy/collector.Dockerfile .`).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/attnchecker
COPY server/ ./server/
RUN pip install ./server
# A non-editable install cannot find the repository's migrations/ next to the package: point at the copy.
# `migrate` and /readyz (which compares the database with the head revision) both read it.
COPY migrations/ ./migrations/
ENV ATTNCHECKER_MIGRATIONS_DIR=/opt/attnchecker/migrations \
    ATTNCHECKER_DATA_DIR=/opt/attnchecker/data

RUN useradd --system --uid 10001 --home-dir /opt/attnchecker attnchecker \
    && mkdir -p /run/attnchecker /opt/attnchecker/data \
    && chown attnchecker /run/attnchecker /opt/attnchecker/data
USER attnchecker

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --retries=6 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"
# One uvicorn worker per container: scale with replicas (metrics come from the database, so any replica answers).
CMD ["attnchecker-server", "serve", "--host", "0.0.0.0", "--port", "8000"]
