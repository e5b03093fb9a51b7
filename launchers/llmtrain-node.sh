#!/usr/bin/env bash
# One node of an llmtrain job, for sites whose scheduler wants a script: the arguments of
# `llmtrain launch` (preflight, health gate, torchrun; exit 0/75/76/78), see launchers/README.md.
exec llmtrain launch "$@"
