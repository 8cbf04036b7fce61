"""The process a volunteer runs: CLI, config, lifecycle, gRPC service."""
