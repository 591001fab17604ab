"""python -m ddtree_lab.train.smollm2: the same as `ddtree-lab train-smollm2-drafter` (also under torchrun -m)."""
from .pipeline import main

raise SystemExit(main())
