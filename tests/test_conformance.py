"""Every catalog head type passes the conformance checks (headmech.testing)."""

from __future__ import annotations

import pytest

from headmech.testing import head_type_checks


@pytest.mark.parametrize(("head_type", "check"), list(head_type_checks()))
def test_head_type_conformance(head_type, check):
    check(head_type())
