"""`manage.py version_footprints`: reckon the memory footprint of versions registered
before versions had one (docs/capacity.md); new versions get theirs at registration."""

from typing import Any

from django.core.management.base import BaseCommand

from controlplane.registry import services


class Command(BaseCommand):
    help = "Reckon the footprint of versions that have none yet."

    def handle(self, *args: Any, **options: Any) -> None:
        count = services.version_footprints_fill()
        self.stdout.write(f"{count} version footprints reckoned")
