"""Real redis-servers that demand credentials: a password, an ACL user limited to learnmesh's
keys, mutual TLS with certificates made here. Each is a :class:`SecuredRedis`: how to start
it and the ``redis.*`` settings a learnmesh process needs to reach it."""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.redis_local_cluster import LocalCluster, NodeSecurity
from shared.secret_files import write_private
from tests.conftest import free_port, wait_for_sync

# What learnmesh's own ACL user may do: every command but the dangerous ones (FLUSHALL,
# CONFIG, KEYS, DEBUG, ...) on its own keys and channels only (shared/keys.py: "lm:").
LEARNMESH_ACL = ["~lm:*", "&lm:*", "+@all", "-@dangerous"]
# What a replica may do on its master (Redis's ACL docs): sync and acknowledge, nothing more.
REPLICATION_ACL = "-@all +psync +replconf +ping"


@dataclass
class SecuredRedis:
    kind: str
    proc: subprocess.Popen
    url: str
    settings: dict[str, Any]          # the redis.* config a learnmesh process uses
    admin: dict[str, Any]             # redis-py kwargs of an all-powerful client (for checks)
    secret: str                       # the password: must never show up in a log
    files: dict[str, Path] = field(default_factory=dict)
    url_settings: dict[str, Any] | None = None  # the same credentials, carried in the URL

    def admin_client(self) -> redis_sync.Redis:
        return redis_sync.Redis.from_url(self.url, **self.admin)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _start(workdir: Path, args: list[str], config: str, url: str, admin: dict[str, Any]) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs a redis-server binary")
    workdir.mkdir(parents=True, exist_ok=True)
    # "-": the config (with its secrets) comes from stdin, not the command line
    proc = subprocess.Popen([binary, "-", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--maxmemory-policy", "noeviction", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdin is not None
    proc.stdin.write(config.encode())
    proc.stdin.close()

    def answers() -> bool:
        if proc.poll() is not None:
            assert proc.stdout is not None
            with proc.stdout:
                out = proc.stdout.read().decode(errors="replace")
            if "TLS" in out and "not" in out and "support" in out:
                pytest.skip("this redis-server was built without TLS")
            raise AssertionError(f"redis-server exited with {proc.returncode}: {out[-2000:]}")
        try:
            with redis_sync.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, **admin) as c:
                return bool(c.ping())
        except (redis_sync.RedisError, OSError):
            return False

    wait_for_sync(answers, timeout_s=10, what="the secured redis-server to answer")
    if proc.stdout is not None:
        proc.stdout.close()
    return proc


def start_password(workdir: Path) -> SecuredRedis:
    password = secrets.token_urlsafe(24)
    pw_file = workdir / "redis.password"
    write_private(pw_file, password + "\n")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = _start(workdir, ["--port", str(port)], f"requirepass {password}\n", url, {"password": password})
    return SecuredRedis("password", proc, url, {"url": url, "password_file": str(pw_file)},
                        {"password": password}, password, {"password": pw_file})


def start_acl(workdir: Path) -> SecuredRedis:
    """The default user is off; ``learnmesh`` may touch only ``lm:*``; ``root`` is for checks."""
    password, root = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    config = ("user default off\n"
              f"user root on >{root} ~* &* +@all\n"
              f"user learnmesh on >{password} {' '.join(LEARNMESH_ACL)}\n")
    proc = _start(workdir, ["--port", str(port)], config, url, {"username": "root", "password": root})
    pw_file = workdir / "redis.password"
    write_private(pw_file, password)
    return SecuredRedis("acl", proc, url, {"url": url, "username": "learnmesh", "password_file": str(pw_file)},
                        {"username": "root", "password": root}, password, {"password": pw_file},
                        url_settings={"url": f"redis://learnmesh:{password}@127.0.0.1:{port}/0"})


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(directory: Path, name: str = "test") -> Pki:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate it signed."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"learnmesh {name} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
                   .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    server = leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH,
                  [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    client = leaf("learnmesh", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory / "ca.crt", directory / "server.crt", directory / "server.key",
              directory / "client.crt", directory / "client.key")
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server[0])
    write_private(pki.server_key, server[1])
    pki.client_cert.write_bytes(client[0])
    write_private(pki.client_key, client[1])
    return pki


def start_tls(workdir: Path) -> SecuredRedis:
    """TLS only (no plain port), client certificates required, and a password on top."""
    pki = make_pki(workdir / "pki")
    password = secrets.token_urlsafe(24)
    pw_file = workdir / "redis.password"
    write_private(pw_file, password)
    port = free_port()
    url = f"rediss://127.0.0.1:{port}/0"
    tls = {"ssl_ca_certs": str(pki.ca), "ssl_certfile": str(pki.client_cert), "ssl_keyfile": str(pki.client_key)}
    proc = _start(workdir, ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(pki.server_cert),
                            "--tls-key-file", str(pki.server_key), "--tls-ca-cert-file", str(pki.ca),
                            "--tls-auth-clients", "yes"],
                  f"requirepass {password}\n", url, {"password": password, **tls})
    settings = {"url": url, "password_file": str(pw_file), "tls_ca_file": str(pki.ca),
                "tls_cert_file": str(pki.client_cert), "tls_key_file": str(pki.client_key)}
    return SecuredRedis("tls", proc, url, settings, {"password": password, **tls}, password,
                        {"password": pw_file, "ca": pki.ca, "client_cert": pki.client_cert,
                         "client_key": pki.client_key})


@dataclass
class SecuredCluster:
    """A Redis Cluster as production runs one: TLS on every port of every node (clients, the
    cluster bus, replication; no plain port, client certificates required), the default user
    off, ``learnmesh`` confined by :data:`LEARNMESH_ACL`, ``root`` for the checks."""

    cluster: LocalCluster
    settings: dict[str, Any]          # the redis.* config a learnmesh process uses
    secret: str                       # learnmesh's password: must never show up in a log
    pki: Pki

    def admin_client(self, node: int = 0) -> redis_sync.Redis:
        return self.cluster.nodes[node].client(socket_timeout=5)

    def stop(self) -> None:
        self.cluster.stop()


def start_tls_cluster(workdir: Path, replicas: int = 1) -> SecuredCluster:
    """3 masters (+ ``replicas`` each) with TLS and ACL users; learnmesh's settings carry the
    user and password in a ``rediss+cluster://`` URL, as a user would write them."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("needs redis-server and redis-cli")
    pki = make_pki(workdir / "pki")
    password, root, replication = (secrets.token_urlsafe(24) for _ in range(3))
    # replicas log in to their master as "replicator", which may do what replication needs and nothing else
    security = NodeSecurity(str(pki.ca), str(pki.server_cert), str(pki.server_key), str(pki.client_cert),
                            str(pki.client_key), ("user default off", f"user root on >{root} ~* &* +@all",
                                                  f"user learnmesh on >{password} {' '.join(LEARNMESH_ACL)}",
                                                  f"user replicator on >{replication} {REPLICATION_ACL}"),
                            "root", root, "replicator", replication)
    cluster = LocalCluster(masters=3, replicas=replicas, security=security, workdir=workdir / "nodes").start()
    seed = cluster.nodes[0].address
    settings = {"url": f"rediss+cluster://learnmesh:{password}@{seed}/0", "tls_ca_file": str(pki.ca),
                "tls_cert_file": str(pki.client_cert), "tls_key_file": str(pki.client_key)}
    return SecuredCluster(cluster, settings, password, pki)


STARTERS = {"password": start_password, "acl": start_acl, "tls": start_tls}
