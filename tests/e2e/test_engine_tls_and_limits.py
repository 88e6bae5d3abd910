"""TLS and mutual TLS on the engine's gRPC port, and the queue limits (RESOURCE_EXHAUSTED)."""

from __future__ import annotations

import datetime
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from engine_worker.server.config import ServerConfig
from quire.v1 import engine_pb2_grpc
from tests.e2e.test_engine_server import RunningServer, _collect, _engine, _request


def _cert(name: str, issuer=None, *, ca: bool = False, san: str | None = None):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[0].subject if issuer else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]),
                                        critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    return cert, key


def _pem(cert, key) -> tuple[bytes, bytes]:
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = _cert("quire-test-ca", ca=True)
    files = {"ca": _pem(*ca)}
    files["server"] = _pem(*_cert("engine", ca, san="localhost"))
    files["client"] = _pem(*_cert("router", ca))
    paths = {}
    for name, (cert, key) in files.items():
        (root / f"{name}.crt").write_bytes(cert)
        (root / f"{name}.key").write_bytes(key)
        paths[name] = (root / f"{name}.crt", root / f"{name}.key")
    return paths


def _secure_stub(port: int, pki, with_client_cert: bool):
    ca = pki["ca"][0].read_bytes()
    chain = pki["client"][0].read_bytes() if with_client_cert else None
    key = pki["client"][1].read_bytes() if with_client_cert else None
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                         certificate_chain=chain)
    channel = grpc.secure_channel(f"localhost:{port}", creds)
    return channel, engine_pb2_grpc.EngineServiceStub(channel)


def test_mutual_tls_admits_only_clients_with_a_certificate(tiny_model_dir, pki):
    cfg = ServerConfig(host="127.0.0.1", port=0, tls_cert_file=str(pki["server"][0]),
                       tls_key_file=str(pki["server"][1]),
                       tls_client_ca_file=str(pki["ca"][0]))
    server = RunningServer(_engine(tiny_model_dir), cfg)
    try:
        channel, stub = _secure_stub(server.port, pki, with_client_cert=True)
        tokens, _, _ = _collect(stub.Generate(_request([1, 2, 3], max_tokens=3), timeout=30))
        assert len(tokens) == 3
        channel.close()
        channel, stub = _secure_stub(server.port, pki, with_client_cert=False)
        with pytest.raises(grpc.RpcError) as err:
            _collect(stub.Generate(_request([1, 2, 3], max_tokens=3), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
        with pytest.raises(grpc.RpcError):  # and no plaintext
            _collect(server.stub.Generate(_request([1, 2, 3], max_tokens=3), timeout=10))
    finally:
        server.close()


def test_tls_config_needs_both_halves():
    with pytest.raises(ValueError, match="^tls_cert_file:"):
        ServerConfig(tls_cert_file="x.crt")
    with pytest.raises(ValueError, match="^tls_client_ca_file:"):
        ServerConfig(tls_client_ca_file="ca.crt")


def test_full_queue_gets_resource_exhausted_and_others_keep_flowing(tiny_model_dir):
    engine = _engine(tiny_model_dir, max_num_seqs=1)
    server = RunningServer(engine, ServerConfig(host="127.0.0.1", port=0,
                                                max_waiting_requests=1))
    try:
        running = server.stub.Generate(_request([1, 2, 3], max_tokens=400))
        next(running)
        waiting = server.stub.Generate(_request([4, 5, 6], max_tokens=2))
        deadline = time.monotonic() + 10
        while server.load.num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            _collect(server.stub.Generate(_request([7, 8, 9], max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting" in err.value.details()
        running.cancel()
        tokens, _, last = _collect(waiting)
        assert len(tokens) == 2 and last.finished
    finally:
        server.close()
