"""Launching: the node launcher (preflight, gate, torchrun, spares), the rendezvous store
and the worker's entry under torchrun."""
