"""`manage.py register_artifact PATH [--digest sha256:<hex>]`: store a server-side file or
model folder.

For administrators with shell access: the file (or each file of the folder) is streamed into
the content-addressed store with the same checks as an upload (digest, size limit,
GGUF/safetensors header only; a folder's paths and file types, contracts/manifest.py).
"""

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from controlplane.core.errors import DomainError
from controlplane.registry import services


class Command(BaseCommand):
    help = "Store a model file or folder from this server's disk and print its digest."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("path", type=Path)
        parser.add_argument(
            "--digest", help="The expected digest (sha256:<hex>); refused if the file differs."
        )

    def handle(self, *args: Any, path: Path, digest: str | None, **options: Any) -> None:
        try:
            if path.is_dir():
                artifact, created = services.artifact_store_folder(
                    actor=None, path=path, declared_digest=digest
                )
            else:
                artifact, created = services.artifact_store_file(
                    actor=None, path=path, declared_digest=digest
                )
        except DomainError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from exc
        state = "stored" if created else "already stored"
        self.stdout.write(
            f"{state}: sha256:{artifact.digest} {artifact.format} {artifact.size_bytes} bytes"
        )
