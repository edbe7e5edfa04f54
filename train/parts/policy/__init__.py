"""The model side of a run: the backbone built from its folder, what trains (LoRA or every weight), the
KL reference, sharding, and the predictors ``predict(z, t, cond)`` the rollout, the update and the
evaluation call."""
