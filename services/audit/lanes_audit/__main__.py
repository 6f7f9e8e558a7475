"""`lanes-audit` (or `python -m lanes_audit`): the audit service as its own process."""

from lanes_audit.entrypoints.service import SERVICE
from lanes_runtime.service import serve_main


def main() -> None:
    """Run the service until SIGTERM or Ctrl-C."""
    serve_main(SERVICE)


if __name__ == "__main__":
    main()
