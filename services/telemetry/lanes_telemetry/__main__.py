"""`python -m lanes_telemetry`: the telemetry service as its own process (NATS_URL, DATABASE_URL, REDIS_URL)."""

from lanes_runtime.service import serve_main
from lanes_telemetry.entrypoints.service import SERVICE

if __name__ == "__main__":
    serve_main(SERVICE)
