"""Model capacity limits (`AGENTQ_LLM_LIMITS`, docs/capacity.md) and token estimates; pure.
An entry without `deployments` has one implicit deployment, `default`: the configured
`AGENTQ_LLM_BASE_URL`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from agentq.errors import ConfigError, describe_invalid

SETTING = "AGENTQ_LLM_LIMITS"
DEFAULT_DEPLOYMENT = "default"
CHARS_PER_TOKEN = 4
"""English text and code average about four characters per token with OpenAI's tokenizers."""
DEFAULT_COMPLETION_TOKENS = 1024
"""Completion tokens assumed when a request sets no `max_completion_tokens`."""


class _Limits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rpm: int | None = Field(default=None, gt=0, strict=True)
    """Requests per minute."""
    tpm: int | None = Field(default=None, gt=0, strict=True)
    """Tokens (prompt and completion) per minute."""
    streams: int | None = Field(default=None, gt=0, strict=True)
    """Streams open at once."""


class DeploymentLimits(_Limits):
    """One endpoint (or account) serving a model, with its own limits."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", max_length=64)
    base_url: str | None = None
    """The endpoint; None: the configured `AGENTQ_LLM_BASE_URL`."""
    model: str | None = None
    """The provider's name for the model; None: the name the request sends."""
    api_key: SecretStr | None = None
    """None: the configured `AGENTQ_LLM_API_KEY`."""


class ModelLimitsEntry(_Limits):
    """The limits of one model (by the name requests send), shared by every llm worker."""

    deployments: tuple[DeploymentLimits, ...] = ()
    strategy: Literal["ordered", "least_loaded"] = "ordered"
    api: Literal["chat", "responses", "auto"] | None = None
    """The model's API (docs/models.md); None: AGENTQ_LLM_API."""

    @model_validator(mode="after")
    def _check(self) -> ModelLimitsEntry:
        names = [d.name for d in self.deployments]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"deployment names must be unique, repeated: {', '.join(dupes)}")
        if DEFAULT_DEPLOYMENT in names:
            # Rounds on it would go to the configured endpoint, key and model, not its own.
            raise ValueError(
                f"'{DEFAULT_DEPLOYMENT}' names the implicit deployment of an entry without "
                "deployments: give this one another name"
            )
        if not self.deployments and not (self.rpm or self.tpm or self.streams or self.api):
            raise ValueError("sets none of rpm, tpm, streams, deployments, api")
        return self

    @property
    def routes(self) -> tuple[DeploymentLimits, ...]:
        """The deployments to choose from: the configured ones, or the implicit default."""
        return self.deployments or (DeploymentLimits(name=DEFAULT_DEPLOYMENT),)

    def deployment(self, name: str) -> DeploymentLimits | None:
        """The deployment called `name`, if there is one."""
        return next((d for d in self.routes if d.name == name), None)


def parse_limits(raw: str | None) -> dict[str, ModelLimitsEntry]:
    """The entries of `AGENTQ_LLM_LIMITS` by model name; empty when unset or blank."""
    if raw is None or not raw.strip():
        return {}
    try:
        data: Any = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(SETTING, f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(SETTING, "must be a JSON object keyed by model name")
    out: dict[str, ModelLimitsEntry] = {}
    for model, spec in data.items():
        # A brace would end the model's Redis Cluster hash tag ({prefix}:{model}:...) early.
        if not model.strip() or "{" in model or "}" in model:
            raise ConfigError(SETTING, f"bad model name {model!r}: empty or contains braces")
        if not isinstance(spec, dict):
            raise ConfigError(SETTING, f"{model}: must be an object with rpm, tpm, streams")
        try:
            out[model] = ModelLimitsEntry.model_validate(spec)
        except ValidationError as exc:
            raise ConfigError(SETTING, f"{model}: {describe_invalid(exc, limit=None)}") from None
    return out


def estimate_tokens(prompt_tokens: int, max_completion_tokens: int | None) -> int:
    """Tokens a request may use, counted against `tpm` before it is sent: the prompt's
    estimate plus the completion at its maximum, as providers count it (docs/capacity.md)."""
    if max_completion_tokens is None:
        max_completion_tokens = DEFAULT_COMPLETION_TOKENS
    return max(max(prompt_tokens, 0) + max(max_completion_tokens, 0), 1)
