"""A TCP relay in the test process: what kube-proxy's userspace mode did for one Service. A real node's pods
reach the host only on their bridge's address (tests/cluster/node.py), and the test control plane's API
server listens on 127.0.0.1 only; the relay listens on the bridge's address and passes the bytes through
(TLS end to end: the pods verify the API server's own certificate). Test infrastructure."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading


class TcpRelay:
    def __init__(self, listen_host: str, target: tuple[str, int]) -> None:
        self.target = target
        relay = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                relay._pipe(self.request)

        self._server = socketserver.ThreadingTCPServer((listen_host, 0), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return host, port

    def start(self) -> TcpRelay:
        self._thread = threading.Thread(target=self._server.serve_forever, name="tcprelay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._server.server_close()

    def _pipe(self, downstream: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            return
        upstream.settimeout(None)

        def copy(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=copy, args=(upstream, downstream), daemon=True)
        back.start()
        copy(downstream, upstream)
        back.join()
        upstream.close()
