"""The embedded lab pair: a small code target and its DFlash drafter (see README.md here)."""
