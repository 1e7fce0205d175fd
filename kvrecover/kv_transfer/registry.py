"""Find connector classes by name, or in a user's module (`kv_connector_module_path`)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorBase, KVConnectorRole

# name -> "module:Class", imported on first use.
_REGISTRY: dict[str, str] = {
    "SharedStorageConnector": "kvrecover.kv_transfer.stores.shared_storage:SharedStorageConnector",
    "ExampleConnector": "kvrecover.kv_transfer.stores.shared_storage:SharedStorageConnector",
    "FaultInjectionConnector": "kvrecover.kv_transfer.faults:FaultInjectionConnector",
    "RedisConnector": "kvrecover.kv_transfer.redis.connector:RedisConnector",
    "TieredConnector": "kvrecover.kv_transfer.tiered.connector:TieredConnector",
    "MultiConnector": "kvrecover.kv_transfer.tiered.connector:TieredConnector",
    "NixlConnector": "kvrecover.kv_transfer.p2p.nixl_connector:NixlConnector",
}


def register_connector(name: str, target: str) -> None:
    """Register a connector class under `name`; `target` is "module:ClassName"."""
    _REGISTRY[name] = target


def registered_connectors() -> list[str]:
    """Names usable as `kv_connector` without a module path."""
    return sorted(_REGISTRY)


def _import_module(module_path: str):
    """Import a dotted module name, or a `.py` file path."""
    if module_path.endswith(".py") or "/" in module_path:
        path = Path(module_path).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"kv_connector_module_path {module_path!r}: no such file")
        name = f"kvrecover_user_connector_{path.stem}"
        loaded = sys.modules.get(name)
        if loaded is not None and getattr(loaded, "__file__", None) == str(path):
            # Imported once per process, like any module: both roles share its classes.
            return loaded
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"kv_connector_module_path {module_path!r}: not an importable "
                             "Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    return importlib.import_module(module_path)


def connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The class `config` names; a ValueError that says what to fix otherwise."""
    if config.kv_connector_module_path:
        try:
            module = _import_module(config.kv_connector_module_path)
        except ValueError:
            raise
        except Exception as error:
            raise ValueError(
                f"kv_connector_module_path {config.kv_connector_module_path!r} could not be "
                f"imported: {error!r}"
            ) from error
        cls = getattr(module, config.kv_connector, None)
        if cls is None:
            raise ValueError(
                f"module {config.kv_connector_module_path!r} has no class named "
                f"{config.kv_connector!r} (kv_connector)"
            )
    else:
        target = _REGISTRY.get(config.kv_connector)
        if target is None:
            raise ValueError(
                f"unknown kv_connector {config.kv_connector!r}; registered connectors: "
                f"{', '.join(registered_connectors())} (or set kv_connector_module_path)"
            )
        module_name, class_name = target.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"kv_connector {config.kv_connector!r} is not a KVConnectorBase subclass")
    return cls


def create_connector(
    config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout
) -> KVConnectorBase:
    """Instantiate the configured connector for one role."""
    return connector_class(config)(config, role, layout)
