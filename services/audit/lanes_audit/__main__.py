"""`python -m lanes_audit`: the audit service as its own process (NATS_URL, DATABASE_URL, REDIS_URL)."""

from lanes_audit.entrypoints.service import SERVICE
from lanes_runtime.service import serve_main

if __name__ == "__main__":
    serve_main(SERVICE)
