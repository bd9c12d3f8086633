"""Code that several test modules use, importable as `tests.helpers.<module>` (the repository root is on the path)."""
