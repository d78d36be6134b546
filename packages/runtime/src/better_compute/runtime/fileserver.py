"""``python -m better_compute.runtime.fileserver --dir D --port P``: files over HTTP on loopback.

What ``bcx dev up`` starts to serve the built ramdisk to the site agent's cache (which fills
over http(s) only): each file named by its sha256, so a rebuilt ramdisk gets new URLs and an
engine that started with the old ones still finds them. GET and HEAD only; nothing is listed.
"""

from __future__ import annotations

import argparse
import functools
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["main"]


class _Handler(SimpleHTTPRequestHandler):
    def list_directory(self, path: Any) -> None:
        self.send_error(404, "not found")
        return None

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the site agent logs its fills


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bc-files", description="serve a folder's files over HTTP")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bind", default="127.0.0.1")
    args = parser.parse_args(argv)
    handler = functools.partial(_Handler, directory=args.dir)
    with ThreadingHTTPServer((args.bind, args.port), handler) as server:
        server.serve_forever()


if __name__ == "__main__":
    main()
