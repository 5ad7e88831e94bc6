"""``learnmesh keys``: make the mesh's missing keys, or replace one role's CURVE keypair.

For meshes that are not started by ``learnmesh up`` (which makes missing keys itself): run it
once where the keys are kept, then give each host only what its role needs
(docs/operations.md, "Security model"). It prints public keys and paths, never a secret.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.supervisor import under_var
from shared import crypto, curve
from shared.config import Config, var_dir


def main(cfg: Config, args: argparse.Namespace) -> int:
    cfg = under_var(cfg, var_dir().resolve())  # where `up` reads them ($LEARNMESH_VAR)
    keys_dir = Path(cfg.zmq.keys_dir)
    if args.rotate_zmq:
        public = curve.write_keypair(keys_dir, args.rotate_zmq, keep_previous=True)
        print(f"new {args.rotate_zmq} CURVE keypair in {keys_dir}: public key {public.decode()}\n"
              f"the previous public key stays allowed as {args.rotate_zmq}.previous.key until you delete it; "
              f"restart the {args.rotate_zmq} processes, then those that connect to them")
        return 0
    made = curve.ensure_keys(keys_dir)
    crypto.ensure_keys(cfg.security.delta_key_file, cfg.security.signing_key_path)
    for role in curve.ROLES:
        text = curve.CurveKeys(keys_dir, role).own.public.decode()
        print(f"{role:8} CURVE {'made' if role in made else 'kept'}: {curve.secret_file(keys_dir, role)} "
              f"(public {text})")
    print(f"delta key ring (every role): {cfg.security.delta_key_file}\n"
          f"delta signing key (trainer only): {cfg.security.signing_key_path}")
    return 0
