"""The pure parts of agentq.mcp: configuration, names, policy, argument checks, backoff."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from mcp.types import EmbeddedResource, ImageContent, TextContent, TextResourceContents

from agentq.agents import Agent, check_agents, unregister_agent
from agentq.errors import AgentDefinitionError, ConfigError, ToolArgumentsInvalid
from agentq.mcp import catalog
from agentq.mcp.catalog import McpTools
from agentq.mcp.link import BACKOFF_S, ServerLink, backoff_s
from agentq.mcp.listing import (
    FUNCTION_NAME,
    MAX_NAME,
    ListedTool,
    Listing,
    Refused,
    plan,
    tool_name,
)
from agentq.mcp.servers import parse_servers
from agentq.mcp.tools import approval_of, content_text, make_spec
from agentq.tools import registry


def servers(**spec: Any) -> str:
    return json.dumps(spec)


def test_a_name_that_is_a_function_name_is_kept_hyphens_too() -> None:
    assert tool_name("github", "create_issue") == "github__create_issue"
    assert tool_name("everything", "get-annotated-message") == "everything__get-annotated-message"


def test_any_other_name_becomes_a_function_name_ending_in_a_hash_of_it() -> None:
    dotted = tool_name("fs", "read.file/v2")
    assert dotted.startswith("fs__read_file_v2_") and len(dotted) == len("fs__read_file_v2_") + 8
    # The name that `_` makes of a dotted one is taken by neither.
    assert tool_name("fs", "read_file_v2") == "fs__read_file_v2" != dotted
    a, b = tool_name("s", "x" * 80), tool_name("s", "x" * 79 + "y")
    assert len(a) == len(b) == MAX_NAME and a != b
    for tool in ["", " ", "é", "a b", "\n", "\ud800", "x" * 5000, "名前", "a.b.c", "tool()"]:
        name = tool_name("srv", tool)
        assert FUNCTION_NAME.match(name), (tool, name)
        assert tool_name("srv", tool) == name


def test_the_mapping_reverses_and_refuses_names_two_tools_share() -> None:
    def listing(*names: str) -> Listing:
        return Listing(listed_at=0.0, tools=[listed(n) for n in names])

    listings = {"a": listing("x.y", "x_y", "b__c"), "b": listing("get-sum"), "a__b": listing("c")}
    made = plan({}, listings)
    assert {name: (s, t.name) for name, (s, t) in made.offered.items()} == {
        tool_name("a", "x.y"): ("a", "x.y"),
        "a__x_y": ("a", "x_y"),
        "b__get-sum": ("b", "get-sum"),
    }
    assert made.collisions == {
        "a": [Refused(tool="b__c", why="its name a__b__c is also the name of a__b/c")],
        "a__b": [Refused(tool="c", why="its name a__b__c is also the name of a/b__c")],
    }


def test_a_bad_setting_names_the_setting_and_the_server() -> None:
    assert parse_servers(None) == {} and parse_servers(" ") == {}
    for raw, words in [
        ("[", "not JSON"),
        ("[]", "JSON object"),
        (servers(gh={}), "either `command`"),
        (servers(gh={"command": ["x"], "url": "http://h/mcp"}), "either `command`"),
        (servers(gh={"url": "ftp://h"}), "http"),
        (servers(gh={"command": ["x"], "headers": {"A": "b"}}), "`headers`"),
        (servers(gh={"command": ["x"], "concurrency": 0}), "at least 1"),
        (servers(gh={"command": ["x"], "approval": "maybe"}), "approval"),
        (servers(gh={"command": ["x"], "colour": "red"}), "colour"),
        (servers(**{"bad name": {"command": ["x"]}}), "bad name"),
    ]:
        with pytest.raises(ConfigError) as caught:
            parse_servers(raw)
        assert caught.value.setting == "AGENTQ_MCP_SERVERS"
        assert words in caught.value.message, caught.value.message


def test_header_values_name_environment_variables_never_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (server,) = parse_servers(
        servers(gh={"url": "https://h/mcp", "headers": {"Authorization": "Bearer ${GH_TOKEN}"}})
    ).values()
    monkeypatch.delenv("GH_TOKEN", raising=False)
    with pytest.raises(ConfigError) as caught:
        server.resolved_headers()
    assert "GH_TOKEN" in caught.value.message
    monkeypatch.setenv("GH_TOKEN", "s3cret")
    assert server.resolved_headers() == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(server) and "Bearer" not in repr(server)


def listed(name: str = "t", **kw: Any) -> ListedTool:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
    }
    return ListedTool(name=name, description="A tool.", input_schema=schema, **kw)


def test_approval_by_annotations_trusts_read_only_only_when_told() -> None:
    base = {"command": ["x"], "approval": "annotations"}
    untrusted = parse_servers(servers(s=base))["s"]
    trusted = parse_servers(servers(s={**base, "trust_annotations": True}))["s"]
    assert approval_of(untrusted, listed(read_only=True)) == "ask"
    assert approval_of(trusted, listed(read_only=True)) == "auto"
    assert approval_of(trusted, listed(read_only=None)) == "ask"
    plain = parse_servers(servers(s={"command": ["x"], "approval": "deny"}))["s"]
    assert approval_of(plain, listed(read_only=True)) == "deny"


def test_a_spec_checks_arguments_by_schema_and_carries_the_policy() -> None:
    server = parse_servers(
        servers(s={"command": ["x"], "timeout_s": 7, "budget_s": 2, "concurrency": "exclusive"})
    )["s"]
    spec = make_spec(ServerLink(server), listed("count-things"))
    assert spec.name == "s__count-things" and spec.mcp_server == "s"
    assert spec.task_name == "agentq.tool.s__count-things" and spec.kind == "async"
    assert spec.openai_schema()["function"]["parameters"]["required"] == ["n"]
    pol = spec.policy
    assert (pol.timeout_s, pol.budget_s, pol.concurrency, pol.queue) == (
        7,
        2,
        "exclusive",
        "agentq.io",
    )
    assert spec.validate({"n": 3}).model_dump() == {"n": 3}
    with pytest.raises(ToolArgumentsInvalid) as caught:
        spec.validate({"n": "three"})
    assert "n: 'three' is not of type 'integer'" in caught.value.message
    with pytest.raises(ToolArgumentsInvalid):
        spec.validate({})


def test_backoff_grows_and_stops_growing() -> None:
    assert backoff_s(0) == backoff_s(1) == 0.0
    waits = [backoff_s(n) for n in range(1, 12)]
    assert waits == sorted(waits) and waits[-1] == BACKOFF_S[-1]


def test_content_text_keeps_text_and_names_the_rest() -> None:
    blocks = [
        TextContent(type="text", text="hello"),
        ImageContent(type="image", data="aGk=", mime_type="image/png"),
        EmbeddedResource(
            type="resource",
            resource=TextResourceContents(uri="file:///a", text="inside", mime_type="text/plain"),
        ),
    ]
    assert content_text(blocks) == "hello\n[image content, image/png]\ninside"


@pytest.fixture()
def mcp_tools() -> Iterator[McpTools]:
    cfg = parse_servers(servers(gh={"command": ["x"], "tools": ["a", "b"]}, fs={"command": ["y"]}))
    tools = McpTools(cfg, 300.0, lambda: None)
    yield tools
    for n in tools.registered:
        registry.unregister(n)


def test_a_listing_replaces_the_server_s_tools_within_its_allowlist(mcp_tools: McpTools) -> None:
    added = mcp_tools.apply(
        "gh", Listing(listed_at=1.0, tools=[listed("a"), listed("b"), listed("c")])
    )
    assert sorted(s.name for s in added) == ["gh__a", "gh__b"]
    assert "gh__c" not in registry.all_tools()
    added = mcp_tools.apply("gh", Listing(listed_at=2.0, tools=[listed("b")]))
    assert added == [] and "gh__a" not in registry.all_tools() and "gh__b" in registry.all_tools()


def test_a_tool_whose_spec_cannot_be_made_costs_only_itself(
    mcp_tools: McpTools, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = catalog.make_spec

    def flaky(link: Any, tool: ListedTool) -> Any:
        if tool.name == "b":
            raise ValueError("no spec")
        return real(link, tool)

    monkeypatch.setattr(catalog, "make_spec", flaky)
    added = mcp_tools.apply("fs", Listing(listed_at=1.0, tools=[listed("a"), listed("b")]))
    assert [s.name for s in added] == ["fs__a"] and "fs__b" not in registry.all_tools()


def test_agents_name_the_servers_their_turns_may_use(mcp_tools: McpTools) -> None:
    mcp_tools.apply("gh", Listing(listed_at=1.0, tools=[listed("a")]))
    mcp_tools.apply("fs", Listing(listed_at=1.0, tools=[listed("read")]))
    every = Agent(name="mcp_every", mcp_servers=["gh", "fs"])
    only_fs = Agent(name="mcp_only_fs", tools=[], mcp_servers=["fs"])
    one = Agent(name="mcp_one", tools=["gh__a"])
    try:
        assert {"gh__a", "fs__read"} <= set(every.tool_names())
        assert only_fs.tool_names() == ["fs__read"]
        assert one.tool_names() == ["gh__a"]
        check_agents(servers(gh={}, fs={}))
        with pytest.raises(AgentDefinitionError) as caught:
            check_agents(servers(gh={}))
        assert "fs" in caught.value.message and "mcp_servers" in caught.value.message
    finally:
        for name in ("mcp_every", "mcp_only_fs", "mcp_one"):
            unregister_agent(name)


def test_a_process_that_holds_no_sessions_only_reads_the_shared_listings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Turn and stream workers never list a server: they take what the I/O workers share,
    at every registry read while a server has none, then every POLL_S."""
    import time

    import fakeredis

    from agentq import constants as k

    redis = fakeredis.FakeRedis()
    # A server that could never start: a process that tried to list it would say so.
    tools = McpTools(parse_servers(servers(gh={"command": ["/nonexistent"]})), 1.0, lambda: redis)
    monkeypatch.setattr(catalog, "POLL_S", 3600.0)
    try:
        tools.refresh()
        assert tools.registered == {} and redis.hget(k.MCP_TOOLS, "gh") is None
        redis.hset(
            k.MCP_TOOLS, "gh", Listing(listed_at=time.time(), tools=[listed("a")]).model_dump_json()
        )
        tools.refresh()  # gh had none: looked for at once
        assert tools.registered == {"gh__a": "gh"}
        redis.hset(
            k.MCP_TOOLS,
            "gh",
            Listing(listed_at=time.time() + 1, tools=[listed("b")]).model_dump_json(),
        )
        tools.refresh()  # gh has one: not before POLL_S
        assert tools.registered == {"gh__a": "gh"}
        monkeypatch.setattr(catalog, "POLL_S", 0.0)
        tools.refresh()
        assert tools.registered == {"gh__b": "gh"}
        # Past its TTL the listing still serves: listing again is the I/O workers' work.
        time.sleep(1.1)
        tools.refresh()
        assert tools.registered == {"gh__b": "gh"}
        assert Listing.model_validate_json(redis.hget(k.MCP_TOOLS, "gh")).tools[0].name == "b"
    finally:
        for n in tools.registered:
            registry.unregister(n)


