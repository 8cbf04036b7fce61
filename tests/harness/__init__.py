"""Test and benchmark infrastructure: local swarms of real nodes, network namespaces with shaped links, forked
launches from one shared image, and timelines of a run. Imported by tests/ and bench/; never by the product."""
