"""The offline run report (the ``report`` extra: matplotlib): ``llmtrain report RUN_DIR``."""
