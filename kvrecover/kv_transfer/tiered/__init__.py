"""`TieredConnector`: several connectors tried in order, each block from the first that has it."""
