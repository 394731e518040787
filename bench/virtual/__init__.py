"""The virtual clock: the fleet (engine_sim's schedulers, the shims' normalisation and load
reports, the routers' planners) replayed as a discrete-event simulation in one process, with no
sockets, no sleeps and no wall time. `kvswitch bench compare --clock virtual` and
`kvswitch bench replay --clock virtual` run on it; docs/benchmarks.md says how faithful it is."""
