"""`bc-pki`: run one instance of the service; `bc-pki callout`: a leaf node's auth callout."""

import sys

from better_compute.service import run_service

from .service import PkiService


def main() -> None:
    if sys.argv[1:2] == ["callout"]:
        from .callout import main as callout

        callout(sys.argv[2:])
        return
    run_service(PkiService)


if __name__ == "__main__":
    main()
