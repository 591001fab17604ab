"""python -m ddtree_lab.train.lab: the same as `ddtree-lab train-lab-pair`."""
from .pipeline import main

raise SystemExit(main())
