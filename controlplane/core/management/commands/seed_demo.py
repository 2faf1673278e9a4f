"""`manage.py seed_demo`: the demo's users and data. Idempotent: run it as often as you like."""

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

DEMO_ADMIN = ("admin", "admin-demo-password")


class Command(BaseCommand):
    help = "Create the demo data (users of each role) and print their credentials."

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        username, password = DEMO_ADMIN
        user, created = user_model.objects.get_or_create(
            username=username, defaults={"is_staff": True, "is_superuser": True}
        )
        if created:
            user.set_password(password)
            user.save(update_fields=["password"])
        self.stdout.write("Demo credentials (local demo only):")
        self.stdout.write(f"  admin            {username} / {password}")
