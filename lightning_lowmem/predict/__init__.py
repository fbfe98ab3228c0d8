"""The prediction that runs the techniques: ``RunSpec``, the dry run on fake tensors, depth extrapolation, estimates."""
