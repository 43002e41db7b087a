"""Start-up checks: a registry entry whose weights are missing fails here, not at its first job."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, register

from genserver import deployment


@register("genserver")
def registry_checkpoints_exist(app_configs=None, **kwargs) -> list[Error]:
    try:
        missing = deployment.registry().missing_checkpoints(settings.DATA_DIR)
    except ValueError as exc:  # an unreadable registry
        return [Error(str(exc), id="genserver.E001")]
    return [Error(line, id="genserver.E002") for line in missing]
