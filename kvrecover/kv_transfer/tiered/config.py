"""TieredConnector's settings: the `connectors` list of tiers (vLLM's MultiConnector
format) as records, and each tier's own `KVTransferConfig` built from its entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrecover.config import KVTransferConfig
from kvrecover.kv_transfer.stores.store_base import StoreSettings
from kvrecover.options import REQUIRED, from_dict, option


@dataclass(frozen=True)
class TierEntry:
    """One entry of `connectors`: a block-store connector, as a `KVTransferConfig` would
    name it (`kv_role` defaulting to the outer one), and whether it saves."""

    kv_connector: str = option(REQUIRED, "the tier's block-store connector", str)
    kv_connector_extra_config: dict[str, Any] = option(
        {}, "the tier connector's own settings", dict)
    kv_role: str | None = option(None, "the tier's role (default: the outer kv_role)", str,
                                 nullable=True)
    kv_connector_module_path: str | None = option(
        None, "module of a user's block-store connector", str, nullable=True)
    save: bool | None = option(
        None, "save into this tier; when any tier sets it, only tiers with true save", bool,
        nullable=True, describe="True or False")


def _tier_entries(entries: Any) -> tuple[TierEntry, ...]:
    """The `connectors` setting as records (each entry's mistakes named by its index)."""
    if isinstance(entries, tuple) and all(isinstance(e, TierEntry) for e in entries):
        return entries
    if not isinstance(entries, list) or not entries:
        raise ValueError(
            "TieredConnector needs kv_connector_extra_config['connectors']: a non-empty list of "
            "{'kv_connector': ..., 'kv_connector_extra_config': {...}} dicts, got "
            f"{entries!r}")
    records = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or "kv_connector" not in entry:
            raise ValueError(f"connectors[{index}] must be a dict with a 'kv_connector' name, "
                             f"got {entry!r}")
        records.append(from_dict(TierEntry, entry, f"connectors[{index}] key",
                                 label=f"connectors[{index}][{{name!r}}]"))
    return tuple(records)


@dataclass(frozen=True)
class TieredSettings(StoreSettings):
    """TieredConnector's settings: its tiers, and the load settings set once, outside
    (`load_timeout_s` defaults to the tiers' deadlines summed)."""

    connectors: tuple[TierEntry, ...] | None = option(
        None, "the tiers, in order: a non-empty list of {'kv_connector': ..., "
        "'kv_connector_extra_config': {...}, 'kv_role': ..., 'save': ...} dicts", tuple,
        convert=_tier_entries)


def tier_config(outer: KVTransferConfig, index: int, entry: TierEntry) -> KVTransferConfig:
    """Tier `index`'s config: its entry, with the outer config's role (unless it names
    one) and load-failure settings."""
    try:
        return KVTransferConfig(
            kv_connector=entry.kv_connector,
            kv_role=outer.kv_role if entry.kv_role is None else entry.kv_role,
            kv_connector_extra_config=entry.kv_connector_extra_config,
            kv_connector_module_path=entry.kv_connector_module_path,
            kv_load_failure_policy=outer.kv_load_failure_policy,
            kv_load_retry_limit=outer.kv_load_retry_limit,
            kv_load_recompute=outer.kv_load_recompute,
            state_interval_blocks=outer.state_interval_blocks,
        )
    except ValueError as error:
        raise ValueError(f"connectors[{index}]: {error}") from error
