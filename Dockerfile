# One image per deployable, each with only what it runs:
#   docker build --build-arg SERVICE=scheduler -t lanes-scheduler .
# SERVICE is one of scheduler, lifecycle, telemetry, recovery, router, audit, console. The image installs that
# service's package and its dependencies (the event contract and the consumer runtime), never the embedded
# servers, the sandbox or the CLI; tests/test_images.py checks that installed set without a Docker engine.
# Versions come from the pins in each pyproject.toml (no lock file is committed).

FROM python:3.11-slim AS build
ARG SERVICE
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PROJECT_ENVIRONMENT=/opt/lanes \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1
RUN test -n "$SERVICE" || { echo "build with --build-arg SERVICE=<service>" >&2; exit 2; }
RUN pip install uv==0.13.9
WORKDIR /src
COPY . .
RUN uv sync --no-dev --no-editable --package "lanes-${SERVICE}" \
    && ln -s "/opt/lanes/bin/lanes-${SERVICE}" /opt/lanes/bin/lanes-service

FROM python:3.11-slim
ENV PATH=/opt/lanes/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 lanes \
    && useradd --system --uid 10001 --gid lanes --create-home --home-dir /home/lanes \
       --shell /usr/sbin/nologin lanes
COPY --from=build /opt/lanes /opt/lanes
USER 10001:10001
WORKDIR /home/lanes
ENTRYPOINT ["lanes-service"]
