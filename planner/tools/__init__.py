"""The plan tools: read a compiled plan file, never compile one.

`verify` (every invariant, rank by rank: `verify_rank`, `verify_shadow`; a chunked plan's
own rules: `verify_chunked`), `simulate` (a flow-level estimate of the transfer time:
`simflow` its inputs and outputs, `simrates` the max-min fair rates, `simgap` the lines it
prints), `inspect` (the summary; `inspect_placement` an expert placement's lines;
`inspect_chunked` a chunked plan's) and `explain` (one tensor's path, in `inspect`), `plot`
(the pictures), `tensors` (what one rank binds). `planfile` reads a plan file one rank at a
time, checked as the executor's loader checks it. Beside the compiler: the tools import its
shared vocabulary (`planner.writes`, `planner.rows`, `planner.topology`) and nothing in the
compiler imports them; the command line (`planner/cli.py`) calls them.
"""
