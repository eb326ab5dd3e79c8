"""An upstream that drops a connection under a request, written on raw
sockets with Python's standard library: the first connection to carry a
second request reads that request whole, then closes without answering, as
a server whose keep-alive timeout ends just as a request arrives, or which
crashes mid-request. Every other request is answered 201.

It counts the requests it received per Idempotency-Key (any spelling of the
field name's case); GET /_count?key=K answers {"received": N}. It prints
"PORT <n>" once it listens on 127.0.0.1.
"""

import json
import socket
import sys
import threading
from urllib.parse import parse_qs, urlparse

lock = threading.Lock()
received = {}  # Idempotency-Key -> requests received
dropped = False  # whether a connection was dropped under a request yet


def read_request(f):
    """Reads one request: (method, target, headers by lower-case name,
    body), or None at the connection's end."""
    line = f.readline()
    if not line.strip():
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers = {}
    while True:
        h = f.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = f.read(int(headers.get("content-length", "0")))
    return method, target, headers, body


def answer(conn, status, obj):
    body = json.dumps(obj).encode()
    head = "HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (status, len(body))
    conn.sendall(head.encode() + body)


def serve(conn):
    global dropped
    f = conn.makefile("rb")
    try:
        n = 0
        while True:
            req = read_request(f)
            if req is None:
                return
            method, target, headers, _ = req
            n += 1
            url = urlparse(target)
            if method == "GET" and url.path == "/_count":
                key = parse_qs(url.query).get("key", [""])[0]
                with lock:
                    answer(conn, 200, {"received": received.get(key, 0)})
                continue
            key = headers.get("idempotency-key", "")
            with lock:
                received[key] = received.get(key, 0) + 1
                drop = n == 2 and not dropped
                dropped = dropped or drop
            if drop:
                conn.shutdown(socket.SHUT_RDWR)
                return
            answer(conn, 201, {"key": key})
    except OSError:
        pass
    finally:
        f.close()
        conn.close()


def main():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    print("PORT %d" % server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
