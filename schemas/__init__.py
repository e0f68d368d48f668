"""The two file formats and their checks: the config (`config`, `config_load`), the plan file
(`header`, `plan`, `plan_codec`, `plan_write`, `chunked_plan`), the bounded reader every
file and socket read goes through (`safe_read`), and the checks both the planner and the
executor hold a plan to (`bounds`, `runs`, `integrity`, `rankcheck`). A regular package, so
one checkout's `schemas` never mixes with another's."""
