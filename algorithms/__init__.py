"""Pure torch math of StableAsync: advantages, stabilizers, diagnostics and the stabilizer registry.

Imports nothing beyond torch and the standard library, so every formula is testable in isolation.
"""
