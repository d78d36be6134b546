"""``TcpGate``: a TCP forwarder on loopback that a test can cut, for a link that goes away.

A bcd or a site agent pointed at the gate instead of nats-server loses its connection when the
gate is cut (every open connection is closed, new ones are closed at once) and gets it back
when the cut ends: what a pulled cable or a lost route looks like to the client.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from ...runtime.embedded import free_port

__all__ = ["TcpGate"]


class TcpGate:
    def __init__(self, upstream: str) -> None:
        """``upstream``: ``nats://host:port`` or ``host:port``."""
        hostport = upstream.split("://", 1)[-1].rstrip("/")
        host, _, port = hostport.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(port))
        self.scheme = upstream.split("://", 1)[0] if "://" in upstream else "nats"
        self.port = free_port()
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"
        self.cuts = 0
        self._closed_until = 0.0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()

    def start(self) -> TcpGate:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        listener.settimeout(0.2)
        self._listener = listener
        threading.Thread(target=self._accept, name=f"gate-{self.port}", daemon=True).start()
        return self

    @property
    def is_cut(self) -> bool:
        return time.monotonic() < self._closed_until

    def cut(self, seconds: float) -> None:
        """Drop every connection now and refuse new ones for ``seconds``."""
        with self._lock:
            self.cuts += 1
            self._closed_until = time.monotonic() + seconds
            doomed, self._open = self._open, set()
        for sock in doomed:
            _close(sock)

    def heal(self) -> None:
        self._closed_until = 0.0

    def close(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            _close(self._listener)
        self.cut(0)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.is_cut:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
