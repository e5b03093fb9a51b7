"""llmtrain: FSDP2 + FP8 Llama training that survives the failures of large GPU jobs."""

__version__ = "0.1.0"
