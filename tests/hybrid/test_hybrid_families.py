"""Every hybrid family transformers ships, under ``cplib.context_parallel``:
each tiny model either gives one process's logits (its recurrent and conv
layers carried across ranks) or raises NotImplementedError on every rank,
naming the layer class that cplib cannot carry; never a silent per-shard
result; outside a context, what transformers computes. And the list of
families (cplib/clients/hybrid_families.py) is complete:
transformers' source is scanned for sequence mixers, and each one found is
either listed or named below as not a mixer of the text sequence."""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from harness import assert_close
from hybrid_cases import FAMILY_CONFIGS, VOCAB, tiny_model

# Classes the scan finds that do not mix the (sharded) text sequence, or hold
# a listed mixer: why each is left out.
NOT_TEXT_MIXERS = {
    "SeamlessM4Tv2ConformerConvolutionModule": "speech encoder",
    "Wav2Vec2BertConvolutionModule": "speech encoder",
    "TimesFmModelForPrediction": "time-series model, no decoder layers under CP",
    "TimesFm2_5ModelForPrediction": "time-series model",
    "KimiLinearAttention": "Kimi's MLA attention (the attention interface)",
    "RwkvLinearAttention": "an autograd Function inside RwkvSelfAttention",
    "RwkvBlock": "holds RwkvSelfAttention and RwkvFeedForward",
    "RwkvModel": "holds RwkvBlock",
    "RwkvForCausalLM": "holds RwkvModel",
    "xLSTMBlock": "holds xLSTMLayer",
    "Qwen4ExpTextNGramEmbedding": "inside Qwen4ExpTextPLELayer",
    "RecurrentGemmaRglru": "inside RecurrentGemmaRecurrentBlock",
}
_KERNELS = re.compile(r"causal_conv1d_fn|selective_scan|chunk_scan|delta_rule|delta_attention|"
                      r"mamba_inner_fn|split_conv1d_scan|chunk_kda|lightning|wkv|mlstm")
_NAMES = re.compile(r"(Mixer|GatedDeltaNet|DeltaAttention|ShortConv\w*|"
                    r"L(inear|ightning)Attention|Rglru|"
                    r"RecurrentBlock|CCAProjection|xLSTMLayer|FeedForward)$")


# Files with none of these hold no mixer (parsing every file takes seconds).
_WORTH_PARSING = re.compile(_KERNELS.pattern + r"|padding=[^,\n]*- ?1\b|- ?1, 0\)|"
                            r"create_recurrent_attention_mask")


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _causal_conv(call: ast.Call, name: str) -> bool:
    """nn.Conv1d(..., padding=k - 1) or F.pad(x, (k - 1, 0))."""
    if name == "Conv1d":
        return any(kw.arg == "padding" and isinstance(kw.value, ast.BinOp)
                   and isinstance(kw.value.op, ast.Sub) for kw in call.keywords)
    if name == "pad" and len(call.args) >= 2 and isinstance(call.args[1], ast.Tuple):
        sides = call.args[1].elts
        return len(sides) == 2 and not isinstance(sides[0], ast.Constant) and \
            isinstance(sides[1], ast.Constant) and sides[1].value == 0
    return False


def _is_mixer(node: ast.ClassDef, family: str, recurrent_model: bool) -> bool:
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            name = _callee(call)
            if _KERNELS.search(name) or _causal_conv(call, name):
                return True
    named = bool(_NAMES.search(node.name))
    return named and (recurrent_model or family in ("rwkv", "recurrent_gemma", "minimax"))


