"""``learnmesh compose-secrets``: every secret the compose stack needs, generated into one
0600 env file that ``docker compose --env-file .env --env-file secrets.env`` reads.

compose/docker-compose.yml turns each variable into a compose secret mounted (0400, owned by
the service's user) only where it is needed: the API and admin keys in the gateway, the
delta signing ring in the trainer, the verify-only ring in the workers, the Redis passwords
in learnmesh's processes and the exporter, the Grafana password in Grafana. Redis itself
gets only SHA-256 hashes of its users' passwords (ACL rules on its command line). Nothing
in the repository works as a key: without this file the stack refuses to start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import secrets
import sys
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.config import Config, parse_api_keys
from shared.crypto import KeyRing
from shared.secret_files import write_private

REDIS_USER = "learnmesh"
EXPORTER_USER = "exporter"


def _ring_json(ring: KeyRing, *, signing: bool) -> str:
    return json.dumps(ring.to_dict(include_signing_private=signing), separators=(",", ":"))


def generate(api_keys: dict[str, str] | None = None) -> dict[str, str]:
    """Variable -> value, all freshly generated (``api_keys``: principal -> key to use instead)."""
    api_keys = api_keys or {"demo": secrets.token_urlsafe(24)}
    redis_password, exporter_password = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    signing = Ed25519PrivateKey.generate()
    kid = "k" + time.strftime("%Y%m%d%H%M%S") + "-" + secrets.token_hex(3)
    ring = KeyRing(None, {kid: secrets.token_bytes(32)}, kid, signing, signing.public_key())
    return {
        "LEARNMESH_API_KEYS": ",".join(f"{p}:{k}" for p, k in api_keys.items()),
        "LEARNMESH_ADMIN_KEY": secrets.token_urlsafe(24),
        "LEARNMESH_REDIS_PASSWORD": redis_password,
        "LEARNMESH_REDIS_PASSWORD_SHA256": hashlib.sha256(redis_password.encode()).hexdigest(),
        "REDIS_EXPORTER_PASSWORD_SHA256": hashlib.sha256(exporter_password.encode()).hexdigest(),
        "REDIS_EXPORTER_PASSWORDS": json.dumps({"redis://redis:6379": exporter_password}),
        "LEARNMESH_DELTA_KEY_RING": _ring_json(ring, signing=True),
        "LEARNMESH_DELTA_VERIFY_RING": _ring_json(ring, signing=False),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(18),
    }


def render(values: dict[str, str]) -> str:
    """An env file compose reads: single quotes keep JSON literal."""
    lines = ["# learnmesh compose secrets, made by `learnmesh compose-secrets`. Private (mode 0600), never commit.",
             "# Use: docker compose --env-file .env --env-file secrets.env up --build"]
    for name, value in values.items():
        if "'" in value or "\n" in value:
            raise ValueError(f"{name} cannot be written to an env file")
        lines.append(f"{name}='{value}'")
    return "\n".join(lines) + "\n"


def main(cfg: Config, args: argparse.Namespace) -> int:
    """``args``: ``out`` (a path, or - for stdout), ``api_keys`` (a spec or None), ``force``."""
    text = render(generate(parse_api_keys(args.api_keys) if args.api_keys else None))
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"{out} exists: keep it, or pass --force to replace every key in it", file=sys.stderr)
        return 1
    write_private(out, text)
    print(f"wrote {out} (0600): the API keys (LEARNMESH_API_KEYS), the admin key (LEARNMESH_ADMIN_KEY) and the "
          f"Grafana admin password (GRAFANA_ADMIN_PASSWORD) are in it\n"
          f"start: cd {out.parent} && docker compose --env-file .env --env-file {out.name} up --build")
    return 0
