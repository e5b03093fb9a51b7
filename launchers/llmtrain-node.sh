#!/usr/bin/env bash
# One node of an llmtrain job, for sites whose scheduler wants a script: the arguments of
# `llmtrain launch` (preflight, health gate, torchrun; exit 0/75/76/78), see launchers/README.md.
# The exporters listen on every interface, so that Prometheus reaches them from another host
# (the default, loopback, serves only this one); a --metrics.address in the arguments wins.
exec llmtrain launch --metrics.address 0.0.0.0 "$@"
