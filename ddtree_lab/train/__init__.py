"""Training the drafters (and the lab pair's target): the DFlash recipe once, and the pipelines built on it.

- `recipe`: DFlash training, the block forward, its loss and `train_drafters`, configured by `DFlashRecipe`.
- `pipeline`: the shell every pipeline shares (config, presets, stage runner, frozen target, drafter
  config, pack/unpack of a work dir, CLI), `card`: the shared parts of a model card.
- `generate`, `evaluate`: batched greedy generation and acceptance τ, for pools, training and cards.
- `lab/`: the lab pair (a small Qwen3 target on Python source, then its drafter).
- `smollm2/`: the SmolLM2-135M-Instruct drafter.

This package imports the engine; nothing in the engine imports it (the CLI loads it lazily).
"""
