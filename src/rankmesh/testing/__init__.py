"""Helpers for tests and scripts that need more than one process can give: clusters of real network stacks.

Nothing here is imported by the library itself; :mod:`rankmesh.testing.cluster` starts Ray
clusters whose nodes each have their own network namespace (see its docstring).
"""
