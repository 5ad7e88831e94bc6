"""Keys that gained a hash tag (keys.RENAMED): a gateway started on a single server that still
holds them under their old names renames them, so admin keys created through the API and the
runtime configuration survive the upgrade; what is already under the new name is kept."""

from __future__ import annotations

import redis as redis_sync
from fastapi.testclient import TestClient

from gateway.app import create_app
from shared import keys
from shared.config import load_config


def test_a_gateway_adopts_the_old_names_at_start(redis_url: str) -> None:
    old_keys, old_config = "lm:admin:keys", "lm:config:runtime"
    assert keys.RENAMED[old_keys] == keys.ADMIN_KEYS and keys.RENAMED[old_config] == keys.RUNTIME_CONFIG
    r = redis_sync.Redis.from_url(redis_url)
    try:
        r.hset(old_keys, "ab12", '{"name": "ci", "role": "viewer"}')
        r.hset(old_config, "compression", '{"density": 0.5}')
        r.set(keys.RUNTIME_CONFIG_REV, 7)  # already under its new name: kept
        r.set("lm:config:runtime:rev", 3)
        cfg = load_config(env={}, overrides={"redis": {"url": redis_url}, "worker": {"endpoints": []}})
        with TestClient(create_app(cfg), base_url="http://127.0.0.1:8000"):
            pass
        assert r.hgetall(keys.ADMIN_KEYS) == {b"ab12": b'{"name": "ci", "role": "viewer"}'}
        assert r.hget(keys.RUNTIME_CONFIG, "compression") == b'{"density": 0.5}'
        assert not r.exists(old_keys, old_config)
        assert r.get(keys.RUNTIME_CONFIG_REV) == b"7" and r.get("lm:config:runtime:rev") == b"3"
    finally:
        r.close()
