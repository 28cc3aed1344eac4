"""Fixtures shared by the integration tests."""

from tests.integration.chromium import browser

__all__ = ["browser"]
