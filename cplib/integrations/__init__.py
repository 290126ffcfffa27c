"""cplib's reach into code it does not own, in one place: torch's
context-parallel names (torch_names.py), Hugging Face transformers
(transformers/), and the one registry every replacement goes through
(registry.py). docs/integrations.md has the table of what is installed, by
which switch, and how to take it back."""

from __future__ import annotations

__all__ = ["install_integrations", "uninstall"]


def install_integrations() -> None:
    """What runs whenever cplib's context parallelism starts (a region is
    entered, ``_context_parallel_shard`` cuts a batch, ``_ContextParallel``
    parallelizes a module): the transformers integration, where transformers'
    models are imported. Local (no collective), the same on every rank."""
    from .transformers import install

    install()


def uninstall(owner: str | None = None) -> int:
    """Puts back every original cplib replaced in another library (those of
    ``owner`` alone: ``"torch"``, ``"transformers"``, ``"dtensor"``, when
    given); returns how many. The next switch or context-parallel start
    installs again."""
    from .. import patch_registry as registry

    return registry.restore(owner)
