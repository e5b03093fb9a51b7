"""``python -m llmtrain`` (what ``torchrun -m llmtrain`` runs)."""

from llmtrain.cli import main

raise SystemExit(main())
