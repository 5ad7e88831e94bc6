"""Keys that gained a hash tag (keys.RENAMED): a gateway started on a Redis that still holds
them under their old names moves them to the new ones, so admin keys created through the API
and the runtime configuration survive the upgrade; what is already under the new name is kept.
On a cluster the old and the new name are in different slots, where RENAME is refused
(CROSSSLOT): the gateway copies the key with DUMP and RESTORE, then deletes the old one."""

from __future__ import annotations

from fastapi.testclient import TestClient
from redis.crc import key_slot

from gateway.admin.auth import digest
from gateway.app import create_app
from shared import keys
from shared.config import load_config
from shared.redis_client import close_sync
from tests.conftest import RedisTarget


def test_a_gateway_adopts_the_old_names_at_start(redis_target: RedisTarget) -> None:
    old_keys, old_names, old_config = "lm:admin:keys", "lm:admin:keys:names", "lm:config:runtime"
    assert keys.RENAMED[old_keys] == keys.ADMIN_KEYS and keys.RENAMED[old_config] == keys.RUNTIME_CONFIG
    assert all(key_slot(old.encode()) != key_slot(new.encode()) for old, new in keys.RENAMED.items())
    admin_key = "lm-admin-key-made-before-the-upgrade"
    key_digest = digest(admin_key).hex()
    r = redis_target.sync_client()
    try:
        r.hset(old_keys, key_digest, '{"name": "ci", "role": "viewer"}')
        r.hset(old_names, "ci", key_digest)
        r.hset(old_config, "compression", '{"density": 0.5}')
        r.set(keys.RUNTIME_CONFIG_REV, 7)  # already under its new name: kept
        r.set("lm:config:runtime:rev", 3)
        cfg = load_config(env={}, overrides={"redis": {"url": redis_target.url}, "worker": {"endpoints": []}})
        with TestClient(create_app(cfg), base_url="http://127.0.0.1:8000") as client:
            seen = client.get("/admin/config", headers={"Authorization": f"Bearer {admin_key}"})
        assert seen.status_code == 200, seen.text  # the old admin key still lets its holder in
        assert seen.json()["runtime_overrides"]["compression"]["density"] == 0.5 and seen.json()["revision"] == 7
        assert r.hgetall(keys.ADMIN_KEYS) == {key_digest.encode(): b'{"name": "ci", "role": "viewer"}'}
        assert r.hgetall(keys.ADMIN_KEY_NAMES) == {b"ci": key_digest.encode()}
        assert r.hget(keys.RUNTIME_CONFIG, "compression") == b'{"density": 0.5}'
        assert not any(r.exists(old) for old in (old_keys, old_names, old_config))
        assert r.get(keys.RUNTIME_CONFIG_REV) == b"7" and r.get("lm:config:runtime:rev") == b"3"
    finally:
        close_sync(r)
