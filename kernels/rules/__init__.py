"""Framework-neutral rules and shape arithmetic: argument validation (one module per op family), the MoE
layer's static sizes and exchange formulas, and the named shapes. Pure Python on shapes, dtype names and
Python numbers; both bindings call these, so the two frameworks raise the same errors and size the same
buffers."""
