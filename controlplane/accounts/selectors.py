from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.utils import timezone

from controlplane.accounts.models import AccessToken
from controlplane.core.credentials import secret_hash

# last_used_at is a hint, not a log: write it at most once a minute per token.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def access_token_authenticate(raw_token: str) -> AccessToken | None:
    """The live token for this raw value, or None. The lookup is by hash, never by raw value."""
    token = (
        AccessToken.objects.select_related("user", "user__membership")
        .filter(token_hash=secret_hash(raw_token))
        .first()
    )
    now = timezone.now()
    if token is None:
        return None
    if token.revoked_at is not None:
        return None
    if token.expires_at is not None and token.expires_at <= now:
        return None
    if not token.user.is_active:
        return None
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
        AccessToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token


def access_token_list(*, user) -> QuerySet[AccessToken]:
    return AccessToken.objects.filter(user=user)


def user_list() -> QuerySet:
    return (
        get_user_model()
        .objects.select_related("membership", "membership__tenant")
        .order_by("username")
    )