def test_a_listing_refuses_each_bad_tool_with_its_reason_and_keeps_the_rest() -> None:
    good = listed("fine")
    bad = [
        listed(""),
        listed("x" * 300),
        ListedTool(name="not_schema", description="d", input_schema={"type": 5}),
        ListedTool(name="a_string", description="d", input_schema={"type": "string"}),
        ListedTool(
            name="huge",
            description="d",
            input_schema={"type": "object", "description": "x" * 70_000},
        ),
        listed("twice"),
        listed("twice"),
    ]
    listing = Listing.screened(1.0, [good, *bad])
    assert [t.name for t in listing.tools] == ["fine"]
    why = {r.tool: r.why for r in listing.refused}
    assert why[""] == "it has no name"
    assert "300 characters long" in why["x" * 80 + "... (300 characters)"]
    assert "not JSON Schema" in why["not_schema"]
    assert "of type string, not object" in why["a_string"]
    assert "bytes long" in why["huge"]
    assert why["twice"] == "listed 2 times" and len(listing.refused) == 6
    assert Listing.model_validate_json(listing.model_dump_json()) == listing


def test_a_huge_description_is_cut_saying_so() -> None:
    from agentq.mcp.listing import MAX_DESCRIPTION, cut_description

    cut = cut_description("d" * 10_000_000)
    assert len(cut) < MAX_DESCRIPTION + 60 and cut.endswith("[cut: 9995904 characters more]")


