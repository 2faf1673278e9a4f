"""Helpers for fleet tests: heartbeats as agents write them, registered agents, signed versions."""

import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from contracts.agent_mac import agent_fields_sign
from contracts.commands import RESULTS_STREAM, CommandResult
from contracts.engine_identity import identity_proof
from contracts.streams import HEARTBEATS_STREAM, AgentState, EnergySource, Heartbeat
from controlplane.fleet import enrolment, services
from controlplane.fleet.models import Agent, AgentCommand
from controlplane.fleet.stream_keys import agent_stream_key

# What agent "gpu-7" sends to POST /api/v1/fleet/agents/register/.
REGISTRATION = {
    "name": "gpu-7",
    "host": "node-3",
    "endpoint": "",
    "advertise_host": "node-3.example",
    "ports": [9100, 9101],
    "inventory": {"kind": "gpu", "accelerator": "NVIDIA H100", "memory_bytes": 85899345920},
    "energy_source": "nvml",
    "state": "idle",
    "loaded_version_id": None,
    "heartbeat_interval_s": 1.0,
}


def heartbeat(agent: str = "agent-1", seq: int = 1, **changes: Any) -> Heartbeat:
    base = Heartbeat(
        agent=agent,
        seq=seq,
        sent_at=time.time(),
        host="host-a",
        endpoint="http://127.0.0.1:9100",
        state=AgentState.READY,
        version_id=None,
        version_digest="",
        detail="",
        running=1,
        waiting=0,
        kv_cache_usage=0.25,
        interval_s=1.0,
        tokens_per_second=20.0,
        prompt_tokens=10,
        generated_tokens=20,
        requests_ok=2,
        requests_failed=0,
        requests_aborted=0,
        ttft_p50_s=0.05,
        ttft_p95_s=0.08,
        itl_mean_s=0.02,
        itl_p95_s=0.03,
        prompt_tokens_total=10 * seq,
        generated_tokens_total=20 * seq,
        requests_ok_total=2 * seq,
        requests_failed_total=0,
        power_watts=40.0,
        energy_joules=40.0 * seq,
        energy_source=EnergySource.ESTIMATE,
        joules_per_token=2.0,
    )
    return replace(base, **changes)


def signed_fields(entry: Heartbeat | CommandResult) -> dict[str, str]:
    """The entry's stream fields with the `mac` its agent gives them (its stream key)."""
    stream = HEARTBEATS_STREAM if isinstance(entry, Heartbeat) else RESULTS_STREAM
    return agent_fields_sign(stream, entry.to_fields(), agent_stream_key(entry.agent))


def publish(redis_client, beat: Heartbeat, entry_id: str = "*") -> str:
    return redis_client.xadd(HEARTBEATS_STREAM, signed_fields(beat), id=entry_id)


def recent_minute() -> float:
    """The start of a whole minute two to three minutes past. Heartbeats dated from it
    fall into known rollup buckets, and ingest takes them: it refuses any dated ahead of
    its clock, or long before their entry's time (so give them `entry_id_at`)."""
    return float((int(time.time()) // 60 - 2) * 60)


def entry_id_at(sent_at: float) -> str:
    """A stream entry id of the moment a heartbeat was sent."""
    return f"{int(sent_at * 1000)}-0"


def enrol(name: str = "agent-1") -> dict[str, Any]:
    """Enrol `name` as an admin would and the agent does: its credentials (and Redis user)."""
    created = enrolment.agent_enrolment_create(actor=None, agent_name=name)
    return enrolment.agent_enrol(token=created.raw_token)


def register(name: str = "agent-1", *, host: str = "host-a") -> Agent:
    """An enrolled agent registered with its own account, as the agent process does."""
    row = Agent.objects.filter(name=name, enrolled_at__isnull=False).first()
    if row is None:
        enrol(name)
        row = Agent.objects.get(name=name)
    agent, _ = services.agent_register(
        actor=row.account,
        name=name,
        host=host,
        endpoint="",
        advertise_host="127.0.0.1",
        ports=[9100, 9101],
        inventory={"kind": "cpu", "accelerator": "Test CPU", "cpu_cores": 2},
        energy_source="estimate",
    )
    return agent


def mark_endpoint_verified(agent: Agent, command: AgentCommand) -> None:
    """Record what the reconciler records once the engine at the agent's endpoint proved
    it holds this load's admin secret (GET /identity): for agents without an engine."""
    services.agent_endpoint_mark_verified(
        agent_id=agent.pk, command_id=command.command_id, endpoint=agent.endpoint
    )


class StubEngine:
    """A tiny real HTTP server on 127.0.0.1 standing where an engine would.

    GET /identity answers as `agent`, with the proof `admin_secret` makes; without the
    secret (a capture server) it answers a made-up proof. POST /v1/chat/completions answers
    in the OpenAI API's shape with fake usage. Every request's path is kept in `requests`.
    """

    def __init__(self, *, agent: str, admin_secret: str | None = None, port: int = 0) -> None:
        self.agent = agent
        self.admin_secret = admin_secret
        self.requests: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                stub.requests.append(url.path)
                if url.path != "/identity":
                    self.answer(404, {"error": {"code": "not_found"}})
                    return
                nonce = parse_qs(url.query).get("nonce", [""])[0]
                secret = stub.admin_secret
                proof = (
                    "0" * 64
                    if secret is None
                    else identity_proof(admin_secret=secret, agent=stub.agent, nonce=nonce)
                )
                self.answer(200, {"agent": stub.agent, "proof": proof})

            def do_POST(self) -> None:
                stub.requests.append(urlsplit(self.path).path)
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.answer(
                    200,
                    {
                        "id": "chatcmpl-capture",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": "smollm2",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "captured"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    },
                )

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "StubEngine":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
