"""``python -m better_compute.cli`` is ``bcx``."""

from .main import main

if __name__ == "__main__":
    main()
