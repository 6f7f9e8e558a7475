"""`lanes-recovery` (or `python -m lanes_recovery`): the recovery service as its own process."""

from lanes_recovery.entrypoints.service import SERVICE
from lanes_runtime.service import serve_main


def main() -> None:
    """Run the service until SIGTERM or Ctrl-C."""
    serve_main(SERVICE)


if __name__ == "__main__":
    main()
