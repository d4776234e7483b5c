"""A hybrid model's layer kinds, read from either form its configs publish them in.

Nemotron-H's ``hybrid_override_pattern`` (Megatron-LM's ``--hybrid-override-pattern``) is a string with one
letter a layer: ``M`` a Mamba-2 mixer, ``*`` attention, ``-`` an MLP, ``E`` a Mixture-of-Experts MLP.
transformers 5's ``NemotronHConfig`` keeps a list instead, ``layers_block_type``: ``linear_attention``
(``mamba`` in older configs), ``full_attention`` (``attention``), ``mlp``, ``moe``.
"""

from __future__ import annotations

from .config import ModelConfigError

KINDS = ("mamba", "attention", "mlp", "moe")
LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
               "mlp": "mlp", "moe": "moe"}


def from_pattern(pattern: str, *, where: str) -> tuple[str, ...]:
    if not isinstance(pattern, str) or not pattern:
        raise ModelConfigError(f"{where}: hybrid_override_pattern = {pattern!r}; one letter a layer, of "
                               f"{' '.join(LETTERS)}")
    for i, letter in enumerate(pattern):
        if letter not in LETTERS:
            raise ModelConfigError(
                f"{where}: hybrid_override_pattern has {letter!r} at layer {i} ({pattern!r}); its letters are "
                + ", ".join(f"{k} ({v})" for k, v in LETTERS.items()))
    return tuple(LETTERS[letter] for letter in pattern)


def from_block_types(types, *, where: str) -> tuple[str, ...]:
    if not isinstance(types, (list, tuple)) or not types:
        raise ModelConfigError(f"{where}: layers_block_type = {types!r}; a list with one entry a layer")
    for i, kind in enumerate(types):
        if kind not in BLOCK_TYPES:
            raise ModelConfigError(f"{where}: layers_block_type has {kind!r} at layer {i}; use one of "
                                   f"{', '.join(BLOCK_TYPES)}")
    return tuple(BLOCK_TYPES[kind] for kind in types)


def block_kinds(*, pattern: str | None = None, block_types=None, layers: int | None = None,
                where: str = "model config") -> tuple[str, ...]:
    """Each layer's kind (``KINDS``), from the pattern, the list, or both where they agree; ``layers``, where the
    config also gives a layer count, must be their length."""
    if pattern is None and block_types is None:
        raise ModelConfigError(f"{where}: a hybrid model needs hybrid_override_pattern or layers_block_type")
    kinds = from_pattern(pattern, where=where) if pattern is not None else None
    if block_types is not None:
        listed = from_block_types(block_types, where=where)
        if kinds is not None and listed != kinds:
            raise ModelConfigError(f"{where}: hybrid_override_pattern {pattern!r} and layers_block_type disagree "
                                   f"(layer {next(i for i, (a, b) in enumerate(zip(kinds, listed)) if a != b)} "
                                   f"first, or their lengths {len(kinds)} and {len(listed)}); keep one")
        kinds = listed
    if layers is not None and layers != len(kinds):
        raise ModelConfigError(f"{where}: the pattern describes {len(kinds)} layers, the config has layers = "
                               f"{layers}; make them agree (a pattern has one entry a layer)")
    return kinds


def to_pattern(kinds) -> str:
    letters = {kind: letter for letter, kind in LETTERS.items()}
    return "".join(letters[kind] for kind in kinds)
