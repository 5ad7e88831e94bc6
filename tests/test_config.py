"""Configuration: one YAML file plus LEARNMESH_* overrides, validated once, failing loudly."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import jsonschema_rs
import pydantic
import pytest
import yaml

from shared.config import (
    AdminKey,
    CompressionConfig,
    Config,
    ConfigError,
    ContextConfig,
    apply_overrides,
    config_schema,
    load_config,
    parse_api_keys,
)
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf; an empty mapping is a leaf (a map with no entries)."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def test_example_file_lists_every_default() -> None:
    """learnmesh.example.yaml says it holds every key with its default: the same keys as the
    model, each with the model's default (a key left out loads just as well, so loading alone
    cannot tell)."""
    example = _leaves(yaml.safe_load((ROOT / "learnmesh.example.yaml").read_text()))
    defaults = _leaves(pydantic.TypeAdapter(Config).dump_python(Config(), mode="json"))
    assert sorted(defaults.keys() - example.keys()) == [], "keys missing from learnmesh.example.yaml"
    assert sorted(example.keys() - defaults.keys()) == [], "keys learnmesh.example.yaml has that the config lacks"
    assert {k: v for k, v in example.items() if v != defaults[k]} == {}, "values other than the defaults"
    assert load_config(ROOT / "learnmesh.example.yaml", env={}) == Config()


def test_env_overrides_and_shortcuts(tmp_path: Path) -> None:
    path = tmp_path / "learnmesh.yaml"
    path.write_text("gateway:\n  port: 9000\ncompression:\n  density: 0.05\n")
    cfg = load_config(path, env={"LEARNMESH_GATEWAY__PORT": "9100", "LEARNMESH_API_KEYS": "alice:KEY1aaaa,bob:KEY2bbbb",
                                 "REDIS_URL": "redis://example:6379/3"})
    assert cfg.gateway.port == 9100
    assert cfg.compression.density == 0.05
    assert cfg.gateway.api_keys == {"alice": "KEY1aaaa", "bob": "KEY2bbbb"}
    assert cfg.redis.url == "redis://example:6379/3"


@pytest.mark.parametrize("text, message", [
    ("gateway:\n  prot: 1\n", "gateway.prot"),
    ("bogus: {}\n", "bogus"),
    ("gateway:\n  port: 70000\n", "gateway.port"),
    ("gateway:\n  port: eighty\n", "gateway.port"),
    ("compression:\n  density: 2\n", "compression.density"),
    ("trainer:\n  comm_hook: magic\n", "trainer.comm_hook"),
    ("- a list\n", "mapping"),
    # a second section of one name would drop the first one's settings
    ("gateway:\n  port: 8405\nredis: {}\ngateway:\n  host: 127.0.0.1\n", "key 'gateway' is given twice"),
    ("gateway:\n  port: 1\n  port: 2\n", "key 'port' is given twice"),
    # an endless or undefined number: a timeout that never fires, a rate that is no rate
    ("redis:\n  socket_timeout_s: .inf\n", "redis.socket_timeout_s"),
    ("gateway:\n  header_timeout_s: .inf\n", "gateway.header_timeout_s"),
    ("worker:\n  max_wait_ms: .inf\n", "worker.max_wait_ms"),
    ("worker:\n  request_timeout_s: .nan\n", "worker.request_timeout_s"),
    ("trainer:\n  lr: .inf\n", "trainer.lr"),
    # numbers no process can act on, found only when one uses them
    ("redis:\n  retry_after_s: -3\n", "redis.retry_after_s"),
    ("worker:\n  request_timeout_s: 0\n", "worker.request_timeout_s"),
    ("worker:\n  request_timeout_s: -1.0\n", "worker.request_timeout_s"),
    ("worker:\n  hwm: -1\n", "worker.hwm"),
    ("trainer:\n  weight_decay: -1.0\n", "trainer.weight_decay"),
    ("trainer:\n  max_context_copy_bytes: -1\n", "trainer.max_context_copy_bytes"),
    # a ZeroMQ endpoint no socket could bind: its process would crash at every restart
    ("worker:\n  endpoints: ['tcp://[::1]:99999']\n", "worker.endpoints.0"),
    ("worker:\n  endpoints: ['tcp://127.0.0.1:5601', 'http://127.0.0.1:5602']\n", "worker.endpoints.1"),
    ("worker:\n  endpoints: ['tcp://127.0.0.1']\n", "worker.endpoints.0"),
    ("worker:\n  endpoints: ['tcp://127.0.0.1:0']\n", "worker.endpoints.0"),
    ("worker:\n  endpoints: ['tcp://127.0.0.1:5601', 'tcp://127.0.0.1:5601']\n", "worker: endpoints names"),
    ("trainer:\n  samples_endpoint: 'tcp://127.0.0.1'\n", "trainer.samples_endpoint"),
    ("security:\n  delta_pub_endpoint: 'udp://127.0.0.1:5621'\n", "security.delta_pub_endpoint"),
    ("security:\n  ack_endpoint: 'tcp://bad host:5623'\n", "security.ack_endpoint"),
    ("zmq:\n  bind_host: 'not a host!'\n", "zmq.bind_host"),
    ("worker:\n  advertise: 'garbage'\n", "worker.advertise"),
])
def test_bad_files_fail_with_the_key_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "learnmesh.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(path, env={})


def test_a_section_with_every_key_commented_out_means_its_defaults(tmp_path: Path) -> None:
    path = tmp_path / "learnmesh.yaml"
    path.write_text("gateway:\n  # port: 9000\nworker:\n  max_batch_size: 4\n")
    cfg = load_config(path, env={})
    assert cfg.gateway.port == load_config(env={}).gateway.port and cfg.worker.max_batch_size == 4


def test_bad_api_key_spec_is_refused() -> None:
    with pytest.raises(ConfigError):
        parse_api_keys("alice")
    with pytest.raises(ConfigError):
        load_config(env={"LEARNMESH_API_KEYS": "alice:short"})


def test_cli_reports_config_errors_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    path = tmp_path / "learnmesh.yaml"
    path.write_text("worker:\n  max_batch_size: 0\n")
    assert main(["--config", str(path), "gateway"]) == 2
    err = capsys.readouterr().err
    assert "worker.max_batch_size" in err and "Traceback" not in err


def test_errors_name_every_bad_key_and_never_echo_a_value() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides={"gateway": {"session_idle_ttl_s": 0, "api_keys": {"alice": "secret"}}})
    text = str(err.value)
    assert "gateway.session_idle_ttl_s: " in text and "gateway.api_keys.alice: " in text
    assert "secret" not in text


@pytest.mark.parametrize("name", ["bob smith", "ali{ce}", "line\nbreak", "\u0430lice", "x:y", "a" * 129, ""])
def test_principal_names_that_keys_or_people_would_misread_fail_at_start(name: str) -> None:
    """A principal whose name the context store refuses (space, braces: every context call would
    fail) or that looks like another (a Cyrillic 'а' for 'a') is refused by name at start, in
    every place a principal is named."""
    for overrides in ({"gateway": {"api_keys": {name: "key-0123456789"}}},
                      {"limits": {"principals": {name: {"requests_per_s": 5.0}}}},
                      {"proxy": {"allow": {"principals": {name: ["weather"]}}}}):
        with pytest.raises(ConfigError, match="must be 1-128 of A-Z a-z 0-9 _ . @ -"):
            load_config(env={}, overrides=overrides)
    cfg = load_config(env={}, overrides={"gateway": {"api_keys": {"carol@example.com": "key-0123456789",
                                                                  "svc-1_a.b": "key-9876543210"}}})
    assert set(cfg.gateway.api_keys) == {"carol@example.com", "svc-1_a.b"}


@pytest.mark.parametrize("build, key", [
    (lambda: ContextConfig(read_cache_bytes=-1), "read_cache_bytes"),
    (lambda: ContextConfig(max_entry_bytes=10, channel_max_bytes=5), "max_entry_bytes must be <= channel_max_bytes"),
    (lambda: AdminKey("admin-key-123", cast(Any, "root")), "role"),
    (lambda: dataclasses.replace(CompressionConfig(), zstd_level=99), "zstd_level"),
])
def test_sections_validate_however_they_are_built(build: Any, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build()


def test_runtime_overrides_are_validated_and_leave_other_sections_shared() -> None:
    cfg = Config()
    new = apply_overrides(cfg, {"compression": {"density": 0.5}})
    assert new.compression.density == 0.5 and new.gateway is cfg.gateway and cfg.compression.density == 0.25
    for bad, key in (({"compression": {"density": 2}}, "compression.density"),
                     ({"compression": {"dense": 1}}, "compression.dense: unknown key"),
                     ({"compression": {"block_size": 128, "chunk_elements": 64}}, "compression: chunk_elements")):
        with pytest.raises(ConfigError, match=key):
            apply_overrides(cfg, bad)


def test_the_json_schema_describes_what_load_config_accepts() -> None:
    schema = jsonschema_rs.validator_for(config_schema())
    example = yaml.safe_load((ROOT / "learnmesh.example.yaml").read_text())
    assert schema.is_valid(example) and schema.is_valid({})
    for bad in ({"gateway": {"prot": 1}}, {"gateway": {"port": 70000}}, {"trainer": {"comm_hook": "magic"}},
                {"compression": {"density": 0}}):
        assert not schema.is_valid(bad), bad


def test_the_admin_config_patch_publishes_the_runtime_sections_bounds() -> None:
    """The body of PATCH /admin/config is typed from the sections, so OpenAPI (and
    schemathesis) see each field's type and bounds; rules across fields are checked later."""
    from gateway.admin.config import ConfigPatch

    schema = ConfigPatch.model_json_schema()
    density = schema["$defs"]["CompressionConfigPatch"]["properties"]["density"]
    assert density["exclusiveMinimum"] == 0 and density["maximum"] == 1
    assert schema["$defs"]["SchedulingConfigPatch"]["properties"]["priority_mode"]["enum"] == ["magnitude", "layer"]
    patch = ConfigPatch.model_validate({"compression": {"density": 0.5, "zstd_level": 3}})
    assert patch.model_dump(exclude_unset=True, exclude_none=True) == {"compression": {"density": 0.5,
                                                                                       "zstd_level": 3}}
    for bad in ({"compression": {"density": 2}}, {"compression": {"zstd_level": "3"}}, {"gateway": {"port": 1}},
                {"consistency": {"sync_interval": None}}):
        with pytest.raises(pydantic.ValidationError):
            ConfigPatch.model_validate(bad)


