# The project's one image: the router, the simulated backend and the traffic generator
# (docker-compose.yml picks the program with each service's command). Everything is installed
# at build time; nothing is downloaded when a container starts.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY . /app
# the packages (contract, rendering, router, backends) with uvloop; models/ (the demo model) stays in /app; bench/ runs from /app (python -m bench.traffic)
RUN pip install ".[fast]" \
    && python -c "import contract.errors, rendering.model, router.app, backends.app, bench.traffic" \
    && useradd --system --uid 10001 --home-dir /app app
USER app

EXPOSE 8000 8001 8002 8100 8101 8102 8110 8111 8112 8120 8121 8122
# overridden by every compose service
CMD ["python", "-m", "router", "--help"]
