"""The library the `rekv bench` command runs: `cli` (its flags and tables), `handoff` and `ttft`
(the in-process benches), `link/` (the two services across an emulated link), `stats` (medians
and bootstrap intervals), `machine` (where a run ran), `memory` (what a process holds). The
standalone scripts live in `bench/`; every result goes under `bench/results/`, indexed by
`bench/results/README.md`; `provenance` is what each result records of the code it measures,
`staleness` which figures the README and docs/ quote from results whose code changed since.
`bench/README.md` lists every benchmark."""
