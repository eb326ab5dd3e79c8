"""An upstream service not written in Go, for the proxy's tests: Python's
standard library only. It makes its own side effects safe the way
docs/proxy.md says an upstream should, and counts everything it is asked.

Each guarded request carries Idempotency-Operation-Key (one per operation)
and Idempotency-Fencing-Token (greater at each attempt). A charge is made
once per operation key; a request whose token is below the greatest seen
for its operation is refused with 409, as a stale attempt's write.

Routes (POST unless said):
  /charges          make the charge: 201 and its JSON
  /slow?ms=N        the same, after N ms
  /hang             never answers (until the connection closes)
  /flaky            500 on an operation's first call, then as /charges
  /secure           as Rails' force_ssl and Django's SECURE_SSL_REDIRECT: 301
                    to https:// unless X-Forwarded-Proto is https, else as
                    /charges
  /big?bytes=N      201 with N bytes of body
  /ledger           a charge whose ledger write fails once: the operation's
                    first call makes the charge, then answers 503 (the
                    ledger write failed); the next finds the charge already
                    made under its operation key, answers 409 duplicate and
                    writes the ledger; every later one answers 201 with the
                    original charge. The charge is made once per operation.
  GET /_stats       what it was asked: calls and charges per operation key,
                    operation keys per Idempotency-Key, charges made per
                    operation key on /ledger
  GET anything else 200, echoing the headers it got
It prints "PORT <n>" once it listens on 127.0.0.1. With --tls CERT KEY CA
it serves HTTPS and requires a client certificate signed by CA; with
--unix PATH it listens on that Unix socket instead (and prints "PORT 0").
With --nodelay it sets TCP_NODELAY on its connections; without, it sends an
answer's header and body in two sends under Nagle's algorithm, as
http.server does by default.
"""

import json
import os
import socketserver
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

lock = threading.Lock()
calls = {}       # operation key -> requests received
charges = {}     # operation key -> the charge made for it
tokens = {}      # operation key -> greatest fencing token seen
operations = {}  # "scope/Idempotency-Key" -> set of operation keys
performed = {}   # operation key -> charges made on /ledger
ledger = {}      # operation key -> True once /ledger wrote its ledger line


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def environ(self):
        """The HTTP_ variables a Rack or WSGI server would make of the
        headers: the name in capitals, "-" as "_", every value kept."""
        env = {}
        for name, value in self.headers.items():
            env.setdefault("HTTP_" + name.upper().replace("-", "_"), []).append(value)
        return env

    def do_GET(self):
        if self.path == "/_stats":
            with lock:
                stats = {"calls": calls, "charges": charges, "performed": performed,
                         "operations": {k: sorted(v) for k, v in operations.items()}}
                body = json.dumps(stats).encode()
            self.reply(200, body)
            return
        self.reply(200, json.dumps({"headers": dict(self.headers.items())}).encode())

    def ledger(self, op):
        """De-duplicates on the operation key: the charge is made on the
        operation's first call only; its ledger write fails that once."""
        with lock:
            first = op not in charges
            if first:
                charges[op] = "ch_%d" % (len(charges) + 1)
                performed[op] = performed.get(op, 0) + 1
            written = ledger.get(op, False)
            ledger[op] = not first
            charge = charges[op]
        if first:
            self.reply(503, json.dumps({"error": "ledger write failed", "operation": op}).encode())
        elif not written:
            self.reply(409, json.dumps({"error": "duplicate", "operation": op}).encode())
        else:
            self.reply(201, json.dumps({"id": charge, "seen": {
                "Idempotency-Operation-Key": op,
                "Idempotency-Attempt": self.headers.get("Idempotency-Attempt")}}).encode())

    def do_POST(self):
        url = urlparse(self.path)
        query = parse_qs(url.query)
        length = int(self.headers.get("Content-Length") or 0)
        request = self.rfile.read(length)
        op = self.headers.get("Idempotency-Operation-Key", "")
        token = int(self.headers.get("Idempotency-Fencing-Token") or 0)
        with lock:
            calls[op] = calls.get(op, 0) + 1
            n = calls[op]
            key = self.headers.get("Idempotency-Key") or self.headers.get("X-Idempotency-Key", "")
            scoped = self.headers.get("X-Account-ID", "") + "/" + key
            operations.setdefault(scoped, set()).add(op)
            stale = op and token < tokens.get(op, 0)
            if not stale:
                tokens[op] = max(tokens.get(op, 0), token)
        if stale:
            self.reply(409, b'{"error":"stale attempt"}')
            return
        if url.path == "/hang":
            time.sleep(3600)
            return
        if url.path == "/slow":
            time.sleep(int(query.get("ms", ["0"])[0]) / 1000)
        if url.path == "/flaky" and n == 1:
            self.reply(500, b'{"error":"try again"}')
            return
        if url.path == "/secure" and self.headers.get("X-Forwarded-Proto") != "https":
            host = self.headers.get("X-Forwarded-Host") or self.headers.get("Host")
            self.send_response(301)
            self.send_header("Location", "https://%s%s" % (host, self.path))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if url.path == "/ledger":
            self.ledger(op)
            return
        if url.path == "/big":
            self.reply(201, b"x" * int(query.get("bytes", ["0"])[0]), "application/octet-stream")
            return
        with lock:
            if op not in charges:
                charges[op] = "ch_%d" % (len(charges) + 1)
            charge = charges[op]
        seen = {h: self.headers.get(h) for h in (
            "Idempotency-Operation-Key", "Idempotency-Fencing-Token", "Idempotency-Attempt",
            "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "X-Forwarded-Port",
            "X-Forwarded-Ssl", "X-Secret", "Idempotency-Key", "X-Idempotency-Key", "X-Request-Id")}
        body = json.dumps({"id": charge, "request": request.decode("utf-8", "replace"), "seen": seen,
                           "environ": self.environ()})
        self.reply(201, body.encode())


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A proxy killed or cancelled mid-request closes the connection
        # under a reply: expected here, not worth a traceback.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class UnixHandler(Handler):
    def address_string(self):
        return "unix"


def main():
    args = sys.argv[1:]
    if args[:1] == ["--unix"]:
        if os.path.exists(args[1]):
            os.unlink(args[1])
        server = UnixServer(args[1], UnixHandler)
        print("PORT 0", flush=True)
        server.serve_forever()
        return
    if args[:1] == ["--nodelay"]:
        args = args[1:]
        Handler.disable_nagle_algorithm = True
    server = Server(("127.0.0.1", 0), Handler)
    if args[:1] == ["--tls"]:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args[1], args[2])
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(args[3])
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print("PORT %d" % server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
