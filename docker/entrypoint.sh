#!/usr/bin/env bash
# The cluster image's entry check: this node's health gate, then the command.
#
# LLMTRAIN_GATE=1 (the default) runs `llmtrain health --gate` first; a node that fails it
# exits 76 (EXCLUDE_NODE) and the command never starts. LLMTRAIN_GATE_ARGS gives the gate
# the job's config, so the exclusion lands in the job's run dir, e.g.
#   LLMTRAIN_GATE_ARGS="--config llama3_8b --training.run_dir s3://bucket/runs/exp1"
# `llmtrain launch` runs the same gate itself with the job's config, so it is not gated
# twice. LLMTRAIN_GATE=0 skips the gate (debugging a node, running `llmtrain ckpt`).
set -euo pipefail

if [[ $# -eq 0 ]]; then
    set -- llmtrain --help
fi

if [[ "${LLMTRAIN_GATE:-1}" == "1" && ! ( "$1" == "llmtrain" && "${2:-}" == "launch" ) ]]; then
    read -r -a gate_args <<< "${LLMTRAIN_GATE_ARGS:-}"
    llmtrain health --gate "${gate_args[@]}" || exit $?
fi

exec "$@"
