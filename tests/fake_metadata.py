"""A cloud's instance metadata service, as much of it as `behemoth spot-watch` reads, on 127.0.0.1: EC2's IMDSv2
(a session token from PUT /latest/api/token, then GET /latest/meta-data/spot/instance-action: 404 until an
interruption is set) and GCE's /computeMetadata/v1/instance/preempted (Metadata-Flavor: Google). The cloud APIs
cannot run here: this is their documented behaviour, mocked. It can also answer as no cloud does: a notice that is
not one (`aws_action` a string, sent as it is), or an answer streamed without end, slowly or fast (`stream`)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STREAM_LIMIT = 50 * 2**20  # the most a streamed answer sends (a client that reads it all is still bounded here)


class FakeMetadata:
    def __init__(self):
        # {"action": "terminate", "time": "2026-...Z"} once a notice is set (any JSON value; a str is sent as is)
        self.aws_action: dict | list | str | None = None
        self.gce_preempted = False
        self.tokens: set[str] = set()
        self.reads = 0
        # ("headers" | "body", chunk, pause_s): every GET answers 200, then sends `chunk` every `pause_s` seconds
        # in its headers or its body, until the client hangs up or STREAM_LIMIT bytes went out
        self.stream: tuple[str, bytes, float] | None = None
        self.streamed, self.stream_cut = 0, False  # bytes the last stream sent; whether its client hung up
        self.stream_ended = threading.Event()
        self.closing = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(400)
                token = f"token-{len(fake.tokens)}"
                fake.tokens.add(token)
                return self._send(200, token)

            def _stream(self, part: str, chunk: bytes, pause_s: float) -> None:
                fake.streamed, fake.stream_cut = 0, False
                fake.stream_ended.clear()
                if part == "body":
                    self.send_response(200)
                    self.send_header("Content-Length", str(STREAM_LIMIT))
                    self.end_headers()
                else:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Stream: ")
                try:
                    while fake.streamed < STREAM_LIMIT and not fake.closing.wait(pause_s):
                        self.wfile.write(chunk)
                        fake.streamed += len(chunk)
                except OSError:  # the client hung up
                    fake.stream_cut = True
                self.close_connection = True
                fake.stream_ended.set()

            def do_GET(self):
                fake.reads += 1
                if fake.stream is not None:
                    return self._stream(*fake.stream)
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") not in fake.tokens:
                        return self._send(401)
                    if fake.aws_action is None:
                        return self._send(404)
                    sent = fake.aws_action
                    return self._send(200, sent if isinstance(sent, str) else json.dumps(sent))
                if self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403)
                    return self._send(200, "TRUE" if fake.gce_preempted else "FALSE")
                return self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()  # (a stream ends)
        self.server.shutdown()
        self.server.server_close()
