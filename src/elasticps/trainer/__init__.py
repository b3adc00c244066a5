"""The trainer: runs the model on tasks, pushes gradients, pulls parameters."""
