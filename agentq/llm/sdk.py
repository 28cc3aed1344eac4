"""The one module that reaches into the openai SDK's private members: each request is
built once per client and path, not per round (that cost a tenth of a busy stream worker's
CPU, and the SDK cannot build a request without sending it). `check_sdk` checks `REACHED`
at a stream worker's first client and in tests, so a renamed member fails loudly."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from typing import Any

import httpx2
import openai

from agentq.errors import IncompatibleDependency

REACHED: dict[str, tuple[str, ...]] = {
    "AsyncOpenAI._prepare_options": ("self", "options"),
    "AsyncOpenAI._build_request": ("self", "options"),
    "AsyncOpenAI._make_status_error_from_response": ("self", "response"),
    "FinalRequestOptions.construct": (),
}
"""The private members of the SDK agentq calls (`FinalRequestOptions` is in `openai._models`),
and the leading parameters it passes them; besides, `AsyncOpenAI._client` (its HTTP client)."""


@functools.cache  # once per process (and class): a stream worker makes several clients
def check_sdk(client_class: type[Any] = openai.AsyncOpenAI) -> None:
    """Raise IncompatibleDependency unless the SDK has every member agentq reaches."""
    options = getattr(getattr(openai, "_models", None), "FinalRequestOptions", None)
    owners = {"AsyncOpenAI": client_class, "FinalRequestOptions": options}
    for where, params in REACHED.items():
        owner, name = where.split(".")
        member = getattr(owners[owner], name, None)
        if member is None:
            raise IncompatibleDependency("openai", openai.__version__, f"{where} is gone")
        got = tuple(inspect.signature(member).parameters)[: len(params)]
        if got != params:
            raise IncompatibleDependency(
                "openai", openai.__version__, f"{where}{got} is not {name}{params}"
            )


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A client's request to one path as the SDK builds it: URL, auth and headers."""

    url: httpx2.URL
    headers: list[tuple[str, str]]


_endpoints: weakref.WeakKeyDictionary[openai.AsyncOpenAI, dict[str, Endpoint]] = (
    weakref.WeakKeyDictionary()
)


async def endpoint(client: openai.AsyncOpenAI, path: str) -> Endpoint:
    """The POST to `path` as the SDK builds it, once per client (its key is static)."""
    from openai._models import FinalRequestOptions

    paths = _endpoints.setdefault(client, {})
    found = paths.get(path)
    if found is None:
        options = FinalRequestOptions.construct(method="post", url=path)
        built = client._build_request(await client._prepare_options(options))
        headers = [(k, v) for k, v in built.headers.multi_items() if k != "content-length"]
        found = paths[path] = Endpoint(built.url, headers)
    return found


async def send(client: openai.AsyncOpenAI, request: httpx2.Request) -> httpx2.Response:
    """Send a built request through the client's own HTTP client, streaming its body."""
    return await client._client.send(request, stream=True)


def status_error(client: openai.AsyncOpenAI, response: httpx2.Response) -> openai.APIStatusError:
    """The SDK's typed error for an error answer whose body has been read."""
    return client._make_status_error_from_response(response)