def test_tools_of_two_servers_that_share_a_model_name_are_both_refused(
    mcp_tools: McpTools, caplog: pytest.LogCaptureFixture
) -> None:
    """Names made with a hash do not collide; a server name holding `__` can: the tool
    x__y of gh and the tool y of gh__x are both gh__x__y."""
    cfg = parse_servers(servers(gh={"command": ["x"]}, gh__x={"command": ["y"]}))
    tools = McpTools(cfg, 300.0, lambda: None)
    try:
        tools.apply("gh", Listing(listed_at=1.0, tools=[listed("x__y"), listed("ok")]))
        assert "gh__x__y" in registry.all_tools()
        with caplog.at_level("WARNING", logger="agentq.mcp"):
            tools.apply("gh__x", Listing(listed_at=1.0, tools=[listed("y"), listed("z")]))
            tools.apply("gh__x", Listing(listed_at=2.0, tools=[listed("y"), listed("z")]))
        names = set(registry.all_tools())
        assert "gh__x__y" not in names and {"gh__ok", "gh__x__z"} <= names
        lines = [r.getMessage() for r in caplog.records if "gh__x__y" in r.getMessage()]
        assert len(lines) == 2, lines  # one per tool, once each
        assert "is also the name of gh__x/y" in " ".join(lines)
        made = plan(cfg, tools.listings)
        assert made.collisions["gh"] == [
            Refused(tool="x__y", why="its name gh__x__y is also the name of gh__x/y")
        ]
        # The other goes: the name is free again, and the first server's tool is back.
        tools.apply("gh__x", Listing(listed_at=3.0, tools=[listed("z")]))
        assert "gh__x__y" in registry.all_tools()
    finally:
        for n in tools.registered:
            registry.unregister(n)


def test_a_celery_task_is_made_for_any_tool_name_a_server_gives() -> None:
    from celery import Celery

    from agentq.tools.task import register_tool_tasks

    server = parse_servers(servers(everything={"command": ["x"]}))["everything"]
    names = ["get-annotated-message", "a.b", "tool()", "déjà vu", "class", "x" * 200]
    specs = {s.name: s for s in (make_spec(ServerLink(server), listed(n)) for n in names)}
    app = Celery("names", set_as_current=False)
    register_tool_tasks(app, specs)
    for spec in specs.values():
        assert app.tasks[spec.task_name].name == spec.task_name
    assert "agentq.tool.everything__get-annotated-message" in app.tasks
