"""kfac_optax's tests, grouped as the package is (kfac_optax/_src/):

- optimizer/: `scale_by_kfac` and `kfac` against brute force, their
  controls (learning rate, momentum, damping, ρ), settings checks, the
  shared options, optax and flax composition, checkpoints.
- curvature/: what the statistics see: masks and weights, sub-batches,
  mixed precision, how the model is called, the losses, `describe`.
- models/: discovery and capture (linen, NNX, lifted transforms,
  registered layers).
- blocks/: every block family against explicit Kronecker-factored
  references.
- linalg/: the inverse methods, blocked Cholesky, low-rank inverses.
- scaling/: data-parallel meshes, distributed inverses, multi-host.
- end_to_end/: the docs' snippets, the examples, convergence against Adam.
- benchmark_modes/: the benchmarks' quick modes.

`test_package_layout.py` holds the package to its layout (no import
circle, class and function lengths, the public top level).
`brute_force.py` holds the explicit computations every numerical claim is
checked against; `nnx_twins.py` the NNX twins of linen test models.
"""
