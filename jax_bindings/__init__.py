"""moetriton for JAX (the bindings land with the JAX issue)."""
