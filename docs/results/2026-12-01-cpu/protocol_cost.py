"""What app/connections.py's protocol adds per request: CPU per keep-alive request through uvicorn's
HttpToolsProtocol and through GuardedProtocol (header timer, size count, connection bookkeeping), in
one process on uvloop, no sockets (a transport that records writes), a trivial ASGI app, the two
classes alternating round by round.

    python docs/results/2026-12-01-cpu/protocol_cost.py [ROUNDS] [REQUESTS]   (from the repository root)
"""

import asyncio
import sys
import time
from typing import Any

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

sys.path.insert(0, ".")
from app.connections import ConnectionLimits, Connections, protocol_class
from app.metrics import Metrics

BODY = b'{"input": "what is the capital of france"}'
REQUEST = (
    b"POST /v1/embeddings HTTP/1.1\r\nhost: 127.0.0.1:8000\r\naccept: */*\r\naccept-encoding: gzip, deflate\r\n"
    b"connection: keep-alive\r\nuser-agent: python-httpx/0.28.1\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.answered: asyncio.Future[None] | None = None

    def write(self, data: Any) -> None:
        if data == b"ok" and self.answered is not None:
            self.answered.set_result(None)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:  # a keep-alive timer of an earlier round
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8000) if name in ("sockname", "peername") else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def per_request_us(cls: Any, n: int) -> float:
    config = uvicorn.Config(app, http=cls, log_config=None, access_log=False)
    config.load()
    loop = asyncio.get_running_loop()
    protocol = cls(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    transport = Transport()
    protocol.connection_made(transport)
    start = time.process_time()
    for _ in range(n):
        transport.answered = loop.create_future()
        protocol.data_received(REQUEST)
        await transport.answered
        await asyncio.sleep(0)  # the request's task finishes
    return (time.process_time() - start) / n * 1e6


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000
    guarded = protocol_class(Connections(ConnectionLimits(2048, 10.0, 32768), Metrics()))
    loop = uvloop.new_event_loop()
    for r in range(rounds):
        plain = loop.run_until_complete(per_request_us(HttpToolsProtocol, n))
        ours = loop.run_until_complete(per_request_us(guarded, n))
        print(f"round {r}: uvicorn {plain:.1f} us, guarded {ours:.1f} us per request (+{ours - plain:.1f})")


if __name__ == "__main__":
    main()
