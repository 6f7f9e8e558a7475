"""`lanes-lifecycle` (or `python -m lanes_lifecycle`): the lifecycle service as its own process."""

from lanes_lifecycle.entrypoints.service import SERVICE
from lanes_runtime.service import serve_main


def main() -> None:
    """Run the service until SIGTERM or Ctrl-C."""
    serve_main(SERVICE)


if __name__ == "__main__":
    main()
