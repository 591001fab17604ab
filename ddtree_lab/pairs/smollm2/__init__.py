"""The SmolLM2 pair's shipped half: its DFlash drafter (`drafter/`) and prompt sets (`prompts/`); the target
is pulled (see the `smollm2` row of ddtree_lab/pairs)."""
