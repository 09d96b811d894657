"""An OTLP/HTTP trace receiver for the real-vLLM suite: real vLLM (started with
--otlp-traces-endpoint) and the kvgate under test both post their spans here; each span is
appended to SPANS_FILE as one JSON line (service, name, trace_id, span_id, parent_span_id,
attributes), which tests/src/otlp.rs reads. Binds 127.0.0.1 on a free port and writes the port
to PORT_FILE once it listens.

    python otlp_receiver.py PORT_FILE SPANS_FILE
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

PORT_FILE, SPANS_FILE = sys.argv[1], sys.argv[2]
lock = threading.Lock()


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "int_value", "bool_value", "double_value") else None


def spans(body):
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    for rs in req.resource_spans:
        service = next((value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield {
                    "service": service,
                    "name": s.name,
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "attributes": {a.key: value(a.value) for a in s.attributes},
                }


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        try:
            lines = [json.dumps(s) + "\n" for s in spans(body)]
        except Exception as e:  # a body that is not an export request: 400, as a collector answers
            self.send_response(400)
            self.end_headers()
            self.wfile.write(str(e).encode())
            return
        with lock, open(SPANS_FILE, "a") as f:
            f.writelines(lines)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
with open(PORT_FILE + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
import os

os.replace(PORT_FILE + ".tmp", PORT_FILE)
server.serve_forever()
