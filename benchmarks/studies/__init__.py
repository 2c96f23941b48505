"""Studies of one question each, beside the workload races and the stability
suite of benchmarks/ (their RESULTS.md sections name the question):

- curvature_batch: statistics from a sub-batch (``curvature_batch_size``).
- distributed: the inverse refresh and the step, 1 vs N devices.
- factor_inverse: one damped inverse by size and method (``max_factor_dim``).
- forward_sharing: does XLA share the capture's forward pass with the user's?
- low_rank_refresh: one refresh of a model's factors, exact and at rank k.
- preconditioning: preconditioning one gradient, exact and at rank k.
- recipe_sweep: fixed-mode settings against a workload's wall-clock target.
- refresh_contention: the inverse refresh on a busy CPU.
- statistics_step: what one statistics step costs on a conv net.
- step_profile: where kfac_optax's step time goes.

Each runs from the repository root as ``python benchmarks/studies/<name>.py``.
"""
