"""Changes that reach the user row or the session without a service tell the user's open
dashboard sockets to follow (see `consumers`): a sign-out, and the Django admin (or a
shell) deactivating, deleting or re-privileging a user. Role and tenant changes go
through `accounts.services.membership_set`, which says so itself.
"""

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_out
from django.db.models.signals import post_delete, post_save
from django.http import HttpRequest

from controlplane.core.events import publish_access_changed, publish_access_changed_after_commit


def on_user_logged_out(sender: Any, request: HttpRequest, user: Any, **kwargs: Any) -> None:
    # Sent before the session is flushed, so its key is still there to name.
    if user is None:
        return
    publish_access_changed(user.pk, ended_session_key=request.session.session_key)


def on_user_changed(sender: Any, instance: Any, **kwargs: Any) -> None:
    update_fields = kwargs.get("update_fields")
    if update_fields is not None and set(update_fields) <= {"last_login"}:
        return  # every sign-in writes it; it changes nobody's access
    publish_access_changed_after_commit(instance.pk)


def connect() -> None:
    user_model = get_user_model()
    user_logged_out.connect(on_user_logged_out, dispatch_uid="dashboard-live-logout")
    post_save.connect(on_user_changed, sender=user_model, dispatch_uid="dashboard-live-user-save")
    post_delete.connect(
        on_user_changed, sender=user_model, dispatch_uid="dashboard-live-user-delete"
    )
