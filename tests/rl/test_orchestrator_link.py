"""The trainer's batch source (HttpBatchSource) waits out an orchestrator that dies while it answers: a batch whose
body is cut short (the orchestrator SIGKILLed mid-send: http.client.IncompleteRead) is asked for again, as after a
refused connection, and the batch then served is returned. Against a server of its own on 127.0.0.1."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rl_helpers import rewarded_batch

from moe_rl_eks.workloads.trainer import orchestrator_link
from moe_rl_eks.workloads.trainer.orchestrator_link import HttpBatchSource


def test_a_batch_cut_short_by_the_orchestrator_dying_is_asked_for_again(monkeypatch):
    monkeypatch.setattr(orchestrator_link.time, "sleep", lambda s: None)  # the link's pause between attempts
    body = json.dumps(rewarded_batch(step=3).to_json()).encode()
    asked = []

    class Orchestrator(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            # the first answer stops halfway and the connection closes: what a killed orchestrator leaves
            self.wfile.write(body if len(asked) > 1 else body[:len(body) // 2])
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Orchestrator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        link = HttpBatchSource(f"http://127.0.0.1:{server.server_address[1]}")
        batch = link.next_batch(3, 2, stopping=lambda: len(asked) > 5)
    finally:
        server.shutdown()
        server.server_close()
    assert asked == ["/v1/batch?step=3&committed=2"] * 2
    assert batch == rewarded_batch(step=3)
    assert link.trained[3] == ["p0"]
