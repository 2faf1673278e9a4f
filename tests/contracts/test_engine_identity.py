"""The engine's identity proof: HMAC-SHA256 of the agent and the nonce under the admin secret."""

import hashlib
import hmac

import pytest

from contracts.engine_identity import (
    identity_proof,
    is_identity_proof_valid,
    is_valid_nonce,
    new_nonce,
)

ADMIN = "ad" * 32
NONCE = "0f" * 32


def test_the_proof_is_the_hmac_of_the_labelled_agent_and_nonce() -> None:
    expected = hmac.new(
        ADMIN.encode(), f"engine-identity\ngpu-0\n{NONCE}".encode(), hashlib.sha256
    ).hexdigest()
    assert identity_proof(admin_secret=ADMIN, agent="gpu-0", nonce=NONCE) == expected
    assert is_identity_proof_valid(admin_secret=ADMIN, agent="gpu-0", nonce=NONCE, proof=expected)


@pytest.mark.parametrize(
    ("admin_secret", "agent", "nonce"),
    [("ae" * 32, "gpu-0", NONCE), (ADMIN, "gpu-1", NONCE), (ADMIN, "gpu-0", "1f" * 32)],
)
def test_a_proof_holds_for_its_own_secret_agent_and_nonce_only(
    admin_secret: str, agent: str, nonce: str
) -> None:
    proof = identity_proof(admin_secret=ADMIN, agent="gpu-0", nonce=NONCE)
    assert not is_identity_proof_valid(
        admin_secret=admin_secret, agent=agent, nonce=nonce, proof=proof
    )


def test_a_proof_that_is_not_hex_is_refused_without_an_error() -> None:
    assert not is_identity_proof_valid(admin_secret=ADMIN, agent="gpu-0", nonce=NONCE, proof="é")


@pytest.mark.parametrize(
    ("nonce", "is_valid"),
    [
        ("a" * 32, True),
        ("A" * 128, True),
        ("a" * 31, False),
        ("a" * 129, False),
        ("g" * 32, False),
        ("a" * 32 + "\n", False),
        ("", False),
    ],
)
def test_a_nonce_is_32_to_128_hex_characters(nonce: str, is_valid: bool) -> None:
    assert is_valid_nonce(nonce) is is_valid


def test_fresh_nonces_are_valid_and_differ() -> None:
    first, second = new_nonce(), new_nonce()
    assert (is_valid_nonce(first), len(first), first != second) == (True, 64, True)
