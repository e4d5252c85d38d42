"""Tools that stand apart from the roles: the `moerl` console script (`cli`), the container checks (`doctor`), the
AWS account check (`preflight`), the local run, `moerl eval`, the example data and the benchmarks (`bench`).
They may import every room; nothing but tests imports them."""
