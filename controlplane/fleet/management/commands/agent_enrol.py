"""`manage.py agent_enrol NAME [--ttl SECONDS] [--token-file PATH]`: a one-time enrolment
token for an agent, printed once (or written to a file readable by this user only)."""

import os
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.core.errors import DomainError
from controlplane.fleet.enrolment import agent_enrolment_create


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the agent's name (a-z, 0-9, . _ -)")
        parser.add_argument("--ttl", type=float, default=None, help="seconds (default 1 day)")
        parser.add_argument(
            "--token-file", help="write the token here (mode 0600) instead of printing it"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            created = agent_enrolment_create(
                actor=None, agent_name=options["name"], ttl_s=options["ttl"]
            )
        except DomainError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from exc
        expires = created.enrolment.expires_at.isoformat(timespec="seconds")
        if options["token_file"]:
            path = Path(options["token_file"])
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(created.raw_token + "\n")
            self.stdout.write(f"enrolment token for {options['name']} written to {path}")
        else:
            self.stdout.write(created.raw_token)
        self.stderr.write(f"good once, until {expires}: python -m agent --enrolment-token-file …")
