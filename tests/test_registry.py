"""Tool schemas are compiled once, at registration, and explain a refusal by field and reason."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.registry import Registry, Tool
from gateway.tools.learning import LEARN_INPUT_SCHEMA

APPEND_LIKE = {
    "type": "object",
    "properties": {"context_id": {"type": "string", "minLength": 1},
                   "links": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["context_id"],
    "additionalProperties": False,
}


async def _noop(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {}


def _tool(input_schema: dict[str, Any], output_schema: dict[str, Any] | None = None) -> Tool:
    return Tool("t", "a tool", input_schema, _noop, output_schema)


def test_input_problems_name_the_field_and_the_reason() -> None:
    tool = _tool(APPEND_LIKE)
    assert tool.input_problem({"context_id": "c", "links": ["a"]}) is None
    assert tool.input_problem({}) == '"context_id" is a required property'
    assert tool.input_problem({"context_id": ""}) == '"" is shorter than 1 character (at context_id)'
    assert tool.input_problem({"context_id": "c", "links": ["a", 3]}) == '3 is not of type "string" (at links/1)'
    assert "'extra' was unexpected" in (tool.input_problem({"context_id": "c", "extra": 1}) or "")


def test_output_is_checked_against_the_output_schema() -> None:
    tool = _tool(APPEND_LIKE, {"type": "object", "properties": {"version": {"type": "integer"}},
                               "required": ["version"]})
    assert tool.output_matches({"version": 3})
    assert not tool.output_matches({"version": "3"})
    assert _tool(APPEND_LIKE).output_matches("anything: no outputSchema")


def test_a_broken_schema_fails_at_registration_not_on_the_first_call() -> None:
    registry = Registry()
    with pytest.raises(ValueError):
        registry.tool("bad", description="", input_schema={"type": "object", "minProperties": -1})(_noop)
    assert "bad" not in registry.tools


@pytest.mark.parametrize("args, problem", [
    ({"input": "q", "target": ""}, '"" is shorter than 1 character (at target)'),
    ({"samples": [{"input": "q", "target": "a"}, {"input": 5, "target": "a"}]},
     '5 is not of type "string" (at samples/1/input)'),
    ({"kind": "feedback", "generation_id": "g", "input": "q", "preference": "meh"},
     '"meh" is not one of "down" or "up" (at preference)'),
    ({"kind": "feedback", "generation_id": "g", "input": "q", "target": "a"},
     "Additional properties are not allowed ('target' was unexpected)"),
])
def test_a_union_schema_reports_the_alternative_the_arguments_came_closest_to(args: dict[str, Any],
                                                                              problem: str) -> None:
    """Not "matches none of the alternatives": the error inside the closest one."""
    assert _tool(LEARN_INPUT_SCHEMA).input_problem(args) == problem


def test_a_tool_whose_x_mcp_header_declarations_break_sep_2243_fails_at_registration() -> None:
    """The rules the proxy applies to an upstream's tools (gateway/mcp/param_headers.py) hold for
    the gateway's own: a tool MCP has a client leave out is not served."""
    text = {"type": "string"}
    for bad in ({"a": {**text, "x-mcp-header": "Region Name"}},
                {"a": {**text, "x-mcp-header": "R"}, "b": {**text, "x-mcp-header": "r"}},
                {"a": {"type": "object", "x-mcp-header": "Obj"}}):
        with pytest.raises(ValueError, match="x-mcp-header"):
            _tool({"type": "object", "properties": bad})
    nested = {"where": {"type": "object", "properties": {"zone": {"type": "integer", "x-mcp-header": "Zone"}}}}
    assert _tool({"type": "object", "properties": nested}).param_spec == ((("where", "zone"), "mcp-param-zone"),)