def test_an_admin_key_equal_to_an_mcp_key_is_refused_as_the_configuration_loads() -> None:
    """Refused while the configuration loads (one line at start, exit 2), not later inside the
    gateway's startup, where it surfaced as a server traceback."""
    env = {"LEARNMESH_API_KEYS": "alice:shared-key-123", "LEARNMESH_ADMIN_KEY": "shared-key-123"}
    with pytest.raises(ConfigError, match=r"^gateway: admin key\(s\) env equal an MCP client key"):
        load_config(env=env)
    assert load_config(env={**env, "LEARNMESH_ADMIN_KEY": "other-key-123"}).gateway.admin_keys["env"].role == "admin"


@pytest.mark.parametrize("secret", ["", "short-secret"])
def test_oauth_refuses_a_missing_or_short_hs256_key(secret: str) -> None:
    """An empty key would let anyone sign a token for any principal where the JWT library takes
    one; a short one is guessable."""
    with pytest.raises(ConfigError, match="gateway.oauth: enabled needs hs256_secret: at least 32 bytes"):
        load_config(env={}, overrides={"gateway": {"oauth": {"enabled": True, "hs256_secret": secret}}})
    assert load_config(env={}, overrides={"gateway": {"oauth": {"enabled": True, "hs256_secret": "k" * 32,
                                                                 "resource": "https://mesh.example/mcp",
                                                                 "issuer": "https://auth.example"}}})


