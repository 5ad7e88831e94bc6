"""The user documentation names what the product has: every admin route, metric, config key,
environment variable, CLI flag and make target the docs give exists, and the lists the docs
present as complete (the admin routes, the metrics, a section's configuration keys) are."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import prometheus_client
import pydantic
import pytest

import shared.metrics  # noqa: F401 - registers every metric family
from shared.config import Config, ContextConfig, GatewayConfig, PrincipalLimits

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def _all_docs() -> str:
    return "\n".join(path.read_text() for path in DOCS)


def _section(text: str, heading: str) -> str:
    """The part of a Markdown document under ``heading``, up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n")
    end = re.compile("^#{1," + str(level) + "} ", re.M).search(text, start + len(heading))
    return text[start:end.start() if end else len(text)]


def _first_column(table: str) -> set[str]:
    """The backticked names in the first column of a Markdown table's rows."""
    names: set[str] = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return names


def _route(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def test_the_admin_table_lists_every_admin_route_and_no_other() -> None:
    from gateway.app import create_app

    spec = create_app(Config()).openapi()
    served = {(method.upper(), _route(path)) for path, ops in spec["paths"].items() if path.startswith("/admin")
              for method in ops}
    table = _section(_text("docs/operations.md"), "## Admin API")
    documented = {(m.group(1), _route(m.group(2)))
                  for m in re.finditer("`(" + "|".join(METHODS) + r") (/admin[^\s`\[?]*)", table)}
    assert sorted(served - documented) == [], "admin routes docs/operations.md does not list"
    assert sorted(documented - served) == [], "routes docs/operations.md lists that the gateway does not serve"


def _metric_families() -> dict[str, str]:
    """Family name as scraped (counters with ``_total``) -> type, of every learnmesh metric."""
    families = {}
    for collector in list(prometheus_client.REGISTRY._collector_to_names):
        for family in getattr(collector, "describe", collector.collect)():
            if family.name.startswith("learnmesh_"):
                families[family.name + ("_total" if family.type == "counter" else "")] = family.type
    return families


def test_every_metric_is_in_the_operations_guide_and_every_metric_named_exists() -> None:
    families = _metric_families()
    assert len(families) > 40
    guide = _text("docs/operations.md")
    assert sorted(name for name in families if f"`{name}`" not in guide) == [], \
        "metrics docs/operations.md does not name (in full, backticked)"
    scraped = set(families) | {f"{name}{suffix}" for name, kind in families.items() if kind == "histogram"
                               for suffix in ("_bucket", "_count", "_sum")}
    for path in DOCS:
        named = set(re.findall(r"\blearnmesh_[a-z0-9_]*[a-z0-9]\b", path.read_text()))
        assert sorted(named - scraped) == [], f"{path.relative_to(ROOT)} names metrics no process exports"


@pytest.mark.parametrize("doc, heading, section", [
    ("docs/gateway.md", "## `gateway:` configuration keys", GatewayConfig),
    ("docs/context.md", "## Config keys (`context:` section)", ContextConfig),
    ("docs/operations.md", "### Quotas, rate limits and who may teach", PrincipalLimits),
])
def test_a_section_table_lists_every_key_of_its_section(doc: str, heading: str, section: Any) -> None:
    documented = _first_column(_section(_text(doc), heading))
    fields = set(pydantic.TypeAdapter(section).json_schema()["properties"])
    assert sorted(fields - documented) == [], f"keys the table in {doc} lacks"
    assert sorted(documented - fields) == [], f"keys the table in {doc} names that the section does not have"


def test_the_readme_configuration_table_has_every_section() -> None:
    table = _section(_text("README.md"), "## Configuration")
    documented = {name for line in table.splitlines() if line.startswith("| `")
                  for name in re.findall(r"`([a-z_]+)`", line.split("|")[1])}
    assert documented == set(Config.__dataclass_fields__)


# Dotted names that look like a config key but are something else: key files of the ZeroMQ roles,
# file names, an audit action, Lua and Python calls, a JSON path.
_NOT_KEYS = re.compile(r"\.(key|key_secret|log|yaml|py|conf)$|^(redis\.call|zmq\.auth|trainer\.pause|model\.encode|"
                       r"context\.arguments\.context_id)$")


def _is_key(dotted: str, defaults: dict[str, Any]) -> bool:
    node: Any = defaults
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif (isinstance(node, dict) and not node and i > 1) or parts[:i] == ["proxy", "upstreams"]:
            return True  # a name in a map (limits.roles.<role>) or a field of an upstream's entry
        else:
            return False
    return True


def test_every_dotted_config_key_the_docs_name_exists() -> None:
    defaults = pydantic.TypeAdapter(Config).dump_python(Config(), mode="json")
    pattern = re.compile("`((?:" + "|".join(defaults) + r")\.[a-z_][a-z0-9_.]*[a-z0-9_])[`:\s(\[=]")
    unknown = [f"{path.relative_to(ROOT)}: {m.group(1)}" for path in DOCS for m in pattern.finditer(path.read_text())
               if not _NOT_KEYS.search(m.group(1)) and not _is_key(m.group(1), defaults)]
    assert unknown == []


def test_every_environment_variable_the_docs_name_is_read() -> None:
    """A ``LEARNMESH_<SECTION>__<KEY>`` names a real key; any other ``LEARNMESH_*`` is read by
    the code, the compose files, the Makefile or the tests."""
    defaults = pydantic.TypeAdapter(Config).dump_python(Config(), mode="json")
    sources = "\n".join(path.read_text() for folder in ("gateway", "services", "shared", "examples", "tests",
                                                         "compose", "deploy", "bench", "scripts")
                        for path in (ROOT / folder).rglob("*") if path.is_file() and path.suffix in
                        (".py", ".yml", ".yaml", ".sh", ".env", "")) + _text("Makefile")
    for path in DOCS:
        for name in sorted(set(re.findall(r"\bLEARNMESH_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))):
            rest = name.removeprefix("LEARNMESH_")
            if "__" in rest:
                assert _is_key(rest.lower().replace("__", "."), defaults), f"{path.relative_to(ROOT)}: {name}"
            else:
                assert re.search(rf"\b{name}\b", sources), f"{path.relative_to(ROOT)}: {name} is read nowhere"


def _subcommands() -> dict[str, set[str]]:
    """Subcommand -> its option strings (the global ``--config`` in each)."""
    from services.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings} | {"--config"}
            for name, p in sub.choices.items()}


def test_every_learnmesh_command_line_in_the_docs_parses_and_every_flag_is_documented() -> None:
    commands = _subcommands()
    text = " ".join(_all_docs().replace("\\\n", " ").split())
    used: dict[str, set[str]] = {name: set() for name in commands}
    line = re.compile(r"\b(?:learnmesh|services\.cli)((?: --config \S+)?) (" + "|".join(map(re.escape, commands))
                      + r")\b([^`|;\n]*)")
    for m in line.finditer(text):
        flags = set(re.findall(r"(?<!\S)(--?[a-z][a-z-]*)", m.group(3).split(" # ")[0].split(" (")[0]))
        unknown = flags - commands[m.group(2)]
        assert not unknown, f"`{m.group(0)}`: {sorted(unknown)} not options of learnmesh {m.group(2)}"
        used[m.group(2)] |= flags
    undocumented = {name: sorted(opts - used[name] - {"-h", "--help", "--config"})
                    for name, opts in commands.items()}
    assert {name: opts for name, opts in undocumented.items() if opts} == {}


def test_every_make_target_the_docs_name_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", _text("Makefile"), re.M))
    named = set(re.findall(r"`make ([a-z][a-z-]*)", _all_docs()))
    assert sorted(named - targets) == []


def test_the_upstream_examples_show_every_field_of_an_upstream() -> None:
    """An upstream's entry is a list item, so test_example_file_lists_every_default cannot see
    its fields: learnmesh.example.yaml shows them commented out, docs/gateway.md in its example."""
    from shared.config import UpstreamConfig

    fields = set(pydantic.TypeAdapter(UpstreamConfig).json_schema()["properties"])
    example = _text("learnmesh.example.yaml")
    commented = "\n".join(line for line in example[example.index("\nproxy:"):].splitlines() if "#" in line)
    guide = _section(_text("docs/gateway.md"), "### Configuration")
    for name, text in (("learnmesh.example.yaml", commented), ("docs/gateway.md", guide)):
        assert sorted(f for f in fields if not re.search(rf"\b{f}:", text)) == [], f"upstream fields {name} lacks"


def test_every_json_rpc_error_code_the_gateway_answers_is_documented() -> None:
    from gateway import errors

    sources = "\n".join(path.read_text() for path in (ROOT / "gateway").rglob("*.py"))
    codes = {name: value for name, value in vars(errors).items()
             if name.isupper() and isinstance(value, int) and -32999 <= value <= -32000
             and len(re.findall(rf"\b{name}\b", sources)) > 1}  # used beyond its definition
    assert len(codes) > 12
    guide = _text("docs/gateway.md") + _text("docs/operations.md")
    assert sorted(name for name, code in codes.items() if str(code) not in guide) == []


def test_every_config_key_is_named_in_the_docs() -> None:
    """Beside learnmesh.example.yaml, which only lists them: each key dotted (``worker.hwm``),
    backticked alone where its section is the subject (a table's row), or in a YAML example."""
    defaults = pydantic.TypeAdapter(Config).dump_python(Config(), mode="json")
    text = _all_docs()
    missing = [f"{section}.{key}" for section, keys in defaults.items() for key in keys
               if f"{section}.{key}" not in text and f"`{key}`" not in text
               and not re.search(rf"^\s*{key}:", text, re.M)]
    assert missing == []
