"""Reading a request and writing a response on raw ASGI, and the errors the gateway
answers itself (OpenAI's error shape)."""

import json

CLIENT_CLOSED = 499  # nginx's code: the client left before its response


def error_body(status: int, code: str, message: str, error_type: str, param: str | None = None):
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    ).encode()


class ClientGone(Exception):
    """The client disconnected before its request was read."""


class GatewayRequestError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        error_type: str = "invalid_request_error",
        headers: list[tuple[bytes, bytes]] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.error_type = error_type
        self.headers = headers or []
        self.param = param


async def send_json(send, status: int, body: bytes, headers=()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def read_body(receive, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayRequestError(413, "request_too_large", "The request body is too large.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