def _scan() -> dict[str, set[str]]:
    """Per family, the classes of its modeling file that mix the sequence:
    a call of a conv/scan/recurrence kernel, a causal conv (padding k - 1),
    or a mixer's name in a model with recurrent layers."""
    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found: dict[str, set[str]] = {}
    for family in sorted(os.listdir(root)):
        path = os.path.join(root, family, f"modeling_{family}.py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        if not _WORTH_PARSING.search(source):
            continue
        recurrent_model = "create_recurrent_attention_mask" in source
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and _is_mixer(node, family, recurrent_model):
                found.setdefault(family, set()).add(node.name)
    return found


def test_every_sequence_mixer_of_transformers_is_listed():
    from cplib.integrations.transformers.hybrid_families import FAMILIES

    listed = {(f, m.name) for f, mixers in FAMILIES.items() for m in mixers}
    found = {(family, name) for family, names in _scan().items() for name in names}
    missing = sorted(f"{f}.{name}" for f, name in found - listed if name not in NOT_TEXT_MIXERS)
    assert not missing, f"sequence mixers cplib.hf does not list: {missing}"
    # Every listed mixer and every exception is one the scan finds (no stale name).
    assert not listed - found, sorted(listed - found)
    assert set(NOT_TEXT_MIXERS) <= {name for _, name in found}
    assert set(FAMILY_CONFIGS) == set(FAMILIES)


# Families whose attention layers cplib's attention refuses (with its own
# NotImplementedError, as "cplib" is set: family_verdicts.py): what it names.
ATTENTION_REFUSED = {"inkling": "position bias", "inkling2": "position bias"}


def _family_under_cp(family: str) -> str:
    """"exact", or "refused <what the error names>"; asserts either way."""
    import cplib
    from cplib.integrations.transformers.hybrid_families import FAMILIES

    n = dist.get_world_size()
    if family in ATTENTION_REFUSED:
        with pytest.raises(NotImplementedError, match=ATTENTION_REFUSED[family]):
            tiny_model(family)
        return f"refused {ATTENTION_REFUSED[family]}"
    model = tiny_model(family)
    present = {type(m).__name__ for m in model.modules()}
    mixers = [m for m in FAMILIES[family] if m.name in present]
    assert mixers, f"{family}: the tiny model has none of {[m.name for m in FAMILIES[family]]}"
    expected = [m.name for m in mixers if m.refusal is not None][:1]
    ids = torch.randint(0, VOCAB, (1, 16 * n), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(16 * n)[None]
    with torch.no_grad():
        try:
            with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[ids, pos],
                                        buffer_seq_dims=[1, 1], load_balance=True) as cp:
                local = model(input_ids=ids, position_ids=pos, use_cache=False)[0]
                (got,) = cp.unshard([local], [1])
        except NotImplementedError as exc:
            assert expected and expected[0] in str(exc), f"{family}: {exc}"
            return f"refused {expected[0]}"
        assert not expected, f"{family}: {expected} ran under CP without raising"
        # One process, transformers' own eager attention, the same weights.
        model.set_attn_implementation("eager")
        want = model(input_ids=ids, position_ids=pos, use_cache=False)[0]
    assert_close(got, want, what=f"{family} under CP", atol=2e-5, rtol=1e-4)
    return "exact"


def _all_families() -> dict[str, str]:
    from cplib.integrations.transformers.hybrid_families import FAMILIES

    return {family: _family_under_cp(family) for family in FAMILIES}


def test_every_hybrid_family_is_exact_or_refused_by_name(ranks):
    # Each rank asserts its family's outcome against the list: exact where
    # every mixer in the tiny model has a path, else the named refusal.
    results = ranks(2).run(_all_families)
    assert results[0] == results[1], results
    exact = sorted(f for f, r in results[0].items() if r == "exact")
    assert {"qwen3_next", "qwen3_5", "kimi_linear", "falcon_h1", "granitemoehybrid",
            "lfm2"} <= set(exact), results[0]


@contextlib.contextmanager
def _transformers_own(family: str):
    """The family's module as transformers wrote it, for the block (main thread)."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    saved = {}
    for name, value in list(vars(module).items()):
        original = getattr(value, "__cplib_original__", None)
        if original is not None:
            saved[(module, name)] = value
            setattr(module, name, original)
        elif isinstance(value, type) and hasattr(vars(value).get("forward"), "__cplib_original__"):
            saved[(value, "forward")] = value.forward
            value.forward = value.forward.__cplib_original__
    assert saved, f"nothing of {family} is wrapped"
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def test_outside_the_context_the_layers_compute_what_transformers_does():
    for family in ("qwen3_next", "kimi_linear", "falcon_h1", "lfm2"):
        model = tiny_model(family).train()  # training: Mamba2's fused path is tried first
        ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            wrapped = model(input_ids=ids, use_cache=False)[0]
            with _transformers_own(family):
                own = model(input_ids=ids, use_cache=False)[0]
        assert torch.equal(wrapped, own), family
