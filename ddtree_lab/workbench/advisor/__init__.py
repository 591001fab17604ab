"""The budget advisor: which DDTree budget pays on which machine.

The round cost model, two ways: `fit.FittedCost`, per-stage a + b·B + c·B² least-squares fits to measured
stage times (a `bench e2e` JSON or a study's runs) with leave-one-out error; and `cost.round_cost`, first
principles for a named machine (weights read, dense or through the expert union of MoE layers and their row
blocks' re-reads; KV and activation bytes; FLOPs; kernel launches), with efficiency factors fitted once on H200 data
(`calibration.calibrate`, stored in machines.json, the table of GPUs) and checked against bench measurements
(`check.check_bench`). `trace_stats` reads a study's traces (the measured MoE routing, the draft confidence's
calibration); `auto_replay.replay_auto` replays the engine's own budget="auto" rule on them, and
`auto_replay.auto_ceiling` bounds what any choice could gain. `layouts` prices 8-GPU layouts (TP8, EP8: a
rank's shape, the slowest rank's experts, each collective's latency + bytes ÷ bandwidth) on machine profiles with
interconnects (`machines.machine_profile`, the user's figures over the table's); `projection` applies τ per
budget (numbers, serving runs or a study) to one model on one machine. `study` applies a
study's measured τ to the model (`ddtree-lab advise`, advice.json); `figures` is the report's section.
Torch-free below `study` (but for `replay_auto` and `auto_ceiling`, which read the engine's rule): shapes come from configs,
stage times from JSON.
"""
from __future__ import annotations

from .auto_replay import auto_ceiling, best_grouped_choice, replay_auto, tau_at
from .calibration import (calibrate, calibrate_eager, calibrate_int4, calibrate_mla, calibrate_moe, count_layer_census,
                          price_int4_bench, price_mla_bench)
from .check import CHECK_BUDGETS, CHECK_TOLERANCE, check_bench, shipped_bench_files
from .cost import PART_TITLES, PARTS, RoundCost, Terms, counted_layer_kernels, draft_terms, round_cost, verify_terms
from .fit import FIT_KINDS, FIT_STAGES, MIN_FIT_POINTS, FittedCost, bench_points, fit_bench, fit_stage_times, read_bench
from .layouts import (ATTENTION_LAYOUTS, LAYOUTS, RANKS, Collective, Layout, all_reduce, comm_seconds,
                      expected_max_touched, forward_collectives, get_layout, hit_probability, rank_load, rank_shape)
from .machines import (MACHINES_FILE, MEASURED, OVERRIDES, AdvisorError, Calibration, Interconnect, Machine,
                       check_machine_name, get_interconnect, get_machine, known_machines, load_calibration,
                       machine_for_device, machine_profile, machines_data, parse_set, profile_names, read_machine_file,
                       spec_bandwidth)
from .projection import (TauSet, parse_tau, project, projection_table, rank_bench_seconds, taus_from_external,
                         taus_from_numbers, taus_from_study, verdict)
from .shapes import FULL_MODELS, ExpertLoad, ModelShape, census_key, model_shape, quantized_weight_bytes, shape_from_configs, shape_from_dirs
from .trace_stats import expert_load, tau_calibration

__all__ = ["all_reduce", "ATTENTION_LAYOUTS", "Collective", "comm_seconds", "expected_max_touched",
           "forward_collectives", "FULL_MODELS", "get_interconnect", "get_layout", "hit_probability", "Interconnect",
           "Layout", "LAYOUTS", "machine_profile", "OVERRIDES", "parse_set", "parse_tau", "project",
           "projection_table", "quantized_weight_bytes", "RANKS", "rank_bench_seconds", "rank_load", "rank_shape",
           "read_machine_file", "TauSet", "taus_from_external", "taus_from_numbers", "taus_from_study", "verdict",
           "AdvisorError", "auto_ceiling", "bench_points", "best_grouped_choice", "calibrate", "calibrate_int4", "calibrate_mla", "calibrate_moe",
           "Calibration", "census_key", "check_bench", "count_layer_census", "counted_layer_kernels", "CHECK_BUDGETS", "check_machine_name", "CHECK_TOLERANCE", "draft_terms",
           "expert_load", "ExpertLoad", "fit_bench", "FIT_KINDS", "fit_stage_times", "FIT_STAGES", "FittedCost",
           "get_machine", "known_machines", "load_calibration", "Machine", "machine_for_device", "machines_data",
           "price_int4_bench", "price_mla_bench",
           "MACHINES_FILE", "MEASURED", "MIN_FIT_POINTS", "model_shape", "ModelShape", "PART_TITLES", "PARTS",
           "profile_names", "read_bench", "replay_auto", "round_cost", "RoundCost", "shape_from_configs",
           "shape_from_dirs", "shipped_bench_files", "spec_bandwidth", "tau_at", "tau_calibration", "Terms",
           "verify_terms"]
