"""A cloud's instance metadata service, as much of it as `behemoth spot-watch` reads, on 127.0.0.1: EC2's IMDSv2
(a session token from PUT /latest/api/token, then GET /latest/meta-data/spot/instance-action: 404 until an
interruption is set) and GCE's /computeMetadata/v1/instance/preempted (Metadata-Flavor: Google). The cloud APIs
cannot run here: this is their documented behaviour, mocked."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeMetadata:
    def __init__(self):
        self.aws_action: dict | None = None  # {"action": "terminate", "time": "2026-...Z"} once a notice is set
        self.gce_preempted = False
        self.tokens: set[str] = set()
        self.reads = 0
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

            def do_GET(self):
                fake.reads += 1
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") not in fake.tokens:
                        return self._send(401)
                    return self._send(404) if fake.aws_action is None else self._send(200, json.dumps(fake.aws_action))
                if self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403)
                    return self._send(200, "TRUE" if fake.gce_preempted else "FALSE")
                return self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
