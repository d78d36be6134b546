"""`bc-command-queue`: run one instance of the service."""

from better_compute.service import run_service

from .service import CommandQueueService


def main() -> None:
    run_service(CommandQueueService)


if __name__ == "__main__":
    main()
