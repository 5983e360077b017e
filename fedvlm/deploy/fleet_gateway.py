"""The SuperLink's public face: the Fleet API that SuperNodes use, and nothing else.

Flower 1.41 serves three APIs on the SuperLink's one HTTPS port: the Fleet API (SuperNodes pull
messages and push replies), the Control API (``flwr run``, ``flwr ls``, ``flwr log``, ``flwr
supernode register``: whoever reaches it can start a run, read every run's log and register
SuperNode keys) and the ServerApp runtime. Authentication of Control API users exists only in
Flower's enterprise distribution (``FLWR_OIDC_ENABLED`` needs ``flwr.ee``), so an open-source
SuperLink that listens on a public address lets anyone holding the public ``ca.crt`` start a run
whose ServerApp executes on the SuperLink host and whose ClientApp every SuperNode executes.

So the SuperLink listens on 127.0.0.1 only, and this gateway listens where SuperNodes can reach
it. It terminates TLS with the SuperLink's certificate, forwards ``POST /v1/fleet/<call>`` for
the Fleet API's calls (a fixed list: ``FLEET_CALLS``) to the SuperLink over TLS on loopback,
headers and body unchanged (SuperNode authentication signs its own headers, which the SuperLink
checks), and answers every other request 403 with a line saying where the Control API is. The
researcher reaches the Control API on the SuperLink host, or through an SSH tunnel to it
(docs/deployment.md).

    python -m fedvlm.deploy.fleet_gateway --listen 0.0.0.0:9092 --superlink 127.0.0.1:9093 \\
        --certfile server.crt --keyfile server.key --ca ca.crt
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import ssl
import sys
from collections.abc import AsyncIterator, Sequence

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

log = logging.getLogger("fedvlm.fleet_gateway")

# Flower 1.41's Fleet API (flwr/supernode/fleet_http_client.py): every call a SuperNode makes
FLEET_CALLS = frozenset(
    {
        "register-node",
        "activate-node",
        "deactivate-node",
        "unregister-node",
        "send-node-heartbeat",
        "pull-messages",
        "push-messages",
        "get-run",
        "get-fab",
        "push-object",
        "pull-object",
        "confirm-message-received",
    }
)
FLEET_PREFIX = "/v1/fleet/"
# per-connection headers (RFC 9110, 7.6.1) and the ones the two hops set for themselves
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
REFUSED = (
    "this address serves only the Fleet API that SuperNodes use; the Control API (flwr run, ls, log, supernode "
    "register) is reachable only on the SuperLink host (127.0.0.1) or through an SSH tunnel to it\n"
)
UPSTREAM_TIMEOUT = 600.0  # a SuperNode's call waits at most this for the SuperLink


def fleet_call(method: str, path: str) -> str | None:
    """The Fleet API call a request makes, or None if it is not one."""
    if method != "POST" or not path.startswith(FLEET_PREFIX):
        return None
    call = path[len(FLEET_PREFIX) :]
    return call if call in FLEET_CALLS else None


def _forwardable(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def make_app(superlink: str, ca: str, transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The gateway for the SuperLink at ``superlink`` (host:port on this machine), whose
    certificate ``ca`` verifies (``transport``: another way to reach it, for tests)."""
    client = httpx.AsyncClient(
        base_url=f"https://{superlink}",
        verify=ssl.create_default_context(cafile=ca) if transport is None else True,
        timeout=UPSTREAM_TIMEOUT,
        transport=transport,
    )

    async def forward(request: Request) -> Response:
        call = fleet_call(request.method, request.url.path)
        peer = request.client.host if request.client else "?"
        if call is None:
            log.warning("refused %s %s from %s", request.method, request.url.path, peer)
            return PlainTextResponse(REFUSED, status_code=403)
        try:
            upstream = await client.post(
                FLEET_PREFIX + call, content=await request.body(), headers=_forwardable(request.headers)
            )
        except httpx.HTTPError as err:
            log.error("the SuperLink at %s did not answer %s: %s", superlink, call, err)
            return PlainTextResponse(f"the SuperLink did not answer: {type(err).__name__}\n", status_code=502)
        return Response(upstream.content, status_code=upstream.status_code, headers=_forwardable(upstream.headers))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.fleet_gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=_host_port, required=True, help="HOST:PORT SuperNodes connect to")
    p.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink on this machine (127.0.0.1:...)")
    p.add_argument("--certfile", required=True, help="the SuperLink's certificate (server.crt)")
    p.add_argument("--keyfile", required=True, help="its private key (server.key)")
    p.add_argument("--ca", required=True, help="the CA certificate that verifies the SuperLink (ca.crt)")
    args = p.parse_args(argv)
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = args.listen
    log.info("forwarding the Fleet API from %s:%d to %s; every other request is refused", host, port, args.superlink)
    uvicorn.run(
        make_app(args.superlink, args.ca),
        host=host,
        port=port,
        ssl_certfile=args.certfile,
        ssl_keyfile=args.keyfile,
        log_level="warning",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
