"""gRPC over plain HTTP/2, for what grpc's own clients do not do: a client that never grants flow-control window (no
WINDOW_UPDATE frame), so that the server can send it at most the 65,535 bytes of the initial windows and every larger
answer stays in the server, unsent; and a call whose header values are bytes that grpc's Python client refuses to
send (other gRPC stacks send them)."""

from __future__ import annotations

import socket
import struct
import threading
import time

_DATA, _HEADERS, _SETTINGS, _PING = 0, 1, 4, 6
_END_STREAM, _END_HEADERS, _ACK = 1, 4, 1


def _length(n: int, prefix_bits: int = 7) -> bytes:
    """An HPACK integer with a prefix of `prefix_bits` bits (RFC 7541, 5.1)."""
    top = (1 << prefix_bits) - 1
    if n < top:
        return bytes([n])
    out, n = [top], n - top
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    return bytes([*out, n])


def _header(name: str | bytes, value: str | bytes) -> bytes:
    """A literal header field without indexing, its name a literal (RFC 7541, 6.2.2)."""
    name_bytes = name.encode() if isinstance(name, str) else name
    value_bytes = value.encode() if isinstance(value, str) else value
    return b"\x00" + _length(len(name_bytes)) + name_bytes + _length(len(value_bytes)) + value_bytes


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


class UnreadingConnection:
    """One connection; `call` opens a stream with one request message and half-closes it. Frames the server sends are
    read (settings and pings acknowledged, as any client does) and counted, and their data never acknowledged."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port))
        self._authority = f"{host}:{port}"
        self._next_stream = 1
        self._lock = threading.Lock()
        self.data_bytes = 0
        self._sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(_SETTINGS, 0, 0))
        threading.Thread(target=self._read, daemon=True).start()

    def call(self, path: str, message: bytes) -> int:
        """Sends `message` to `path` as one gRPC request; returns the stream's id."""
        stream, self._next_stream = self._next_stream, self._next_stream + 2
        headers = b"".join(_header(name, value) for name, value in (
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self._authority),
            ("content-type", "application/grpc"), ("te", "trailers")))
        body = b"\x00" + struct.pack(">I", len(message)) + message
        with self._lock:
            self._sock.sendall(_frame(_HEADERS, _END_HEADERS, stream, headers))
            for start in range(0, len(body), 16384):
                last = start + 16384 >= len(body)
                self._sock.sendall(_frame(_DATA, _END_STREAM if last else 0, stream, body[start:start + 16384]))
        return stream

    def close(self) -> None:
        # shutdown first: close() alone leaves the connection open while the reading thread waits in recv
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _read(self) -> None:
        try:
            while True:
                head = self._exactly(9)
                size, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                payload = self._exactly(size) if size else b""
                if kind == _DATA:
                    self.data_bytes += size
                elif kind in (_SETTINGS, _PING) and not flags & _ACK:
                    with self._lock:
                        self._sock.sendall(_frame(kind, _ACK, 0, payload if kind == _PING else b""))
        except OSError:
            return

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self._sock.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data


_WINDOW_UPDATE = 8


def call_status(host: str, port: int, path: str, message: bytes, headers: list[tuple[bytes, bytes]],
                timeout_s: float = 10.0) -> int:
    """One call of `message` to `path` on a new connection, with `headers` added as raw bytes; returns its grpc-status.
    The status is read from the trailers' bytes: grpc writes the header's name and a short value as literals."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        block = b"".join(_header(name, value) for name, value in [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"x"),
            (b"content-type", b"application/grpc"), (b"te", b"trailers"), *headers])
        body = b"\x00" + struct.pack(">I", len(message)) + message
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(_SETTINGS, 0, 0)
                     + _frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30))
                     + _frame(_HEADERS, _END_HEADERS, 1, block) + _frame(_DATA, _END_STREAM, 1, body))
        received, deadline = b"", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            at = received.find(b"grpc-status")
            if at >= 0 and at + 12 < len(received):
                size = received[at + 11]  # a literal value of fewer than 127 bytes, not Huffman-coded
                if at + 12 + size <= len(received):
                    return int(received[at + 12: at + 12 + size])
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    raise TimeoutError(f"no grpc-status within {timeout_s} s")
