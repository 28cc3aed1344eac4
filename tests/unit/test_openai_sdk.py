"""The openai SDK members agentq.llm.sdk reaches into are there, with the parameters it
passes: an SDK that changed them fails here, not silently in a stream worker."""

from __future__ import annotations

import openai
import pytest

from agentq.errors import IncompatibleDependency
from agentq.llm import sdk


def test_the_installed_sdk_has_every_member_reached() -> None:
    sdk.check_sdk()


def test_a_client_class_without_a_reached_member_fails_loudly() -> None:
    class Renamed:
        async def _prepare_options(self, options: object) -> object:
            return options

        def _make_status_error_from_response(self, response: object) -> None:
            return None

    with pytest.raises(IncompatibleDependency, match=r"AsyncOpenAI\._build_request is gone"):
        sdk.check_sdk(Renamed)


def test_a_re_signed_member_fails_loudly() -> None:
    class Resigned:
        async def _prepare_options(self, options: object) -> object:
            return options

        def _build_request(self, opts: object, *, retries_taken: int = 0) -> None:
            return None

        def _make_status_error_from_response(self, response: object) -> None:
            return None

    with pytest.raises(IncompatibleDependency, match="_build_request"):
        sdk.check_sdk(Resigned)


def test_an_sdk_without_its_request_options_class_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Client(openai.AsyncOpenAI):  # a class of its own: check_sdk caches per class
        pass

    monkeypatch.delattr(openai._models, "FinalRequestOptions")
    with pytest.raises(IncompatibleDependency, match=r"FinalRequestOptions\.construct is gone"):
        sdk.check_sdk(Client)
