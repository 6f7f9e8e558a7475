"""`python -m lanes_lifecycle`: the lifecycle service as its own process (NATS_URL, DATABASE_URL, REDIS_URL)."""

from lanes_lifecycle.entrypoints.service import SERVICE
from lanes_runtime.service import serve_main

if __name__ == "__main__":
    serve_main(SERVICE)