@pytest.mark.parametrize("key", ["schlüssel-0123456789", " key-0123456789", "key-0123456789 ", "key-0123\t456789",
                                 "key-0123\x00456789"])
def test_a_key_that_no_authorization_header_can_carry_fails_at_start(key: str) -> None:
    """A bearer token is printable ASCII (HTTP clients refuse anything else; the gateway strips
    spaces around it): such a key could never authenticate anyone."""
    with pytest.raises(ConfigError, match="gateway: api_keys: the key of alice cannot be sent") as refused:
        load_config(env={}, overrides={"gateway": {"api_keys": {"alice": key}}})
    assert key.strip() not in str(refused.value)
    with pytest.raises(ConfigError, match="gateway.admin_keys.root: key cannot be sent") as refused:
        load_config(env={}, overrides={"gateway": {"admin_keys": {"root": {"key": key}}}})
    assert key.strip() not in str(refused.value)
    assert load_config(env={}, overrides={"gateway": {"api_keys": {"alice": "a key with spaces~!"}}})


@pytest.mark.parametrize("name", ["ctxglobal-0", "ctxglobal-15", "ctxglobal-x"])
def test_a_principal_cannot_be_named_like_the_global_context_accounting(name: str) -> None:
    """``ctx_lru`` of a principal ``ctxglobal-N`` is the key of shard N of the LRU over all
    principals (shared/keys.py): its context ids would be taken for principals to evict."""
    with pytest.raises(ConfigError, match="gateway: api_keys: principal name.* reserved"):
        load_config(env={}, overrides={"gateway": {"api_keys": {name: "key-0123456789"}}})
    with pytest.raises(ConfigError, match="gateway: api_keys: principal name.* reserved"):
        load_config(env={"LEARNMESH_API_KEYS": f"{name}:key-0123456789"})
    assert load_config(env={}, overrides={"gateway": {"api_keys": {"ctxglobal": "key-0123456789"}}})


