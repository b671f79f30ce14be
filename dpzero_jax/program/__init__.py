"""The program front-end: exact private gradients of any JAX model from its traced program (see ``mode``)."""
