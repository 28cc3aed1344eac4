"""The turn's state has one type (`TurnState`): every field the machinery names is in it,
and every entry says what it holds."""

from __future__ import annotations

import ast
import inspect

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, WATCHERS_FIELD
from agentq.state import turn_state
from agentq.state.turn_state import TurnState


def test_the_machinerys_fields_are_fields_of_the_state() -> None:
    named = {*k.BOOKKEEPING_FIELDS, k.CANCEL_FIELD, k.CHILDREN_FIELD, WATCHERS_FIELD, SEQ_FIELD}
    assert named <= TurnState.__annotations__.keys(), named - TurnState.__annotations__.keys()


def test_every_field_says_what_it_holds() -> None:
    tree = ast.parse(inspect.getsource(turn_state))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TurnState")
    body = cls.body
    undocumented = [
        node.target.id
        for i, node in enumerate(body)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if not (
            i + 1 < len(body)
            and isinstance(body[i + 1], ast.Expr)
            and isinstance(body[i + 1].value, ast.Constant)
            and isinstance(body[i + 1].value.value, str)
        )
    ]
    assert not undocumented, (
        f"TurnState fields without a line saying what they hold: {undocumented}"
    )
