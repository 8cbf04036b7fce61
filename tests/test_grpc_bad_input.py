"""Malformed gRPC requests to a real status server: INVALID_ARGUMENT, one WARNING line each, no
traceback, and the server keeps serving."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from dilocox.daemon.service import start_server
from dilocox.proto.dilocox.v1 import node_pb2, node_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.fakes.node import FakeNode

# bytes that parse as no protobuf message: a truncated varint tag, a truncated length, field number 0,
# wire type 7, a length past the end, a truncated fixed64
GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\xff", b"\x00", b"\x0f", b"\x0a\x05ab", b"\x09\x01"]
UNARY = ["/dilocox.v1.Node/GetStatus", "/dilocox.v1.Node/ListPeers", "/dilocox.v1.Node/Leave",
         "/grpc.health.v1.Health/Check"]
STREAM = ["/dilocox.v1.Node/WatchStatus", "/grpc.health.v1.Health/Watch"]
BIDI = ["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"]
REJECTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)


async def _unary(channel, method: str, payload: bytes) -> grpc.StatusCode:
    try:
        await channel.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _stream(channel, method: str, payload: bytes) -> grpc.StatusCode:
    call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(payload, timeout=5)
    try:
        async for _ in call:
            call.cancel()  # a response means the garbage was accepted
            return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


async def _bidi(channel, method: str, payload: bytes) -> grpc.StatusCode:
    call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(timeout=5)
    try:
        await call.write(payload)
        await call.done_writing()
        async for _ in call:
            call.cancel()
            return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


async def _well_formed(channel) -> dict:
    """One well-formed call of each kind, after the garbage."""
    stub = node_pb2_grpc.NodeStub(channel)
    watch = stub.WatchStatus(node_pb2.WatchStatusRequest(interval_s=0.1), timeout=5)
    first = await watch.read()
    watch.cancel()
    reflection_call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
    await reflection_call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listed = await reflection_call.read()
    await reflection_call.done_writing()
    return dict(
        status=await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5),
        peers=await stub.ListPeers(node_pb2.ListPeersRequest(), timeout=5),
        watched=first,
        health=await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5),
        services=sorted(s.name for s in listed.list_services_response.service),
    )


async def _exercise(node: FakeNode):
    server, port, _ = await start_server(node, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            codes = {}
            for payload in GARBAGE:
                for method in UNARY:
                    codes[method, payload] = await _unary(channel, method, payload)
                for method in STREAM:
                    codes[method, payload] = await _stream(channel, method, payload)
                for method in BIDI:
                    codes[method, payload] = await _bidi(channel, method, payload)
            # a proto3 string that is not UTF-8 only fails for the message that has a string field
            codes["/dilocox.v1.Node/Leave", b"\x0a\x02\xff\xfe"] = await _unary(
                channel, "/dilocox.v1.Node/Leave", b"\x0a\x02\xff\xfe")
            served = await _well_formed(channel)
        return codes, served
    finally:
        await server.stop(grace=None)


def test_malformed_requests_are_rejected_and_logged_once(caplog):
    caplog.set_level(logging.DEBUG)
    node = FakeNode()
    codes, served = asyncio.run(_exercise(node))

    accepted = {k: c for k, c in codes.items() if c not in REJECTED}
    assert not accepted, f"malformed requests not rejected as INVALID_ARGUMENT/INTERNAL: {accepted}"
    # still serving well-formed requests
    assert served["status"].run_id == "bad-input" and served["watched"].run_id == "bad-input"
    assert list(served["peers"].peers) == []
    assert served["health"].status == health_pb2.HealthCheckResponse.SERVING
    assert "dilocox.v1.Node" in served["services"]
    assert node.leave_reasons == [], "a malformed Leave must not drain the node"

    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, "\n".join(f"{r.name} {r.levelname}: {r.getMessage()}" for r in errors)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(codes), (len(codes), [r.getMessage() for r in warnings])
    assert all("\n" not in r.getMessage() for r in warnings)
    mentioned = {m for m, _ in codes if any(m in r.getMessage() for r in warnings)}
    assert mentioned == {m for m, _ in codes}, "each warning names the method"


@pytest.mark.parametrize("payload", [b"", b"\x08\x01"])
def test_well_formed_or_unknown_fields_still_served(payload):
    """An empty request and one with an unknown field are valid protobuf: served, not rejected."""
    async def go():
        server, port, _ = await start_server(FakeNode(), "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await _unary(channel, "/dilocox.v1.Node/GetStatus", payload)
        finally:
            await server.stop(grace=None)

    assert asyncio.run(go()) == grpc.StatusCode.OK


def test_leave_needs_the_operator_token_and_reads_as_configured(tmp_path):
    """With an operator token, Leave without it (or with another) is UNAUTHENTICATED and the node keeps
    running; with it, the node is asked to leave. status_read=token closes reads too; dilocox-ctl sends
    the token from --token-file."""
    from dilocox.daemon import ctl
    from dilocox.daemon.service import load_operator_token

    token_file = tmp_path / "operator.token"
    token = load_operator_token(token_file)
    assert len(token) == 64 and (token_file.stat().st_mode & 0o777) == 0o600
    assert load_operator_token(token_file) == token  # created once, then read

    async def run(read_needs_token: bool):
        node = FakeNode()
        server, port, _ = await start_server(node, "127.0.0.1:0", token, read_needs_token)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = node_pb2_grpc.NodeStub(channel)
                codes = []
                for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", f"Bearer {token}"),)):
                    for call in (stub.Leave(node_pb2.LeaveRequest(reason="x"), metadata=metadata),
                                 stub.GetStatus(node_pb2.GetStatusRequest(), metadata=metadata)):
                        try:
                            await call
                            codes.append(grpc.StatusCode.OK)
                        except grpc.aio.AioRpcError as e:
                            codes.append(e.code())
            return codes, node.leave_reasons
        finally:
            await server.stop(None)

    unauth, ok = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK
    codes, left = asyncio.run(run(False))
    assert codes == [unauth, ok, unauth, ok, ok, ok] and left == ["x"]
    codes, left = asyncio.run(run(True))
    assert codes == [unauth, unauth, unauth, unauth, ok, ok] and left == ["x"]
    # the CLI: without the token file the leave is refused (exit 1), with it accepted
    async def serve_and_ask():
        node = FakeNode()
        server, port, _ = await start_server(node, "127.0.0.1:0", token, False)
        loop = asyncio.get_running_loop()
        try:
            without = await loop.run_in_executor(None, ctl.main, ["--addr", f"127.0.0.1:{port}", "leave"])
            with_token = await loop.run_in_executor(
                None, ctl.main, ["--addr", f"127.0.0.1:{port}", "--token-file", str(token_file), "leave"])
            return without, with_token, node.leave_reasons
        finally:
            await server.stop(None)

    assert asyncio.run(serve_and_ask()) == (1, 0, ["dilocox-ctl leave"])


def test_a_public_status_address_needs_an_operator_token():
    from dilocox.daemon.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="not loopback"):
        load_config({"status_addr": "0.0.0.0:50051"}, {})
    assert load_config({"status_addr": "0.0.0.0:50051", "operator_token_file": "/tmp/t"}, {}).status_read == "open"


def test_status_over_a_unix_socket_needs_no_token_and_a_live_socket_is_not_taken_over(tmp_path, capsys):
    """unix:/PATH serves the same API (dilocox-ctl reads it); it is local, so no operator token is required;
    a socket a running node answers on is refused before the node starts, a stale file is replaced."""
    import socket

    from dilocox.daemon import cli, ctl
    from dilocox.daemon.config import load_config

    sock = tmp_path / "status.sock"
    assert load_config({"status_addr": f"unix:{sock}"}, {}).operator_token_file is None

    async def serve_and_ask():
        server, port, _ = await start_server(FakeNode(), f"unix:{sock}")
        loop = asyncio.get_running_loop()
        try:
            code = await loop.run_in_executor(None, ctl.main, ["--addr", f"unix:{sock}", "status", "--json"])
            with pytest.raises(cli._BadInput, match="in use by a running process"):
                cli._check_port_free(f"unix:{sock}")
            return port, code
        finally:
            await server.stop(None)

    assert asyncio.run(serve_and_ask()) == (1, 0)
    assert '"run_id": "bad-input"' in capsys.readouterr().out
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # bound, never listening: what a killed process leaves
    cli._check_port_free(f"unix:{stale}")
    with pytest.raises(cli._BadInput, match="no directory"):
        cli._check_port_free(f"unix:{tmp_path}/missing/status.sock")
