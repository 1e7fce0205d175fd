"""Store connectors: the stored block format, the machinery every store connector shares
(scheduler role, loads and saves, reader threads, staged I/O, recurrent-state entries) and
the folder store (`SharedStorageConnector`)."""
