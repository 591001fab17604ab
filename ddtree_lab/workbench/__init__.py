"""The workbench around the engine: study files (spec), their runs (runs) executed through papermill
(runner), per-run results and comparisons (results), profiles (profile), every figure (figures), the
draft-tree explorer (viz) and the findings report (report)."""
