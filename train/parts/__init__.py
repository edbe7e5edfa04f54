"""The run's parts, each a package with its settings group beside it: data, optim, checkpoint, observe,
eval, config, scoring (the reward stage), policy (the model the run trains); train/run/ assembles them."""
