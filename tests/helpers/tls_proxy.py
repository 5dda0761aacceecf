"""A TLS-terminating gRPC proxy with an API-key check, in front of a plaintext dev server:
what a Temporal deployment behind TLS and API keys looks like to a client (Temporal
Cloud, or a self-hosted cluster behind an ingress), made on loopback for tests.

The proxy is Debian's nginx (``scripts/test`` installs it), run as a child of the test
with every path of its own under one directory. Certificates are made here with
``cryptography``: a self-signed CA and a server certificate it signs for ``localhost``
and 127.0.0.1.
"""

from __future__ import annotations

import datetime
import grp
import ipaddress
import os
import pwd
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.helpers.waits import wait_until

SERVER_NAME = "localhost"


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_pki(directory: Path, label: str = "mvp test") -> Pki:
    """A CA (``ca.pem``) and a server certificate for localhost / 127.0.0.1 signed by it
    (``server.pem``, ``server.key``), valid for a day, in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{label} CA"))
        .issuer_name(_name(f"{label} CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(SERVER_NAME))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(SERVER_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.server_key.write_bytes(_pem_key(key))
    pki.server_key.chmod(0o600)
    return pki


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    if not found:
        raise RuntimeError("nginx is missing: apt-get install nginx-light (scripts/test does)")
    return found


def _user_line() -> str:
    """nginx started by root runs its workers as ``nobody`` unless told otherwise; they
    must reach the test's private directory, so they run as whoever started it."""
    if os.geteuid() != 0:
        return ""
    return f"user {pwd.getpwuid(os.getuid()).pw_name} {grp.getgrgid(os.getgid()).gr_name};\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A refused key gets a gRPC answer, not an HTML page: a trailers-only response whose
# grpc-status 16 (UNAUTHENTICATED) the SDK reports as such.
_CONF = """\
{user}worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    map $http_authorization $api_key_ok {{
        default 0;
        "Bearer {api_key}" 1;
    }}
    server {{
        listen 127.0.0.1:{port} ssl http2;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{
            if ($api_key_ok = 0) {{
                return 401;
            }}
            grpc_pass grpc://{upstream};
            # Longer than the server's long polls (about 70 s).
            grpc_read_timeout 300s;
            grpc_send_timeout 300s;
        }}
        error_page 401 = @unauthenticated;
        location @unauthenticated {{
            internal;
            default_type application/grpc;
            add_header grpc-status 16 always;
            add_header grpc-message "missing or invalid API key" always;
            return 204;
        }}
    }}
}}
"""


@dataclass
class GrpcTlsProxy:
    process: subprocess.Popen[bytes]
    port: int
    directory: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.directory / "access.log"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # nginx: fast shutdown
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def start_grpc_tls_proxy(
    directory: Path, upstream: str, pki: Pki, api_key: str, timeout_s: float = 10.0
) -> GrpcTlsProxy:
    """nginx on a free loopback port, TLS with ``pki``'s server certificate, passing
    gRPC to ``upstream`` (host:port, plaintext) only for ``authorization: Bearer
    <api_key>``. A non-daemon child: stop it with :meth:`GrpcTlsProxy.stop`."""
    if any(c in api_key for c in '"\\$; \n'):
        raise ValueError("the test API key must be a plain token")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tmp").mkdir(exist_ok=True)
    port = _free_port()
    conf = directory / "nginx.conf"
    conf.write_text(
        _CONF.format(
            dir=directory,
            port=port,
            cert=pki.server_cert,
            key=pki.server_key,
            upstream=upstream,
            api_key=api_key,
            user=_user_line(),
        )
    )
    conf.chmod(0o600)  # it holds the key
    with open(directory / "stderr.log", "ab") as err:
        proc = subprocess.Popen(
            [nginx_binary(), "-p", str(directory), "-c", str(conf), "-g", "daemon off;"],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=subprocess.STDOUT,
        )

    def listening() -> bool:
        if proc.poll() is not None:
            tail = (directory / "stderr.log").read_text(errors="replace")[-1000:]
            raise RuntimeError(f"nginx exited with {proc.returncode}: {tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    try:
        wait_until(listening, timeout=timeout_s, what=f"nginx to listen on 127.0.0.1:{port}")
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    return GrpcTlsProxy(proc, port, directory)
