"""``import cplib.hf``: the switch to ``attn_implementation="cplib"`` for
Hugging Face models.

It registers cplib's attention function with ``transformers.AttentionInterface``
and its mask function with ``AttentionMaskInterface`` (so that no S x S mask
is built for it), through cplib's patch registry (owner ``"cplib.hf"``), and
installs the transformers integration (cplib/integrations/transformers/: the
losses over the whole sequence, hybrid layers, guards; docs/hf.md).

A model built or switched with it (``from_config(cfg,
attn_implementation="cplib")``, ``model.set_attn_implementation("cplib")``)
computes every layer's attention inside ``cplib.context_parallel(...)`` with
cplib's ring (or USP with ``ulysses_degree``) over the whole sequence, and
outside any context as its own eager path would; a family that cannot run
it refuses the setting by name. Everything this package knows about
transformers lives in cplib/integrations/transformers/; this module is the
switch only. Importing ``cplib`` alone does not import transformers; this
module does.
"""

from __future__ import annotations

from .. import patch_registry as registry
from ..integrations.transformers import install as _install_integration
from ..integrations.transformers.attention import cplib_attention_forward, cplib_mask

__all__ = ["cplib_attention_forward", "cplib_mask", "ATTN_IMPLEMENTATION", "install"]

ATTN_IMPLEMENTATION = "cplib"
OWNER = "cplib.hf"


def install() -> None:
    """Registers ``attn_implementation="cplib"`` and installs the
    integration (what importing this module does; again after
    ``cplib.integrations.uninstall()``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    registry.replace(OWNER, AttentionInterface._global_mapping, ATTN_IMPLEMENTATION,
                     lambda _: cplib_attention_forward)
    registry.replace(OWNER, AttentionMaskInterface._global_mapping, ATTN_IMPLEMENTATION,
                     lambda _: cplib_mask)
    _install_integration(import_transformers=True)


install()
