"""The swarm as seen from one node: DHT membership, identity, averaging transport (hivemind)."""
