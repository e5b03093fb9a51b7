"""Sharded async checkpoints: storage and commit protocol, train state, manager."""
