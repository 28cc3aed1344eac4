"""Who is calling, and what they may do. Only keys' sha256 digests are kept; a presented
key's is compared with every one, so nothing stops early on a partial match."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import SecretStr

from agentq.config import Settings
from agentq.errors import ConfigError
from agentq.orchestrator.start import hash_token, token_matches
from agentq.state.turn_state import TurnState

_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")
MIN_KEY_CHARS = 16
"""A shorter key is a typo or a guessable password: refused at start."""
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False


def parse_keys(raw: str, *, setting: str, admin: bool = False) -> list[tuple[Principal, bytes]]:
    """`name=key,name=sha256:<hex>` into (principal, sha256 of the key)."""
    entries: list[tuple[Principal, bytes]] = []
    for i, item in enumerate(part.strip() for part in raw.split(",")):
        if not item:
            continue
        name, sep, key = item.partition("=")
        name, key = name.strip(), key.strip()
        where = f"entry {i + 1}"
        if not sep or not name or not key:
            raise ConfigError(setting, f"{where}: expected name=key or name=sha256:<hex>")
        if not _NAME.match(name):
            raise ConfigError(
                setting, f"{where}: the name {name!r} may use letters, digits and _.@- only"
            )
        if key.startswith("sha256:"):
            hexdigest = key.removeprefix("sha256:")
            if not _HEX_DIGEST.match(hexdigest):
                raise ConfigError(setting, f"{where} ({name}): sha256: needs 64 hex digits")
            digest = bytes.fromhex(hexdigest)
        else:
            if len(key) < MIN_KEY_CHARS:
                raise ConfigError(
                    setting, f"{where} ({name}): a key needs at least {MIN_KEY_CHARS} characters"
                )
            digest = hashlib.sha256(key.encode()).digest()
        entries.append((Principal(name, admin), digest))
    return entries


class Keyring:
    def __init__(self, entries: list[tuple[Principal, bytes]]) -> None:
        names: dict[str, bool] = {}
        for p, _ in entries:
            if names.setdefault(p.name, p.admin) != p.admin:
                raise ConfigError(
                    "AGENTQ_ADMIN_KEYS", f"{p.name!r} is both an API key name and an admin key name"
                )
        if len({digest for _, digest in entries}) != len(entries):
            raise ConfigError("AGENTQ_API_KEYS", "the same key is listed twice")
        self._entries = entries

    @classmethod
    def from_settings(cls, settings: Settings) -> Keyring:
        return cls(
            parse_keys(reveal(settings.api_keys), setting="AGENTQ_API_KEYS")
            + parse_keys(reveal(settings.admin_keys), setting="AGENTQ_ADMIN_KEYS", admin=True)
        )

    @property
    def enabled(self) -> bool:
        """Keys are configured: every endpoint but /healthz and the page needs one."""
        return bool(self._entries)

    def identify(self, presented: str | None) -> Principal | None:
        if not presented:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        found: Principal | None = None
        for principal, known in self._entries:
            if hmac.compare_digest(digest, known):
                found = principal
        return found


def reveal(secret: SecretStr | None) -> str:
    return secret.get_secret_value() if secret is not None else ""


def secret_matches(presented: str | None, expected: str | None) -> bool:
    """Constant-time equality of a presented secret and a configured one, via digests."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(hash_token(presented), hash_token(expected))


def may_access(state: TurnState, principal: Principal | None, token: str | None) -> bool:
    """Read and steer rights on one turn: the same three holders for both."""
    return token_matches(state, token) or (principal is not None and may_list(state, principal))


def may_list(state: Mapping[str, object], principal: Principal) -> bool:
    """A turn appears in the caller's `/v1/turns/active`: theirs, or all for an admin."""
    return principal.admin or state.get("owner") == principal.name


def visible_to(principal: Principal | None) -> Callable[[Mapping[str, object]], bool] | None:
    """Which turns `principal` may list; None: every turn (no keys, loopback only)."""
    return None if principal is None else (lambda state: may_list(state, principal))


def is_loopback(host: str) -> bool:
    """`host` (a name or an address, maybe in [brackets]) only reaches this machine."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, keyring: Keyring, *, insecure_no_auth: bool) -> None:
    if keyring.enabled or insecure_no_auth or is_loopback(host):
        return
    raise ConfigError(
        "AGENTQ_API_KEYS",
        f"the gateway would listen on {host or 'every address'} with no key: anyone who "
        "reaches it could read and start turns. Set AGENTQ_API_KEYS or AGENTQ_ADMIN_KEYS "
        "(name=key,...), bind to 127.0.0.1, or pass --insecure-no-auth",
    )
