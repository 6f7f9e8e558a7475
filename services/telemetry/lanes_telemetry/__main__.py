"""`lanes-telemetry` (or `python -m lanes_telemetry`): the telemetry service as its own process."""

from lanes_runtime.service import serve_main
from lanes_telemetry.entrypoints.service import SERVICE


def main() -> None:
    """Run the service until SIGTERM or Ctrl-C."""
    serve_main(SERVICE)


if __name__ == "__main__":
    main()
