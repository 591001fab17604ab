"""The workbench: studies, their results and report, and results brought in from serving stacks."""
