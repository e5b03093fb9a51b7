"""Process groups, the DeviceMesh and model parallelization."""
