"""vLLM 0.33.0's KV cache manager built the way its engine builds it.

`EngineCore` does not hand the scheduler a `KVCacheConfig` written by hand: it plans the model's
layers into KV cache groups (`get_global_kv_cache_groups`, `kv_cache_planning.py`), sizes the
config from those groups (the config builder's `get_kv_cache_config_from_groups`, which copies
`CacheConfig.prefix_cache_retention_interval` into it), resolves the scheduler and hash block
sizes and the hit alignment (`resolve_kv_cache_block_sizes`,
`resolve_cache_hit_alignment_tokens`), and the scheduler builds `KVCacheManager` with its own
arguments (`max_in_flight_tokens`, `watermark`, ...). `EnginePath` runs those same functions of
the release, fed the defaults of `CacheConfig` and `SchedulerConfig` as the release's own source
states them (read from `vllm/config/cache.py` and `vllm/config/scheduler.py`, never retyped
here), unless `--vllm-setting NAME=VALUE` says otherwise.

Two steps of the engine are left out, each for a stated reason: the admission check at start
(`_check_enough_kv_cache_memory`: the swarm draws pools smaller than one request of
`max_model_len` on purpose, to reach refusals and eviction), and the size of the pool, which is
the drawn one (`num_gpu_blocks_override`, as a user sets it).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagedkv.harness.domain import Domain
from pagedkv.harness.protocol import ManagerFactory, PoolFactory
from pagedkv.harness.setup_check import SetupError

SETTINGS: dict[str, tuple[str, str]] = {
    "prefix_cache_retention_interval": ("vllm/config/cache.py", "CacheConfig"),
    "prefix_match_unit": ("vllm/config/cache.py", "CacheConfig"),
    "enable_mamba_shared_prefix_checkpoint": ("vllm/config/cache.py", "CacheConfig"),
    "watermark": ("vllm/config/scheduler.py", "SchedulerConfig"),
    "max_num_batched_tokens": ("vllm/config/scheduler.py", "SchedulerConfig"),
}
"""The engine settings the manager depends on: name -> (file, class) whose default the engine
takes unless the user sets it."""

SUPPORTED: dict[str, tuple[object, ...] | None] = {
    "prefix_cache_retention_interval": None,  # None, 0, or a positive number of tokens
    "prefix_match_unit": (None,),
    "enable_mamba_shared_prefix_checkpoint": (False,),
    "watermark": (0.0,),
    "max_num_batched_tokens": None,
}
"""The values pagedkv models (None: any valid value). The watermark needs the scheduler's
`has_scheduled_reqs`, which the harness does not send; a prefix match unit and Mamba
checkpoints need groups the harness does not draw yet."""

CONFIG_FILES = tuple(sorted({path for path, _ in SETTINGS.values()}))
"""Wheel members read for their defaults only (never imported)."""

ASYNC_SCHEDULING_BATCHES = 2
"""`VllmConfig.max_concurrent_batches` with async scheduling on (0.33's default) and one
pipeline stage: the engine keeps two batches in flight."""


def class_defaults(source: str, class_name: str) -> dict[str, object]:
    """The literal defaults of `class_name`'s fields in `source` (`x: T = v` or
    `x: T = Field(default=v, ...)`); ClassVar constants named in a default are resolved."""
    tree = ast.parse(source)
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    constants: dict[str, object] = {}
    fields: dict[str, object] = {}
    for statement in node.body:
        if not isinstance(statement, ast.AnnAssign) or statement.value is None:
            continue
        if not isinstance(statement.target, ast.Name):
            continue
        name = statement.target.id
        value: ast.expr | None = statement.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Field":
            value = next((k.value for k in value.keywords if k.arg == "default"), None)
        if value is None:
            continue
        if isinstance(value, ast.Name) and value.id in constants:
            fields[name] = constants[value.id]
            continue
        try:
            literal = ast.literal_eval(value)
        except ValueError:
            continue
        if "ClassVar" in ast.unparse(statement.annotation):
            constants[name] = literal
        else:
            fields[name] = literal
    return fields


def engine_defaults(root: Path) -> dict[str, object]:
    """The default of every setting in `SETTINGS`, read from the release's source at `root`.

    Raises:
        SetupError: a setting's default is not a literal in its class (the release changed).
    """
    defaults: dict[str, object] = {}
    for name, (path, class_name) in SETTINGS.items():
        fields = class_defaults((root / path).read_text(), class_name)
        if name not in fields:
            raise SetupError(f"vLLM's {class_name} ({path}) states no default for {name}")
        defaults[name] = fields[name]
    return defaults


def parse_setting(text: str) -> tuple[str, object]:
    """`NAME=VALUE` -> (name, value): None, a bool, an int or a float.

    Raises:
        SetupError: not of that form, or a name outside `SETTINGS`.
    """
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in SETTINGS:
        known = ", ".join(SETTINGS)
        raise SetupError(f"--vllm-setting takes NAME=VALUE with NAME one of {known}; got {text!r}")
    raw = raw.strip()
    value: object
    if raw.lower() in ("none", "null", "dense"):
        value = None
    elif raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                raise SetupError(f"--vllm-setting {name}: {raw!r} is not a number") from None
    return name, value


@dataclass(frozen=True)
class EngineSettings:
    """The settings in force: each with its value and where it came from."""

    values: Mapping[str, object]
    chosen: frozenset[str]

    @classmethod
    def resolve(cls, defaults: Mapping[str, object], texts: Sequence[str]) -> EngineSettings:
        """The defaults with the user's `NAME=VALUE`s over them.

        Raises:
            SetupError: a malformed or unknown setting, one given twice, or a value pagedkv
                does not model (`SUPPORTED`).
        """
        values = dict(defaults)
        chosen: set[str] = set()
        for text in texts:
            name, value = parse_setting(text)
            if name in chosen:
                raise SetupError(f"--vllm-setting {name} is given twice")
            chosen.add(name)
            values[name] = value
        for name, allowed in SUPPORTED.items():
            if allowed is not None and values[name] not in allowed:
                raise SetupError(
                    f"--vllm-setting {name}={values[name]!r}: pagedkv models only "
                    f"{', '.join(map(repr, allowed))} (the harness draws no configuration "
                    "that exercises it)"
                )
        interval = values["prefix_cache_retention_interval"]
        if interval is not None and (not isinstance(interval, int) or interval < 0):
            raise SetupError(
                f"--vllm-setting prefix_cache_retention_interval={interval!r}: vLLM takes "
                "None or a whole number of tokens >= 0"
            )
        batched = values["max_num_batched_tokens"]
        if not isinstance(batched, int) or batched < 1:
            raise SetupError(f"--vllm-setting max_num_batched_tokens={batched!r}: need >= 1")
        return cls(values, frozenset(chosen))

    @property
    def retention(self) -> int | None:
        value = self.values["prefix_cache_retention_interval"]
        assert value is None or isinstance(value, int)
        return value

    @property
    def max_in_flight_tokens(self) -> int:
        """`VllmConfig.max_in_flight_tokens`: every batch in flight a full token budget."""
        batched = self.values["max_num_batched_tokens"]
        assert isinstance(batched, int)
        return ASYNC_SCHEDULING_BATCHES * batched

    def describe(self) -> str:
        """The settings in words, each marked as the engine's default or the user's."""
        parts = []
        for name, value in self.values.items():
            origin = "--vllm-setting" if name in self.chosen else f"{SETTINGS[name][1]} default"
            parts.append(f"{name}={value!r} ({origin})")
        parts.append(
            f"max_in_flight_tokens={self.max_in_flight_tokens} (async scheduling: "
            f"{ASYNC_SCHEDULING_BATCHES} batches)"
        )
        return ", ".join(parts)


@dataclass(frozen=True)
class Loaded:
    """A release's factories once its tree is importable, the domain its campaigns draw from,
    and what to tell the user about how they were built."""

    pool_factory: PoolFactory
    manager_factory: ManagerFactory
    domain: Domain
    notes: tuple[str, ...] = ()


def _resolved_layout() -> Any:
    """The layout `CacheConfig` resolves for an attention backend that does not ask for one."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout.LBHNC


