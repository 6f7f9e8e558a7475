"""`python -m lanes_scheduler`: the scheduler service as its own process (NATS_URL, DATABASE_URL, REDIS_URL)."""

from lanes_runtime.service import serve_main
from lanes_scheduler.entrypoints.service import SERVICE

if __name__ == "__main__":
    serve_main(SERVICE)