@pytest.mark.parametrize("resource", ["", "mesh.example/mcp", "ftp://mesh.example/mcp", "https:///mcp"])
def test_oauth_needs_the_url_of_the_resource_it_protects(resource: str) -> None:
    """Without a resource (and no audience) a token is not checked for whom it was issued: any token
    the authorization server signed for another service would do, and the 401 challenge would point
    at a relative metadata URL."""
    oauth = {"enabled": True, "hs256_secret": "k" * 32, "resource": resource}
    with pytest.raises(ConfigError, match=r"gateway.oauth: enabled needs resource: the http\(s\) URL"):
        load_config(env={}, overrides={"gateway": {"oauth": oauth}})


OAUTH_WITHOUT_ISSUER = "gateway.oauth: enabled needs issuer: the iss of the authorization server whose tokens are accepted"


def test_oauth_needs_the_issuer_whose_tokens_it_accepts(tmp_path: Path) -> None:
    """Without an issuer a token's ``iss`` is not checked: another authorization server holding the
    key (one HS256 key shared by several, a staging server) could issue tokens this gateway takes.
    The gateway refuses to start, one line naming the key, before it reaches Redis."""
    oauth = {"enabled": True, "hs256_secret": "k" * 32, "resource": "https://mesh.example/mcp"}
    with pytest.raises(ConfigError, match=OAUTH_WITHOUT_ISSUER):
        load_config(env={}, overrides={"gateway": {"oauth": oauth}})
    path = tmp_path / "learnmesh.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"oauth": oauth}}))
    done = _cli(tmp_path, "--config", str(path), "gateway", "--port", str(free_port()),
                env={"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"learnmesh: configuration error: {OAUTH_WITHOUT_ISSUER}"]


@pytest.mark.parametrize(("field", "value"), [
    ("timeout_s", ".inf"), ("timeout_s", ".nan"), ("timeout_s", "1.0e+12"), ("concurrency", "100000000000000000000000000"),
])
def test_an_upstream_with_an_endless_or_absurd_number_fails_at_start(tmp_path: Path, field: str, value: str) -> None:
    path = tmp_path / "learnmesh.yaml"
    path.write_text(f"proxy:\n  upstreams:\n    - name: up\n      url: http://127.0.0.1:9000/mcp\n      {field}: {value}\n")
    with pytest.raises(ConfigError, match=f"proxy.upstreams.0.{field}"):
        load_config(path, env={})


def _cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``learnmesh ARGS`` as an operator runs it, with no learnmesh variables but ``env``'s."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEARNMESH_") and k != "REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**clean, "LEARNMESH_VAR": str(tmp_path / "var"), **(env or {})}, timeout=60)


@pytest.mark.parametrize("content, message", [
    (b"gateway:\n  port: \xff\xfe\n", "config file {path} is not UTF-8 text (byte 17)"),
    (None, "config file {path} is not a regular file"),  # a directory
    (b"? [a, b]\n: 1\n", "config file {path} is not valid YAML: while constructing a mapping"),
    (b"1: 2\n", "1: Keys should be strings"),  # the key the file wrote, not the section in that place
])
def test_a_config_file_that_cannot_be_read_or_parsed_is_one_line_naming_it(tmp_path: Path, content: bytes | None,
                                                                           message: str) -> None:
    path = tmp_path / "learnmesh.yaml"
    path.mkdir() if content is None else path.write_bytes(content)
    done = _cli(tmp_path, "--config", str(path), "keys")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("learnmesh: configuration error: " + message.format(path=path)), done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "var").exists()


@pytest.mark.parametrize("url, message", [
    ("127.0.0.1:6390", "url must start with redis://, rediss://, unix://, redis+cluster://, rediss+cluster://"),
    ("redis://:hunter2-secret@127.0.0.1:63x0/0", "url's port must be a number in 1-65535"),
    ("redis://:hunter2-secret@127.0.0.1:99999/0", "url's port must be a number in 1-65535"),
    ("redis://:hunter2-secret@127.0.0.1:6390/one", "url's database (its path) must be a number"),  # else database 0
])
def test_a_redis_url_that_redis_py_refuses_or_misreads_fails_as_the_configuration_loads(tmp_path: Path, url: str,
                                                                                       message: str) -> None:
    """Refused with the setting named, the password never repeated, before any process starts
    (not a ValueError traceback from inside redis-py as the first connection is made)."""
    done = _cli(tmp_path, "keys", env={"REDIS_URL": url})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"learnmesh: configuration error: redis: {message}"]


