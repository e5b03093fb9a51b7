"""The fault harness (the ``chaos`` extra): fault kinds injected into real runs, the
fault-injecting FUSE filesystem and its mount, a loopback NFS mount (nfs-ganesha and a
FUSE NFS client), several "nodes" on one machine, and chaos runs with their verdicts. Training never imports it: ``llmtrain.fault_points`` loads the
fault kinds only when a run asks for faults."""
