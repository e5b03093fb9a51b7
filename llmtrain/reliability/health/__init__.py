"""GPU and node health: NVML checks (real or scripted), the preflight gate, the in-training
monitor and the run's exclusion record.

Site plugins (``health.plugins``) build their results with ``Finding``, importable from here.
"""

from llmtrain.reliability.health.checks import Finding

__all__ = ["Finding"]
