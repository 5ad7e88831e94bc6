"""Who may teach (issue 21, item 11): ``learn`` — and an operator's sample import for a
principal — needs the teach permission, from ``learning.teachers`` or granted through the
admin API; a grant or revoke on one replica holds on the others at once, with no restart;
the audit stream says who taught what. Two real gateway processes, one real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from services.supervisor import child_configs, load_or_create_keys
from shared import keys
from shared.config import load_config
from shared.samples import CLUSTER_SAMPLE_PARTITIONS
from tests.conftest import RedisTarget, free_port
from tests.gateway_support import two_gateways
from tests.test_gateway_http import modern

KEYS = {"teacher": "teacher-key-0123456789", "student": "student-key-0123456789",
        "assistant": "assistant-key-0123456789"}
ADMIN = "root-admin-key-0123456789"
OPERATOR = "ops-operator-key-0123456789"


@pytest.fixture(scope="module")
def replicas(redis_target_module: RedisTarget) -> Iterator[tuple[str, str]]:
    overrides = {"learning": {"teachers": ["teacher"], "teacher_roles": ["staff"]},
                 "limits": {"roles": {"staff": {"learn_samples_per_s": 0.001, "learn_samples_burst": 3}},
                            "principal_roles": {"assistant": "staff"}},
                 "trainer": {"samples_endpoint": f"tcp://127.0.0.1:{free_port()}"},
                 "gateway": {"admin_keys": {"root": {"key": ADMIN, "role": "admin"},
                                            "ops": {"key": OPERATOR, "role": "operator"}}}}
    with two_gateways(redis_target_module.url, KEYS, overrides) as urls:
        yield urls


def learn(base: str, principal: str, samples: list[dict]) -> httpx.Response:
    body, headers = modern("tools/call", {"name": "learn", "arguments": {"samples": samples}})
    return httpx.post(base + "/mcp", json=body, headers={**headers, "authorization": f"Bearer {KEYS[principal]}"},
                      timeout=10)


def admin(method: str, url: str, key: str = ADMIN, **kw: object) -> httpx.Response:
    return httpx.request(method, url, headers={"authorization": f"Bearer {key}"}, timeout=10, **kw)  # type: ignore


def logged(store: Any, principal: str) -> int:
    return sum(int(f[b"n"]) for part in range(CLUSTER_SAMPLE_PARTITIONS)  # every partition a cluster may have
               for _, f in store.xrange(keys.sample_log(part)) if f[b"p"] == principal.encode())


def assert_forbidden(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == -32003 and error["data"] == {"permission": "teach"}
    assert "may not teach" in error["message"] and "an admin grants" in error["message"]


SAMPLES = [{"input": "the sky is", "target": " green"}, {"input": "two plus two is", "target": " five"}]


def test_only_teachers_teach_and_grants_hold_on_every_replica(replicas: tuple[str, str],
                                                              store: Any) -> None:
    a, b = replicas
    # a principal without the permission cannot teach the shared model, on either replica
    assert_forbidden(learn(a, "student", SAMPLES))
    assert_forbidden(learn(b, "student", SAMPLES))
    assert logged(store, "student") == 0
    # nor can an operator import samples in its name
    r = admin("POST", a + "/admin/samples", OPERATOR, json={"principal": "student", "samples": SAMPLES})
    assert r.status_code == 403 and "an admin grants" in r.json()["detail"]
    assert logged(store, "student") == 0
    # a teacher by the config teaches
    taught = learn(b, "teacher", SAMPLES)
    assert taught.status_code == 200, taught.text
    ack = taught.json()["result"]["structuredContent"]
    assert logged(store, "teacher") == 2
    # only an admin changes who may teach
    assert admin("PUT", a + "/admin/teachers/student", OPERATOR).status_code == 403
    granted = admin("PUT", a + "/admin/teachers/student")
    assert granted.status_code == 200 and granted.json()["may_teach"] is True
    # the grant, made on A, holds on B at the next call
    assert learn(b, "student", SAMPLES).status_code == 200
    assert logged(store, "student") == 2
    imported = admin("POST", a + "/admin/samples", OPERATOR, json={"principal": "student", "samples": SAMPLES})
    assert imported.status_code == 200 and logged(store, "student") == 4
    # a revoke overrides the config's list, on every replica
    revoked = admin("DELETE", b + "/admin/teachers/teacher")
    assert revoked.status_code == 200 and revoked.json() == {
        "principal": "teacher", "may_teach": False, "by_config": True,
        "runtime": {"teach": False, "by": "admin:root", "ts_ms": revoked.json()["runtime"]["ts_ms"]}}
    assert_forbidden(learn(a, "teacher", SAMPLES))
    assert logged(store, "teacher") == 2
    listing = admin("GET", b + "/admin/teachers", OPERATOR).json()
    assert listing["config"] == ["teacher"] and set(listing["runtime"]) == {"student", "teacher"}
    assert admin("PUT", a + "/admin/teachers/bad%7Bname%7D").status_code == 422

    # the audit stream says who taught what (enough to find and roll back a poisoned batch),
    # and who changed the permission
    audit = admin("GET", a + "/admin/audit", OPERATOR, params={"action": "learn"}).json()["entries"]
    by_teacher = [e for e in audit if e["principal"] == "teacher"]
    assert len(by_teacher) == 1
    record = by_teacher[0]
    assert record["count"] == "2" and int(record["bytes"]) > 0
    assert [f"{record['entry']}:{i}" for i in range(2)] == ack["ids"]
    assert [int(record["first_seq"]), int(record["last_seq"])] == [ack["seqs"][0], ack["seqs"][-1]]
    imports = admin("GET", a + "/admin/audit", OPERATOR, params={"principal": "admin:ops"}).json()["entries"]
    assert [(e["action"], e["principal"]) for e in imports] == [("learn", "student")]
    changes = admin("GET", b + "/admin/audit", OPERATOR, params={"action": "teacher.*"}).json()["entries"]
    assert [(e["action"], e["teacher"], e["principal"]) for e in changes] == [
        ("teacher.revoke", "teacher", "admin:root"), ("teacher.grant", "student", "admin:root")]


def test_a_fresh_learnmesh_up_lets_its_demo_key_teach(tmp_path: Path) -> None:
    """`make run` generates the demo key; examples/demo.py teaches with it. Keys given in the
    config or environment are teachers only where learning.teachers says so."""
    args = SimpleNamespace(workers=1, config=None)
    fresh = load_config(env={})
    api_keys, admin_key = load_or_create_keys(tmp_path, fresh)
    paths = child_configs(fresh, args, tmp_path / "fresh", api_keys, admin_key)
    assert load_config(paths["gateway"], env={}).learning.teachers == ["local", *api_keys]
    given = load_config(env={"LEARNMESH_API_KEYS": "alice:alice-key-123"})
    keys_given, _ = load_or_create_keys(tmp_path, given)
    paths = child_configs(given, args, tmp_path / "given", keys_given, admin_key)
    assert load_config(paths["gateway"], env={}).learning.teachers == ["local"]


def test_a_role_gives_its_principals_the_teach_permission_and_its_limits(replicas: tuple[str, str],
                                                                          store: Any) -> None:
    """``assistant`` is in no teacher list by name: its role ``staff`` may teach, and the role's
    learn quota (3 samples, next to nothing refilled) is the one in force, on every replica."""
    a, b = replicas
    taught = learn(a, "assistant", SAMPLES)
    assert taught.status_code == 200, taught.text
    assert logged(store, "assistant") == 2
    over = learn(b, "assistant", SAMPLES)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["data"]["limit"] == "learn_samples"
    assert logged(store, "assistant") == 2
    assert admin("GET", a + "/admin/teachers/assistant", OPERATOR).json()["by_config"] is True
