# One image for every Lanes service: `docker run <image> serve scheduler`, `... serve router`, and so on.
# Versions come from the pins in pyproject.toml (there is no lock file).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/lanes
WORKDIR /src
COPY pyproject.toml README.md ./
COPY libs/ libs/
COPY services/ services/
RUN /opt/lanes/bin/pip install .

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
ENTRYPOINT ["lanes"]
CMD ["--help"]
