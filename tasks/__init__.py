"""Prompt sources and verifiers. Standard library and math-verify only."""
