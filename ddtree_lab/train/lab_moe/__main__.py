"""python -m ddtree_lab.train.lab_moe: the same as `ddtree-lab train-lab-moe`."""
from .pipeline import main

raise SystemExit(main())
