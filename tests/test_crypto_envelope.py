"""Envelope: AES-256-GCM + Ed25519, key file, rotation, and every rejection reason."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.crypto import (
    STREAM_DELTA,
    EnvelopeOpener,
    EnvelopeReject,
    EnvelopeSealer,
    KeyRing,
    retire_key,
    rotate_key_file,
)


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    return tmp_path / "keys" / "delta.key"


def pair(key_file: Path, **kw) -> tuple[EnvelopeSealer, EnvelopeOpener]:
    ring = KeyRing.load_or_create(key_file)
    return EnvelopeSealer(ring, "trainer-a", **kw), EnvelopeOpener(KeyRing.load(key_file))


def reason(opener: EnvelopeOpener, frames: list[bytes], **kw) -> str:
    with pytest.raises(EnvelopeReject) as exc:
        opener.open(frames, **kw)
    return exc.value.reason


def test_key_file_is_created_private_and_never_printed(key_file: Path) -> None:
    ring = KeyRing.load_or_create(key_file)
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    secret = ring.keys[ring.active].hex()
    assert secret not in repr(ring) and secret not in str(ring)
    again = KeyRing.load_or_create(key_file)  # existing file is kept
    assert again.keys == ring.keys


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
    restarted = EnvelopeSealer(KeyRing.load(key_file), "trainer-a")
    assert opener.open(restarted.seal(STREAM_DELTA, {}, b"new")).new_session
    assert reason(opener, sealer.seal(STREAM_DELTA, {}, b"old")) == "stale"


def test_wrong_key_and_forgery_by_a_key_holding_worker(key_file: Path, tmp_path: Path) -> None:
    sealer, opener = pair(key_file)
    other = EnvelopeSealer(KeyRing.load_or_create(tmp_path / "other.key"), "trainer-a")
    assert reason(opener, other.seal(STREAM_DELTA, {}, b"x")) == "wrong_key"
    # same key id, different secret
    ring = KeyRing.load(key_file)
    ring.keys[ring.active] = os.urandom(32)
    impostor = EnvelopeSealer(ring, "trainer-a", sign=False)
    lax = EnvelopeOpener(KeyRing.load(key_file), require_signature=False)
    assert reason(lax, impostor.seal(STREAM_DELTA, {}, b"x")) == "tampered"
    # a worker holds the symmetric key but only the public signing key: it cannot sign
    worker_file = tmp_path / "worker.key"
    KeyRing.load(key_file).save(worker_file, include_signing_private=False)
    worker_ring = KeyRing.load(worker_file)
    assert worker_ring.sign_private is None and worker_ring.sign_public is not None
    forged = EnvelopeSealer(worker_ring, "trainer-a", sign=False).seal(STREAM_DELTA, {"version": 99}, b"evil")
    assert reason(EnvelopeOpener(worker_ring), forged) == "bad_signature"
    fake_sig = EnvelopeSealer(KeyRing.load_or_create(tmp_path / "x.key"), "trainer-a")
    resigned = [forged[0], forged[1], fake_sig.ring.sign_private.sign(forged[0] + forged[1])]
    assert reason(EnvelopeOpener(worker_ring), resigned) == "bad_signature"


def test_signature_covers_the_ciphertext_digest_under_envelope_version_2(key_file: Path) -> None:
    import hashlib

    import orjson

    sealer, opener = pair(key_file)
    frames = sealer.seal(STREAM_DELTA, {"version": 1}, b"w" * 1000)
    header, ct, sig = frames
    assert orjson.loads(header)["v"] == 2
    priv = sealer.ring.sign_private
    assert priv is not None
    priv.public_key().verify(sig, header + hashlib.sha256(ct).digest())
    old_style = [header, ct, priv.sign(header + ct)]  # version 1 signed the whole ciphertext
    assert reason(opener, old_style) == "bad_signature"
    unversioned = orjson.dumps({k: v for k, v in orjson.loads(header).items() if k != "v"})
    assert reason(opener, [unversioned, ct, priv.sign(unversioned + hashlib.sha256(ct).digest())]) == "malformed"
    assert opener.open(frames).payload == b"w" * 1000


def test_rotation_without_stopping_and_retirement(key_file: Path) -> None:
    sealer, opener = pair(key_file)
    before = sealer.seal(STREAM_DELTA, {}, b"a")
    old_kid = sealer.ring.active
    new_kid = rotate_key_file(key_file)
    assert sealer.ring.reload_if_changed() and sealer.ring.active == new_kid
    after = sealer.seal(STREAM_DELTA, {}, b"b")
    assert opener.open(before).payload == b"a"
    assert opener.open(after).payload == b"b"  # unknown kid -> opener reloads the file
    retire_key(key_file, old_kid)
    opener.ring.reload_if_changed()
    late = EnvelopeSealer(KeyRing.load_or_create(key_file), "trainer-b")
    late.ring.keys[old_kid] = sealer.ring.keys[old_kid]
    late.ring.active = old_kid
    assert reason(opener, late.seal(STREAM_DELTA, {}, b"c")) == "wrong_key"


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
