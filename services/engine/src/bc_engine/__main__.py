"""`bc-engine`: run one instance of the service."""

from better_compute.service import run_service

from .service import EngineService


def main() -> None:
    run_service(EngineService)


if __name__ == "__main__":
    main()
