"""The lab-moe pair: a small DeepSeek-V3-architecture code target and its DFlash drafter (README.md here, once
`ddtree-lab train-lab-moe` has written the weights; docs/lab_moe.md). Its prompt sets are the lab pair's."""
