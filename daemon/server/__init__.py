"""The HTTP process. NOTE: nothing under this package may import paddle (tests/test_import_boundary.py)."""