MODELLED_SPECS = (
    "FullAttentionSpec",
    "SlidingWindowSpec",
    "ChunkedLocalAttentionSpec",
    "MambaSpec",
)
"""vLLM's spec classes of the groups pagedkv models (a `UniformTypeKVCacheSpecs`, several
layers of one type but different shapes in one group, is not)."""


class UnplannableError(SetupError):
    """vLLM's planning gives the drawn layers a group pagedkv does not model."""


class EnginePath:
    """The release's planning and sizing functions, run on the harness's layers (one named
    `layers.<g>` per drawn group) as `EngineCore` runs them."""

    def __init__(self, settings: EngineSettings, interface: Any, torch: Any) -> None:
        from vllm.v1.core import kv_cache_utils

        self.settings = settings
        self.interface = interface
        self.torch = torch
        self.utils = kv_cache_utils

    def global_groups(self, config: Any, layers: dict[str, Any]) -> list[Any]:
        """The release's grouping of the whole model's layers, as `EngineCore` calls it
        (0.33.0: `kv_cache_planning.get_global_kv_cache_groups`)."""
        from vllm.v1.core import kv_cache_planning

        return list(kv_cache_planning.get_global_kv_cache_groups(config, [layers]))

    def config_from_groups(self, config: Any, groups: list[Any], num_blocks: int) -> Any:
        """The release's `KVCacheConfig` of `groups` at `num_blocks` blocks (0.33.0: the config
        builder's `get_kv_cache_config_from_groups`, which takes the block count)."""
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

        builder = get_kv_cache_config_builder(config)
        return builder.get_kv_cache_config_from_groups(config, groups, num_blocks)

    def vllm_config(
        self,
        block_size: int,
        max_model_len: int,
        use_eagle: bool,
        retention: int | None,
        enable_caching: bool,
        num_blocks: int | None = None,
        mamba_block_size: int | None = None,
    ) -> Any:
        """The fields of a `VllmConfig` that planning, sizing and the scheduler read.

        `block_size` is the attention layers' (`CacheConfig.block_size`); `mamba_block_size`
        the Mamba layers', where there are any: with prefix caching off the engine sets it to
        `max_model_len` and the Mamba cache mode to "none" (`MambaModelConfig`,
        models/config.py), with it on to the block size, in mode "align".
        """
        values = self.settings.values
        speculative = None
        if use_eagle:
            speculative = SimpleNamespace(
                method="eagle", use_eagle_block_drop=lambda: True, use_eagle=lambda: True
            )
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(
                disable_hybrid_kv_cache_manager=False,
                max_num_batched_tokens=values["max_num_batched_tokens"],
                watermark=values["watermark"],
            ),
            model_config=SimpleNamespace(
                max_model_len=max_model_len,
                original_max_model_len=max_model_len,
                supports_kv_cache_grouping=False,
            ),
            cache_config=SimpleNamespace(
                block_size=block_size,
                enable_prefix_caching=enable_caching,
                num_gpu_blocks_override=num_blocks,
                prefix_cache_retention_interval=retention,
                prefix_match_unit=values["prefix_match_unit"],
                mamba_cache_mode="align" if enable_caching else "none",
                mamba_block_size=mamba_block_size,
                get_resolved_kv_cache_layout=_resolved_layout,
            ),
            attention_config=SimpleNamespace(hisparse_config=None),
            parallel_config=SimpleNamespace(
                decode_context_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=1
            ),
            speculative_config=speculative,
            kv_transfer_config=None,
            num_prefill_lookahead_tokens=0,
            device_config=SimpleNamespace(device_type="cuda"),
            max_in_flight_tokens=self.settings.max_in_flight_tokens,
        )

    def plan_groups(self, vllm_specs: Sequence[Any], config: Any) -> list[Any]:
        """vLLM's groups for one layer per spec (`layers.<i>`), each group of one spec.

        Attention and Mamba layers of one page size (a Mamba page padded to the attention
        page, as the platform pads it) are grouped by `_get_kv_cache_groups_uniform_page_size`:
        one group per distinct spec, in the order of first appearance; equal specs share a
        bucket, which vLLM may split (`layers[i::n]`) or keep whole.
        """
        layers = {f"layers.{i}": spec for i, spec in enumerate(vllm_specs)}
        groups = self.global_groups(config, dict(layers))
        for group in groups:
            spec = group.kv_cache_spec
            if type(spec).__name__ not in MODELLED_SPECS:
                raise UnplannableError(
                    f"vLLM plans layers {list(group.layer_names)} as one group of "
                    f"{type(spec).__name__}, which pagedkv does not model"
                )
        return list(groups)

    def kv_cache_config(self, groups: list[Any], num_blocks: int, config: Any) -> Any:
        """The `KVCacheConfig` the engine sizes for `groups` at `num_blocks`, with its block
        sizes and hit alignment resolved as `EngineCore` resolves them; and those sizes."""
        built = self.config_from_groups(config, groups, num_blocks)
        scheduler_block_size, hash_block_size = self.utils.resolve_kv_cache_block_sizes(
            built, config
        )
        built.hash_block_size = hash_block_size
        built.cache_hit_alignment_tokens = self.utils.resolve_cache_hit_alignment_tokens(
            built, config, scheduler_block_size, hash_block_size
        )
        return built, scheduler_block_size, hash_block_size
