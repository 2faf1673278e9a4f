"""Webhook deliveries keep an error category, not error text, and their own schedule.

`last_error` held the resolver's or the receiver's own text (an exception message, which
names internal hosts and ports); existing rows are rewritten to the category that text
falls in, then the column shrinks to the category. `next_attempt_at` says when a pending
delivery is due, so that the sweep finds the ones whose task was lost.
"""

import django.utils.timezone
from django.db import migrations, models

TIMEOUT_ERRORS = ("ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout")


def legacy_error_category(text: str, status_code: int | None) -> str:
    """The category of an error the earlier code stored as text."""
    if not text:
        return ""
    if status_code is not None:
        return (
            "http_5xx" if status_code >= 500 else "http_4xx" if status_code >= 400 else "http_3xx"
        )
    if text.startswith(TIMEOUT_ERRORS):
        return "timeout"
    if text.startswith("ConnectError"):
        upper = text.upper()
        return "tls_error" if "SSL" in upper or "CERTIFICATE" in upper else "connect_error"
    return "transport_error"


def categorize_errors(apps, schema_editor):
    WebhookDelivery = apps.get_model("rollouts", "WebhookDelivery")
    for delivery in WebhookDelivery.objects.exclude(last_error="").only(
        "pk", "last_error", "last_status_code"
    ):
        delivery.last_error = legacy_error_category(delivery.last_error, delivery.last_status_code)
        delivery.save(update_fields=["last_error"])


class Migration(migrations.Migration):
    dependencies = [
        ("rollouts", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="webhookdelivery",
            name="next_attempt_at",
            field=models.DateTimeField(default=django.utils.timezone.now),
        ),
        migrations.RunPython(categorize_errors, migrations.RunPython.noop, elidable=True),
        migrations.AlterField(
            model_name="webhookdelivery",
            name="last_error",
            field=models.CharField(
                blank=True,
                choices=[
                    ("target_forbidden", "Target forbidden"),
                    ("dns_error", "DNS error"),
                    ("connect_error", "Connect error"),
                    ("tls_error", "TLS error"),
                    ("timeout", "Timeout"),
                    ("transport_error", "Transport error"),
                    ("http_3xx", "HTTP 3xx"),
                    ("http_4xx", "HTTP 4xx"),
                    ("http_5xx", "HTTP 5xx"),
                    ("interrupted", "Interrupted"),
                ],
                max_length=32,
            ),
        ),
        migrations.AddIndex(
            model_name="webhookdelivery",
            index=models.Index(
                condition=models.Q(("status", "pending")),
                fields=["next_attempt_at"],
                name="rollouts_delivery_pending_due",
            ),
        ),
    ]
