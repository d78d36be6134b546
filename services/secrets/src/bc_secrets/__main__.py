"""`bc-secrets`: run one instance of the service."""

from better_compute.service import run_service

from .service import SecretsService


def main() -> None:
    run_service(SecretsService)


if __name__ == "__main__":
    main()
