"""Repo-level pytest configuration: the mlacheck plugin is loaded through its pytest11 entry point."""
