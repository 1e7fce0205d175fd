"""A user's own connector: the shared-storage connector, but the first load fails.

Loaded by module path (`kv_connector_module_path`), which is how you plug your
own connector into kvrecover without touching its code. Every block of the first
request that loads KV is reported invalid without being loaded, the way a store
that lost an entry would; kvrecover must recompute exactly what was lost.
"""

import logging

from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector

logger = logging.getLogger(__name__)


class LoadRecoveryExampleConnector(SharedStorageConnector):
    """SharedStorageConnector whose first load reports all of its blocks invalid."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._failed_once = False

    def _read_blocks(self, transfer, cancelled):
        if not self._failed_once:
            self._failed_once = True
            logger.warning("simulating a failed load of all %d blocks of request %s",
                           len(transfer.block_ids), transfer.request_id)
            return [None] * len(transfer.block_ids)  # None = this block did not load
        return super()._read_blocks(transfer, cancelled)
