"""Envelope: AES-256-GCM + Ed25519, key ring and signing key files, rotation with a grace
period, and every rejection reason."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.crypto import (
    STREAM_DELTA,
    EnvelopeOpener,
    EnvelopeReject,
    EnvelopeSealer,
    KeyFileError,
    KeyRing,
    SigningKey,
    retire_key,
    rotate_encryption_key,
    rotate_signing_key,
    trainer_keys,
)
from shared.secret_files import write_private


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    return tmp_path / "keys" / "delta.key"


def sign_file(key_file: Path) -> Path:
    return key_file.with_name("delta-sign.key")


def sealer_for(key_file: Path, sender: str = "trainer-a", **kw) -> EnvelopeSealer:
    ring, signer = trainer_keys(key_file, sign_file(key_file))
    return EnvelopeSealer(ring, sender, signer=signer, **kw)


def pair(key_file: Path, **kw) -> tuple[EnvelopeSealer, EnvelopeOpener]:
    sealer = sealer_for(key_file, **kw)
    return sealer, EnvelopeOpener(KeyRing.load(key_file))


def reason(opener: EnvelopeOpener, frames: list[bytes], **kw) -> str:
    with pytest.raises(EnvelopeReject) as exc:
        opener.open(frames, **kw)
    return exc.value.reason


def test_key_files_are_created_private_split_and_never_printed(key_file: Path) -> None:
    ring, signer = trainer_keys(key_file, sign_file(key_file))
    assert signer is not None
    for path in (key_file, sign_file(key_file)):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secret = ring.keys[ring.active].hex()
    private = signer.private.private_bytes_raw().hex()
    assert secret not in repr(ring) and private not in repr(signer)
    assert private not in key_file.read_text(), "the ring file holds no signing private key"
    assert ring.signer == signer.id and ring.verify_keys[signer.id] is not None
    again, same = trainer_keys(key_file, sign_file(key_file))  # existing files are kept
    assert again.keys == ring.keys and same is not None and same.id == signer.id


def test_a_legacy_combined_file_is_split_and_keeps_working(key_file: Path) -> None:
    """A ring file written before the split (signing private key inside) still opens packets
    for workers, which never load the private key from it; the trainer moves it out."""
    private = SigningKey.generate()
    legacy = {"active": "k1", "keys": {"k1": os.urandom(32).hex()},
              "sign_private": private.private.private_bytes_raw().hex(),
              "sign_public": private.public.public_bytes_raw().hex()}
    key_file.parent.mkdir(parents=True)
    key_file.write_bytes(orjson.dumps(legacy))
    key_file.chmod(0o600)
    worker_ring = KeyRing.load(key_file)  # what a worker of the old var/ loads
    assert not any(isinstance(v, SigningKey) for v in vars(worker_ring).values())
    assert worker_ring.signer == private.id
    ring, signer = trainer_keys(key_file, sign_file(key_file))
    assert signer is not None and signer.id == private.id and ring.keys == {"k1": bytes.fromhex(legacy["keys"]["k1"])}
    assert "sign_private" not in orjson.loads(key_file.read_bytes())
    assert SigningKey.load(sign_file(key_file)).id == private.id
    frames = EnvelopeSealer(ring, "trainer-a", signer=signer).seal(STREAM_DELTA, {"v": 1}, b"x")
    assert EnvelopeOpener(worker_ring).open(frames).payload == b"x"


def test_round_trip_and_metadata_is_authenticated(key_file: Path) -> None:
    sealer, opener = pair(key_file)
    frames = sealer.seal(STREAM_DELTA, {"version": 3, "base": 2}, b"payload")
    got = opener.open(frames)
    assert got.payload == b"payload" and got.meta == {"version": 3, "base": 2} and got.new_session
    forged_header = frames[0].replace(b'"version":3', b'"version":9')
    assert forged_header != frames[0]
    unsigned_opener = EnvelopeOpener(KeyRing.load(key_file), require_signature=False)
    assert reason(unsigned_opener, [forged_header, frames[1]]) == "tampered"
    assert reason(opener, [forged_header, frames[1], frames[2]]) == "bad_signature"


def test_tampered_truncated_malformed(key_file: Path) -> None:
    sealer, opener = pair(key_file)
    frames = sealer.seal(STREAM_DELTA, {}, b"x" * 100)
    ct = bytearray(frames[1])
    ct[10] ^= 1
    assert reason(opener, [frames[0], bytes(ct), frames[2]]) == "bad_signature"
    lax = EnvelopeOpener(KeyRing.load(key_file), require_signature=False)
    assert reason(lax, [frames[0], bytes(ct)]) == "tampered"
    assert reason(lax, [frames[0], frames[1][:-3]]) == "tampered"
    assert reason(lax, [frames[0], frames[1][:8]]) == "truncated"
    assert reason(opener, [frames[0]]) == "truncated"
    assert reason(opener, [frames[0], frames[1]]) == "bad_signature"  # signature frame stripped
    assert reason(opener, [b"not json", frames[1], frames[2]]) == "malformed"
    assert opener.open(frames).payload == b"x" * 100  # the genuine packet still opens


def test_replayed_out_of_order_and_stale_session(key_file: Path) -> None:
    sealer, opener = pair(key_file)
    p = [sealer.seal(STREAM_DELTA, {"i": i}, b"%d" % i) for i in range(4)]
    opener.open(p[0])
    opener.open(p[2])
    assert reason(opener, p[0]) == "replayed"
    assert reason(opener, p[2]) == "replayed"
    assert reason(opener, p[1]) == "out_of_order"
    opener.open(p[3])
    restarted = sealer_for(key_file)
    assert opener.open(restarted.seal(STREAM_DELTA, {}, b"new")).new_session
    assert reason(opener, sealer.seal(STREAM_DELTA, {}, b"old")) == "stale"


def test_wrong_key_and_forgery_by_a_key_holding_worker(key_file: Path, tmp_path: Path) -> None:
    sealer, opener = pair(key_file)
    other = sealer_for(tmp_path / "other" / "delta.key")
    assert reason(opener, other.seal(STREAM_DELTA, {}, b"x")) == "wrong_key"
    # same key id, different secret
    ring = KeyRing.load(key_file)
    ring.keys[ring.active] = os.urandom(32)
    impostor = EnvelopeSealer(ring, "trainer-a", sign=False)
    lax = EnvelopeOpener(KeyRing.load(key_file), require_signature=False)
    assert reason(lax, impostor.seal(STREAM_DELTA, {}, b"x")) == "tampered"
    # a worker holds the symmetric key and verify keys only: it cannot sign
    worker_ring = KeyRing.load(key_file)
    forged = EnvelopeSealer(worker_ring, "trainer-a", sign=False).seal(STREAM_DELTA, {"version": 99}, b"evil")
    assert reason(EnvelopeOpener(worker_ring), forged) == "bad_signature"
    # signed by a key that is not the trainer's, whether it names the trainer's key id or its own
    rogue = SigningKey.generate()
    resigned = [forged[0], forged[1], rogue.private.sign(forged[0] + forged[1])]
    assert reason(EnvelopeOpener(worker_ring), resigned) == "bad_signature"
    own = EnvelopeSealer(worker_ring, "trainer-a", signer=rogue).seal(STREAM_DELTA, {"version": 99}, b"evil")
    assert reason(EnvelopeOpener(worker_ring), own) == "bad_signature"
    claims = orjson.loads(own[0])
    claims["sk"] = worker_ring.signer
    header = orjson.dumps(claims)
    assert reason(EnvelopeOpener(worker_ring), [header, own[1], own[2]]) == "bad_signature"


def test_signature_covers_the_ciphertext_digest_and_names_its_key(key_file: Path) -> None:
    import hashlib

    sealer, opener = pair(key_file)
    frames = sealer.seal(STREAM_DELTA, {"version": 1}, b"w" * 1000)
    header, ct, sig = frames
    assert sealer.signer is not None
    assert orjson.loads(header)["v"] == 3 and orjson.loads(header)["sk"] == sealer.signer.id
    priv = sealer.signer.private
    priv.public_key().verify(sig, header + hashlib.sha256(ct).digest())
    old_style = [header, ct, priv.sign(header + ct)]  # version 1 signed the whole ciphertext
    assert reason(opener, old_style) == "bad_signature"
    unversioned = orjson.dumps({k: v for k, v in orjson.loads(header).items() if k != "v"})
    assert reason(opener, [unversioned, ct, priv.sign(unversioned + hashlib.sha256(ct).digest())]) == "malformed"
    assert opener.open(frames).payload == b"w" * 1000


def test_encryption_key_rotation_keeps_the_old_key_for_the_grace_period_only(key_file: Path) -> None:
    sealer, _ = pair(key_file)
    now = [10**13]
    opener = EnvelopeOpener(KeyRing.load(key_file), clock_ms=lambda: now[0])
    old_kid = sealer.ring.active
    before = [sealer.seal(STREAM_DELTA, {}, b"a%d" % i) for i in range(2)]
    new_kid = rotate_encryption_key(key_file, grace_s=60)
    assert sealer.ring.reload_if_changed() and sealer.ring.active == new_kid != old_kid
    after = sealer.seal(STREAM_DELTA, {}, b"b")
    now[0] = KeyRing.load(key_file).retiring[old_kid] - 1  # still within the grace period
    assert opener.open(before[0]).payload == b"a0"
    assert opener.open(after).payload == b"b"  # unknown kid -> opener reloads the file
    now[0] += 1  # the deadline: the old key is refused from here on
    assert reason(opener, before[1]) == "retired_key"
    assert opener.open(sealer.seal(STREAM_DELTA, {}, b"c")).payload == b"c"
    # a rotation after the deadline drops the expired key from the file
    ring = KeyRing.load(key_file)
    ring.prune(now[0])
    assert old_kid not in ring.keys and new_kid in ring.keys


def test_signing_key_rotation_accepts_both_verify_keys_during_the_grace_period(key_file: Path) -> None:
    sealer, _ = pair(key_file)
    now = [10**13]
    opener = EnvelopeOpener(KeyRing.load(key_file), clock_ms=lambda: now[0])
    assert sealer.signer is not None
    old_id = sealer.signer.id
    signed_old = [sealer.seal(STREAM_DELTA, {}, b"o%d" % i) for i in range(2)]
    fresh = rotate_signing_key(key_file, sign_file(key_file), grace_s=30)
    assert SigningKey.load(sign_file(key_file)).id == fresh.id != old_id
    sealer.ring.reload_if_changed()
    sealer.set_signer(fresh)
    signed_new = sealer.seal(STREAM_DELTA, {}, b"n")
    now[0] = KeyRing.load(key_file).verify_retiring[old_id] - 1
    assert opener.open(signed_old[0]).payload == b"o0"
    assert opener.open(signed_new).payload == b"n"  # unknown signer -> opener reloads the ring
    now[0] += 1
    assert reason(opener, signed_old[1]) == "bad_signature"
    assert opener.open(sealer.seal(STREAM_DELTA, {}, b"m")).payload == b"m"


def test_a_key_can_be_retired_at_once(key_file: Path) -> None:
    sealer, opener = pair(key_file)
    old_kid = sealer.ring.active
    before = sealer.seal(STREAM_DELTA, {}, b"a")
    rotate_encryption_key(key_file, grace_s=3600)
    with pytest.raises(ValueError):
        retire_key(key_file, KeyRing.load(key_file).active)
    retire_key(key_file, old_kid)
    opener.ring.reload_if_changed()
    assert reason(opener, before) == "wrong_key"


@pytest.mark.parametrize("field,value", [("active", []), ("active", {"k": 1}), ("verify_keys", 1),
                                         ("verify_keys", "x"), ("keys", ["k"])])
def test_a_ring_edited_by_hand_into_a_wrong_shape_is_a_clear_error_and_a_running_ring_keeps_its_keys(
        key_file: Path, field: str, value: object) -> None:
    sealer, opener = pair(key_file)
    data = orjson.loads(key_file.read_bytes())
    data[field] = value
    write_private(key_file, orjson.dumps(data))
    with pytest.raises(KeyFileError, match=field.rstrip("s")):
        KeyRing.load(key_file)
    assert not opener.ring.reload_if_changed() and not sealer.ring.reload_if_changed()  # warned, kept
    assert opener.open(sealer.seal(STREAM_DELTA, {}, b"a")).payload == b"a"


def test_rekey_changes_epoch_and_nonces_never_repeat(key_file: Path) -> None:
    sealer, opener = pair(key_file, rekey_after_packets=3)
    seen = set()
    for i in range(10):
        frames = sealer.seal(STREAM_DELTA, {}, b"same")
        got = opener.open(frames)
        assert got.header["epoch"] == i // 3
        key = (got.header["sess"], got.header["stream"], got.header["seq"])
        assert key not in seen
        seen.add(key)
        assert frames[1] not in seen
        seen.add(frames[1])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_envelope_mutations_are_rejected(key_file: Path, data: st.DataObject) -> None:
    sealer, opener = pair(key_file)
    frames = [bytearray(f) for f in sealer.seal(STREAM_DELTA, {"version": 1}, b"weights" * 20)]
    which = data.draw(st.integers(0, 2))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "replace"]))
    f = frames[which]
    if how == "flip":
        pos = data.draw(st.integers(0, len(f) - 1))
        f[pos] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        frames[which] = f[: data.draw(st.integers(0, len(f) - 1))]
    elif how == "extend":
        f += data.draw(st.binary(min_size=1, max_size=32))
    else:
        frames[which] = bytearray(data.draw(st.binary(max_size=200)))
    try:
        opener.open([bytes(x) for x in frames])
    except EnvelopeReject:
        return
    raise AssertionError("a mutated packet was accepted")


def test_fuzz_envelope_thousands_of_mutations(key_file: Path) -> None:
    sealer, opener = pair(key_file)
    rng = np.random.default_rng(7)
    reasons: dict[str, int] = {}
    for n in range(3000):
        frames = [bytearray(f) for f in sealer.seal(STREAM_DELTA, {"version": n}, os.urandom(64))]
        which = int(rng.integers(3))
        for _ in range(int(rng.integers(1, 4))):
            frames[which][int(rng.integers(len(frames[which])))] ^= int(rng.integers(1, 256))
        try:
            opener.open([bytes(x) for x in frames])
        except EnvelopeReject as exc:
            reasons[exc.reason] = reasons.get(exc.reason, 0) + 1
            continue
        raise AssertionError("a mutated packet was accepted")
    assert sum(reasons.values()) == 3000 and "bad_signature" in reasons
