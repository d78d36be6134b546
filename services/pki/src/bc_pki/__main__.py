"""`bc-pki`: run one instance of the service."""

from better_compute.service import run_service

from .service import PkiService


def main() -> None:
    run_service(PkiService)


if __name__ == "__main__":
    main()
