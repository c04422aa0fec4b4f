"""Protocol buffer sources for tahnode's wire messages and the generated Python modules.

Regenerate with `make proto`; tests/test_proto.py fails when the committed modules are stale."""
