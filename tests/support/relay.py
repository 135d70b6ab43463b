"""A TCP relay between clients and a server that a test can cut, as a database that restarts does to
its clients: `cut()` ends every connection through it and refuses new ones; `restore()` listens
again on the same port. The server behind it (the stack's PostgreSQL) is the real one."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.support.infra import free_port


class TcpRelay:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.port = free_port()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listening = threading.Event()
        self._acceptor: threading.Thread | None = None

    def __enter__(self) -> TcpRelay:
        self.restore()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()

    def restore(self) -> None:
        """Listen on the relay's port (again)."""
        listener = socket.create_server(("127.0.0.1", self.port))
        listener.settimeout(0.1)
        self._listening.set()
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._acceptor.start()

    def cut(self) -> None:
        """Stop listening (a new connection is refused) and end every open connection, on both sides."""
        self._listening.clear()
        if self._acceptor is not None:
            self._acceptor.join()  # its listening socket closed
        with self._lock:
            for sock in self._sockets:
                # shut down first: a close() alone leaves the socket open while a pump's recv() waits
                # on it, and the database would keep the session (and the row locks it holds)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while self._listening.is_set():
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                try:
                    server = socket.create_connection(self.target)
                except OSError:
                    client.close()
                    continue
                with self._lock:
                    self._sockets |= {client, server}
                for source, sink in ((client, server), (server, client)):
                    threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