@pytest.mark.parametrize("url", ["redis://127.0.0.1", "rediss://u:p@[::1]:6390/3", "redis+cluster://:p@10.0.0.1:7000",
                                 "rediss+cluster://node:7000/0", "unix:///run/redis.sock?db=2"])
def test_every_redis_url_form_redis_py_takes_loads(url: str) -> None:
    assert load_config(env={"REDIS_URL": url}).redis.url == url


@pytest.mark.parametrize("text", [
    "worker:\n  endpoints: []\n",  # workers run elsewhere and join through Redis
    "worker:\n  endpoints: ['tcp://10.0.0.5:5601', 'tcp://[::1]:5602', 'tcp://worker-1.mesh.svc:5603',"
    " 'ipc:///run/learnmesh/w0', 'tcp://*:5604']\n",
    "worker:\n  advertise: 'tcp://{ip}:{port}'\n",
    "worker:\n  advertise: 'tcp://{host}.workers.mesh.svc:5601'\n",
    "zmq:\n  bind_host: '0.0.0.0'\n",
    "zmq:\n  bind_host: '::'\n",
    "zmq:\n  bind_host: '*'\n",
    "trainer:\n  samples_endpoint: 'tcp://trainer-0.trainer:5611'\n",
])
def test_every_endpoint_form_zeromq_binds_or_connects_to_loads(tmp_path: Path, text: str) -> None:
    path = tmp_path / "learnmesh.yaml"
    path.write_text(text)
    load_config(path, env={})


@pytest.mark.parametrize("endpoint", ["garbage", "tcp://127.0.0.1:99999", "tcp://127.0.0.1"])
def test_a_worker_endpoint_on_the_command_line_is_checked_before_the_worker_starts(tmp_path: Path,
                                                                                  endpoint: str) -> None:
    """libzmq takes port 99999 as another port, and a malformed endpoint ended in a traceback."""
    done = _cli(tmp_path, "worker", "--endpoint", endpoint)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"argument --endpoint: {endpoint!r} is not a ZeroMQ endpoint" in done.stderr
