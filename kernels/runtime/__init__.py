"""What runs the kernel families: launch plans (`plan`), the config lookup in the autotune caches
(`autotune`), and whether this process interprets the kernels (`interpreter`). Framework-neutral: the
executors in the bindings turn a plan into allocations and launches."""
