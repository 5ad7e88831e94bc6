"""A real inference worker that first reports what key material it loaded.

    python -m tests.security.worker_probe CONFIG

Every way of making an Ed25519 private key is watched before learnmesh is imported; once the
worker (model, ROUTER, delta subscriber) is built, one JSON line goes to stdout: the private
keys made, the ring's fields that hold one, and the SigningKey objects alive in the process.
Then it serves like ``learnmesh worker --index 0`` until SIGTERM.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

MADE: list[str] = []


def _watch(name: str) -> None:
    original = getattr(ed25519.Ed25519PrivateKey, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        MADE.append(name)
        return original(*args, **kwargs)

    setattr(ed25519.Ed25519PrivateKey, name, staticmethod(spy))


def main() -> int:
    for name in ("generate", "from_private_bytes"):
        _watch(name)
    from services.worker.main import Worker
    from shared.config import load_config
    from shared.crypto import SigningKey

    cfg = load_config(sys.argv[1], env={})
    worker = Worker(cfg, cfg.worker.endpoints[0], "worker-0")
    ring = worker.subscriber.opener.ring
    private = ed25519.Ed25519PrivateKey
    holding = sorted(k for k, v in vars(ring).items()
                     if isinstance(v, (private, SigningKey)) or (isinstance(v, dict) and any(
                         isinstance(x, (private, SigningKey)) for x in v.values())))
    print(json.dumps({"private_keys_made": MADE, "ring_fields_holding_one": holding,
                      "signing_keys_alive": sum(isinstance(o, SigningKey) for o in gc.get_objects()),
                      "verify_keys": sorted(ring.verify_keys), "signer": ring.signer}), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    worker.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
