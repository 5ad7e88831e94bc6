"""``learnmesh keys``: make the mesh's missing keys, or replace one role's CURVE keypair.

For meshes that are not started by ``learnmesh up`` (which makes missing keys itself): run it
once where the keys are kept, then give each host only what its role needs
(docs/operations.md, "Security model"). It prints public keys and paths, never a secret.

The request-state key is ``learnmesh up``'s own (``var/keys/generated.yaml``, made there if
missing), also written alone to a 0600 file that ``LEARNMESH_REQUEST_STATE_KEYS_FILE`` can name,
so that gateways started by hand, wherever they run, open what ``up``'s gateway seals.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.supervisor import load_or_create_request_state_keys, under_var
from shared import crypto, curve
from shared.config import Config, var_dir
from shared.secret_files import write_private

REQUEST_STATE_FILE = "request-state.keys"


def main(cfg: Config, args: argparse.Namespace) -> int:
    var = var_dir().resolve()
    cfg = under_var(cfg, var)  # where `up` reads them ($LEARNMESH_VAR)
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
    print(request_state_file(cfg, var))
    return 0


def request_state_file(cfg: Config, var: Path) -> str:
    """Write the request-state keys ``up`` uses to ``var/keys/request-state.keys`` unless that
    file exists (an operator may have added a key to it for a rotation); say where and how to use
    it. Keys given in the configuration are the operator's to hand out: no file is made."""
    if cfg.gateway.request_state_keys:
        return "request-state keys (every gateway): given by gateway.request_state_keys; no file made"
    path = var / "keys" / REQUEST_STATE_FILE
    done = "kept"
    if not path.exists():
        write_private(path, "".join(f"{key}\n" for key in load_or_create_request_state_keys(var, cfg)))
        done = "made"
    return (f"request-state key (every gateway) {done}: {path} "
            f"(start each gateway with LEARNMESH_REQUEST_STATE_KEYS_FILE naming it or a 0600 copy)")
