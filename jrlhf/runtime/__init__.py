"""What runs the models: where each role's model comes from, its meshes and weights per phase,
and the jitted train and inference steps."""
