"""``learnmesh compose-secrets``: every secret the compose stack needs, generated into one
0600 env file that ``docker compose --env-file .env --env-file secrets.env`` reads.

compose/docker-compose.yml turns each variable into a compose secret mounted (0400, owned by
the service's user) only where it is needed: the API and admin keys and the key sealing
2026-07-28 ``requestState`` (the same in every replica) in the gateway; the
delta ring (AES keys, Ed25519 verify keys) in the trainer and workers, the signing key in
the trainer alone; each role's CURVE secret key in that role's services and its public key
in its peers'; the Redis passwords in learnmesh's processes and the exporter, the Grafana
password in Grafana. Redis itself gets only SHA-256 hashes of its users' passwords (ACL
rules on its command line). Nothing in the repository works as a key: without this file
the stack refuses to start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path

from shared import curve
from shared.config import Config, parse_api_keys
from shared.crypto import KeyRing, SigningKey
from shared.secret_files import read_private_text, write_private

REDIS_USER = "learnmesh"
EXPORTER_USER = "exporter"


def curve_variable(role: str, part: str) -> str:
    """The variable holding ``role``'s CURVE certificate, ``part`` ``secret`` or ``public``."""
    return f"LEARNMESH_ZMQ_{role.upper()}_{part.upper()}"


def _delta_keys() -> dict[str, str]:
    """The ring every delta party holds and the signing key the trainer alone holds."""
    signing = SigningKey.generate()
    kid = "k" + time.strftime("%Y%m%d%H%M%S") + "-" + secrets.token_hex(3)
    ring = KeyRing(None, {kid: secrets.token_bytes(32)}, kid, {signing.id: signing.public}, signing.id)
    sign_private = {"sign_private": signing.private.private_bytes_raw().hex()}
    return {"LEARNMESH_DELTA_KEY_RING": json.dumps(ring.to_dict(), separators=(",", ":")),
            "LEARNMESH_DELTA_SIGN_KEY": json.dumps(sign_private, separators=(",", ":"))}


def _curve_keys() -> dict[str, str]:
    """Each role's CURVE certificates, as shared/curve.py writes them into a keys directory."""
    out = {}
    with tempfile.TemporaryDirectory() as keys_dir:
        for role in curve.ROLES:
            curve.write_keypair(keys_dir, role)
            out[curve_variable(role, "secret")] = _quotable(curve.secret_file(keys_dir, role).read_text())
            out[curve_variable(role, "public")] = _quotable(curve.public_file(keys_dir, role).read_text())
    return out


def _quotable(certificate: str) -> str:
    """``certificate`` without its comment lines that hold a single quote (which would end the
    env file's quoted value); ZPL comments carry no key material."""
    return "".join(line for line in certificate.splitlines(keepends=True)
                   if not (line.startswith("#") and "'" in line))


def generate(api_keys: dict[str, str] | None = None) -> dict[str, str]:
    """Variable -> value, all freshly generated (``api_keys``: principal -> key to use instead)."""
    api_keys = api_keys or {"demo": secrets.token_urlsafe(24)}
    redis_password, exporter_password = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    return {
        "LEARNMESH_API_KEYS": ",".join(f"{p}:{k}" for p, k in api_keys.items()),
        "LEARNMESH_ADMIN_KEY": secrets.token_urlsafe(24),
        # one key for every gateway replica: a requestState sealed by one is opened by another
        "LEARNMESH_REQUEST_STATE_KEYS": secrets.token_hex(32),
        "LEARNMESH_REDIS_PASSWORD": redis_password,
        "LEARNMESH_REDIS_PASSWORD_SHA256": hashlib.sha256(redis_password.encode()).hexdigest(),
        "REDIS_EXPORTER_PASSWORD_SHA256": hashlib.sha256(exporter_password.encode()).hexdigest(),
        "REDIS_EXPORTER_PASSWORDS": json.dumps({"redis://redis:6379": exporter_password}),
        **_delta_keys(),
        **_curve_keys(),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(18),
    }


def render(values: dict[str, str]) -> str:
    """An env file compose reads: single quotes keep a value literal, newlines included (the
    CURVE certificates span lines)."""
    lines = ["# learnmesh compose secrets, made by `learnmesh compose-secrets`. Private (mode 0600), never commit.",
             "# Use: docker compose --env-file .env --env-file secrets.env up --build"]
    return "\n".join(lines) + "\n" + _assignments(values)


def _assignments(values: dict[str, str]) -> str:
    lines = []
    for name, value in values.items():
        if "'" in value or "\\" in value:
            raise ValueError(f"{name} cannot be written to an env file")
        lines.append(f"{name}='{value}'")
    return "".join(line + "\n" for line in lines)


# Variables made together: one without the other would not work (a password and its hash, the
# ring and the key it verifies, a CURVE keypair), so a file holding part of a group is not mended.
_GROUPS = [("LEARNMESH_REDIS_PASSWORD", "LEARNMESH_REDIS_PASSWORD_SHA256"),
           ("REDIS_EXPORTER_PASSWORD_SHA256", "REDIS_EXPORTER_PASSWORDS"),
           ("LEARNMESH_DELTA_KEY_RING", "LEARNMESH_DELTA_SIGN_KEY"),
           *((curve_variable(role, "secret"), curve_variable(role, "public")) for role in curve.ROLES)]


def _missing(text: str, values: dict[str, str]) -> dict[str, str]:
    """The variables of ``values`` an existing secrets file ``text`` lacks (one written by an
    earlier version), to be added to it; raises ValueError when it holds part of a group."""
    have = set(re.findall(r"^([A-Z][A-Z0-9_]*)=", text, re.M))
    for group in _GROUPS:
        if 0 < len(have & set(group)) < len(group):
            raise ValueError(f"it holds {', '.join(sorted(have & set(group)))} without "
                             f"{', '.join(sorted(set(group) - have))}")
    return {k: v for k, v in values.items() if k not in have}


def main(cfg: Config, args: argparse.Namespace) -> int:
    """``args``: ``out`` (a path, or - for stdout), ``api_keys`` (a spec or None), ``force``."""
    values = generate(parse_api_keys(args.api_keys) if args.api_keys else None)
    if args.out == "-":
        sys.stdout.write(render(values))
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        return _complete(out, values)
    write_private(out, render(values))
    print(f"wrote {out} (0600): the API keys (LEARNMESH_API_KEYS), the admin key (LEARNMESH_ADMIN_KEY) and the "
          f"Grafana admin password (GRAFANA_ADMIN_PASSWORD) are in it")
    if (out.parent / "docker-compose.yml").exists():  # elsewhere (Kubernetes' make-secrets.sh) compose is not next
        print(f"start: cd {out.parent} && docker compose --env-file .env --env-file {out.name} up --build")
    return 0


def _complete(out: Path, values: dict[str, str]) -> int:
    """An existing file keeps every key in it; what this version needs and the file lacks is
    added (an upgrade then rotates nothing). A file that lacks nothing is left as it is: running
    it again after an upgrade is one step whether or not the upgrade brought a key."""
    old = read_private_text(out, "compose secrets file")  # refused, naming the fix, when others may read it
    try:
        added = _missing(old, values)
    except ValueError as e:
        print(f"{out}: {e}; pass --force to replace every key in it", file=sys.stderr)
        return 1
    if not added:
        print(f"{out} holds every key this version needs: kept as it is (--force replaces every key in it)")
        return 0
    write_private(out, old + "\n" + _assignments(added))
    print(f"{out}: kept every key in it and added {', '.join(added)}; recreate the services that use them "
          f"(docker compose ... up -d, or re-apply the Kubernetes Secrets and restart)")
    return 0
