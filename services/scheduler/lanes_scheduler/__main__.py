"""`lanes-scheduler` (or `python -m lanes_scheduler`): the scheduler service as its own process."""

from lanes_runtime.service import serve_main
from lanes_scheduler.entrypoints.service import SERVICE


def main() -> None:
    """Run the service until SIGTERM or Ctrl-C."""
    serve_main(SERVICE)


if __name__ == "__main__":
    main()
